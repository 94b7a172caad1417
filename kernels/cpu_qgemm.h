/* lp_qgemm's scaffolding, the same for every path: Y[M, N] = X[M, K] @ W[N, K]^T where W is kept as a GGUF file
 * stores it, in runs ("groups") of 32 weights along each row (16 for Q6_K, whose sub-blocks are that short):
 * w = scale * q + min, q a small integer. Torch's fp32 GEMM reads 4 bytes per weight and reaches well under the
 * CPU's peak on 16-row batches; here q takes 4 bits (Q4_0, Q4_1, Q4_K), 5 (Q5_0, Q5_1, Q5_K), 6 (Q6_K) or 8 (Q8_0),
 * plus a scale and a min per group, each a byte times an fp16 per K-quant block. For 5 or more rows of X each tile
 * of 16 weight rows is expanded once into an fp32 panel in L1/L2, then swept 6 rows at a time by a register kernel; for 1-4 rows each column is
 * expanded in registers instead. The expansion multiplies then adds in separate roundings, so the weights used are
 * exactly the fp32 values of gguf-py's dequantisation: only the order of the dot products' additions differs from
 * a float32 run.
 *
 * Packed layout (kernels/cpu.py pack_blocks, lp_pack_q in cpu_pack.c): for tile t of 16 rows, j = row within the
 * tile, k = column, q = stored value - offset (one integer per weight; Q4_0's -8..7 are stored as 0..15):
 *   8 bits: q[t][k][j] int8
 *   4 bits: q[t][k/2][j] for even k, a byte holding row j's value in column k in its low four bits and in
 *           column k + 1 in its high four (a tile column's 16 values in 8 bytes, read two columns at a time)
 *   5 bits: those K * 8 bytes, then K 16-bit words: bit j of word k is bit 4 of row j's value in column k
 *   6 bits: those K * 8 bytes, then per 8 columns 8s .. 8s + 7 sixteen 16-bit words, one a row: bits 2c and 2c + 1
 *           of row j's word are bits 4 and 5 of its value in column 8s + c (the one-row int16 kernel spreads a step's
 *           over its lanes with one vpmultishiftqb; Q6_K in 0.75 bytes a weight, where 8 bits cost it a third more)
 *   scales: lp_scales (cpu_kernels.h): per tile, group and row an fp16 unit times an int8, rebuilt as an fp32 table
 *           scale[k/G][j] and min[k/G][j] a tile at a time (cpu_scales.h; G: the group, 32 or 16; no min where
 *           every min is 0: Q4_0, Q5_0, Q8_0, Q6_K, whose weights are scale * q alone)
 *
 * Each path's source (cpu_kernels_avx2.c, cpu_kernels_portable.c) defines the inner loops under these names, each
 * inlined with BITS, HAS_OFFSET, GROUP, HAS_MIN and R constants, then includes this file once:
 *   qgemm_offset, qgemm_offset_of(int)       the stored values' offset, in the form its loops take it
 *   expand_panel(BITS, HAS_OFFSET, GROUP, HAS_MIN, q, offset, scale, min, K, P)   a tile into the fp32 panel P
 *   rows_times_panel(R, X, K, P, Y, ldy)     R <= 6 rows of X times the panel
 *   rows_times_tile(BITS, HAS_OFFSET, GROUP, HAS_MIN, R, X, K, q, offset, scale, min, Y, ldy)   R <= 4 rows of X
 *                                            times a tile, its columns expanded in registers
 */

#include "cpu_scales.h"

#if defined(__AVX512F__)
#define QGEMM_SCALES_AVX512 1
#else
#define QGEMM_SCALES_AVX512 0
#endif

static __thread float *panel = NULL; /* one per OpenMP thread, grown to the widest K seen */
static __thread long panel_floats = 0;

/* One tile of 16 weight rows against all M rows of X: LP_OK, or LP_OUT_OF_MEMORY when no panel can be had. */
static inline __attribute__((always_inline)) int qgemm_tile(
    const int BITS, const int HAS_OFFSET, const int GROUP, const int HAS_MIN, long t, const float *X, long M, long K,
    const int8_t *q, qgemm_offset offset, const lp_scales *scales, long N_padded, float *Y) {
    const long tile_bytes = K * 2 * BITS; /* 16 rows: 2 bytes a bit */
    const int8_t *qt = q + t * tile_bytes;
    const float *st, *mt;
    if (tile_scales(QGEMM_SCALES_AVX512, scales, t, K / GROUP, &st, &mt) != LP_OK) return LP_OUT_OF_MEMORY;
    float *y = Y + t * TILE;
    if (M <= 4) {
        switch (M) {
            case 4: rows_times_tile(BITS, HAS_OFFSET, GROUP, HAS_MIN, 4, X, K, qt, offset, st, mt, y, N_padded); break;
            case 3: rows_times_tile(BITS, HAS_OFFSET, GROUP, HAS_MIN, 3, X, K, qt, offset, st, mt, y, N_padded); break;
            case 2: rows_times_tile(BITS, HAS_OFFSET, GROUP, HAS_MIN, 2, X, K, qt, offset, st, mt, y, N_padded); break;
            case 1: rows_times_tile(BITS, HAS_OFFSET, GROUP, HAS_MIN, 1, X, K, qt, offset, st, mt, y, N_padded); break;
        }
        return LP_OK;
    }
    if (panel_floats < K * TILE) {
        free(panel);
        panel = aligned_alloc(64, K * TILE * sizeof(float));
        panel_floats = panel ? K * TILE : 0;
        if (!panel) return LP_OUT_OF_MEMORY;
    }
    expand_panel(BITS, HAS_OFFSET, GROUP, HAS_MIN, qt, offset, st, mt, K, panel);
    long r = 0;
    for (; r + 6 <= M; r += 6) rows_times_panel(6, X + r * K, K, panel, y + r * N_padded, N_padded);
    const float *x = X + r * K;
    y += r * N_padded;
    switch (M - r) {
        case 5: rows_times_panel(5, x, K, panel, y, N_padded); break;
        case 4: rows_times_panel(4, x, K, panel, y, N_padded); break;
        case 3: rows_times_panel(3, x, K, panel, y, N_padded); break;
        case 2: rows_times_panel(2, x, K, panel, y, N_padded); break;
        case 1: rows_times_panel(1, x, K, panel, y, N_padded); break;
    }
    return LP_OK;
}

/* One function per (bits, offset or not, group, min or not), its OpenMP loop written where those are literals.
 * GCC outlines a parallel region before it inlines, so a region inside an inlined function would see them as
 * variables: the inner loops lose their constant bounds and unrolling, and a one-row projection runs markedly
 * slower (benchmarks/cpu_kernel_bench.py times the default model's one-row projections). */
#define QGEMM_FN(BITS, HAS_OFFSET, GROUP, HAS_MIN)                                                                   \
    static int qgemm_##BITS##_##HAS_OFFSET##_##GROUP##_##HAS_MIN(const float *X, long M, long K, const int8_t *q,     \
                                                                 int q_offset, const lp_scales *scales,               \
                                                                 long N_padded, float *Y) {                           \
        const qgemm_offset offset = qgemm_offset_of(q_offset);                                                        \
        int status = LP_OK;                                                                                           \
        _Pragma("omp parallel for schedule(static)") for (long t = 0; t < N_padded / TILE; t++) {                    \
            if (qgemm_tile(BITS, HAS_OFFSET, GROUP, HAS_MIN, t, X, M, K, q, offset, scales, N_padded, Y) != LP_OK)  \
                _Pragma("omp atomic write") status = LP_OUT_OF_MEMORY;                                                \
        }                                                                                                             \
        return status;                                                                                                \
    }
#define QGEMM_FNS(BITS, HAS_OFFSET) \
    QGEMM_FN(BITS, HAS_OFFSET, 16, 0) QGEMM_FN(BITS, HAS_OFFSET, 16, 1) QGEMM_FN(BITS, HAS_OFFSET, 32, 0) QGEMM_FN(BITS, HAS_OFFSET, 32, 1)
QGEMM_FNS(4, 0)
QGEMM_FNS(4, 1)
QGEMM_FNS(5, 0)
QGEMM_FNS(5, 1)
QGEMM_FNS(6, 0)
QGEMM_FNS(6, 1)
QGEMM_FNS(8, 0) /* 8-bit values are stored as they are: never an offset */

/* X: [M, K] contiguous; N_padded a multiple of 16; Y: [M, N_padded] contiguous; bits (8, 4, 5 or 6), offset, group
 * (32 or 16, dividing K) and scales (with or without mins): the layout above. Each (bits, offset or not, group, min
 * or not) is its own instance, so the inner loops keep constant bounds and no dead work. */
#define QGEMM_CALL(BITS, HAS_OFFSET, GROUP, HAS_MIN) \
    qgemm_##BITS##_##HAS_OFFSET##_##GROUP##_##HAS_MIN(X, M, K, q, offset, scales, N_padded, Y)
#define QGEMM_BY_MIN(BITS, HAS_OFFSET, GROUP) \
    (scales->min_unit ? QGEMM_CALL(BITS, HAS_OFFSET, GROUP, 1) : QGEMM_CALL(BITS, HAS_OFFSET, GROUP, 0))
#define QGEMM_BY_GROUP(BITS, HAS_OFFSET) \
    (group == 16 ? QGEMM_BY_MIN(BITS, HAS_OFFSET, 16) : QGEMM_BY_MIN(BITS, HAS_OFFSET, 32))
int lp_qgemm(const float *X, int64_t M, int64_t K, const int8_t *q, const lp_scales *scales, int64_t N_padded,
             int bits, int offset, int group, float *Y) {
    if (!packed_bits(bits) || !qgemm_sizes_fit(M, K, N_padded, group, scales)) return LP_BAD_ARGUMENT;
    if (bits == 4) return offset ? QGEMM_BY_GROUP(4, 1) : QGEMM_BY_GROUP(4, 0);
    if (bits == 5) return offset ? QGEMM_BY_GROUP(5, 1) : QGEMM_BY_GROUP(5, 0);
    if (bits == 6) return offset ? QGEMM_BY_GROUP(6, 1) : QGEMM_BY_GROUP(6, 0);
    return QGEMM_BY_GROUP(8, 0);
}
