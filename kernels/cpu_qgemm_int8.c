/* lp_qgemm_int8 and lp_pack_quads: Y[M, N] = X[M, K] @ W[N, K]^T with X's rows quantised to int8, as llama.cpp
 * computes a GGUF's matmuls. Built into every path's library: plain C, plus an AVX-512 VNNI kernel (each
 * vpdpbusd multiplies 32 byte pairs and adds them in fours) compiled for that instruction set alone and chosen at
 * run time where the CPU has it.
 *
 * Why: the float32 kernels (cpu_qgemm.h) widen every weight to fp32 before one multiply-add per weight and row;
 * for the few rows of a decode step that widening is most of the work. Here each run ("group") of 32 or 16
 * values of a row of X becomes int8 with one fp32 scale (amax / 127), every weight stays the small unsigned
 * integer the file stores (u = q + offset >= 0), and a group's dot product is exact integer arithmetic
 * (lp_round_rows, cpu_activations.h says how). The only rounding added is X's to 8 bits, so the
 * values differ from the exact path's (engine/setup.py says when a model runs this way, and how far they differ).
 *
 * Packed layout ("quads", lp_pack_quads): tile t of 16 weight rows, quad c = columns 4c .. 4c + 3, j = row within
 * the tile, u as above:
 *   4 bits: 32 bytes a quad; byte 4j + i (j < 8) holds row j's u at column 4c + i in its low half, row j + 8's
 *           in its high half;
 *   8 bits: 64 bytes a quad; byte 4j + i holds row j's u at column 4c + i (5- and 6-bit values are stored this
 *           way too).
 * Each 32-bit lane then holds one row's four columns: one vpdpbusd against four int8 values of X broadcast to
 * every lane adds 4 columns x 8 rows. Scales and mins are as lp_qgemm takes them (cpu_scales.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_activations.h"
#include "cpu_kernels.h"
#include "cpu_scales.h"

/* q [N, K] int8 (a GGUF tensor's rows, unpacked) -> the quads layout above, bits 4 or 8, u = q + offset (which
 * must lie in 0 .. 2^bits - 1); rows past N (padding up to a whole tile) hold u = 0. */
int lp_pack_quads(const int8_t *q, int64_t N, int64_t K, int bits, int offset, uint8_t *out) {
    if ((bits != 4 && bits != 8) || N < 0 || K < 0 || K % 4) return LP_BAD_ARGUMENT;
    const long tiles = (N + TILE - 1) / TILE, tile_bytes = K * 2 * bits;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < tiles; t++) {
        uint8_t *o = out + t * tile_bytes;
        for (long c = 0; c < K / 4; c++)
            for (int i = 0; i < 4; i++) {
                int u[TILE];
                for (int j = 0; j < TILE; j++) u[j] = t * TILE + j < N ? q[(t * TILE + j) * K + 4 * c + i] + offset : 0;
                if (bits == 8)
                    for (int j = 0; j < TILE; j++) o[c * 64 + 4 * j + i] = (uint8_t)u[j];
                else
                    for (int j = 0; j < TILE / 2; j++) o[c * 32 + 4 * j + i] = (uint8_t)((u[j] & 15) | ((u[j + 8] & 15) << 4));
            }
    }
    return LP_OK;
}

/* Row j of tile qt at column k: its stored u. */
static inline int stored(const uint8_t *qt, int bits, long k, int j) {
    if (bits == 8) return qt[k / 4 * 64 + 4 * j + k % 4];
    const uint8_t byte = qt[k / 4 * 32 + 4 * (j % 8) + k % 4];
    return j < 8 ? byte & 15 : byte >> 4;
}

/* Rows r0 .. r0 + R - 1 of X against tile t, in plain C: any CPU. */
static void tile_rows_plain(const lp_rounded_rows *x, long r0, long R, long K, long G, const uint8_t *qt, int bits,
                            int offset, const float *scale, const float *min, float *y, long ldy) {
    for (long i = r0; i < r0 + R; i++)
        for (int j = 0; j < TILE; j++) {
            float acc = 0.0f;
            for (long g = 0; g < K / G; g++) {
                int32_t dot = 0;
                for (long k = g * G; k < (g + 1) * G; k++) dot += stored(qt, bits, k, j) * x->xq8[i * K + k];
                dot -= offset * x->qsum[i * (K / G) + g];
                acc += scale[g * TILE + j] * (x->scale[i * (K / G) + g] * (float)dot);
                if (min) acc += min[g * TILE + j] * x->sum[i * (K / G) + g];
            }
            y[i * ldy + j] = acc;
        }
}

#if defined(__x86_64__)
#include <immintrin.h>
#define VNNI __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")))

/* R rows (<= 4, a constant after inlining) from r0 against one tile: per group, each row's 16 integer dot products
 * in two registers of 8 lanes (rows 0-7 and 8-15 of the tile), then scaled into fp32 accumulators. */
static inline __attribute__((always_inline)) VNNI void tile_rows_vnni(
    const int BITS, const int GROUP, const int HAS_OFFSET, const int HAS_MIN, const int R, const lp_rounded_rows *x,
    long r0, long K, const uint8_t *qt, int offset, lp_tile_factors scale, lp_tile_factors min, float *y, long ldy) {
    const long groups = K / GROUP;
    __m256 f_lo[4], f_hi[4];
    for (int i = 0; i < R; i++) f_lo[i] = f_hi[i] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (long g = 0; g < groups; g++) {
        __m256i a_lo[4], a_hi[4];
        for (int i = 0; i < R; i++) a_lo[i] = a_hi[i] = _mm256_setzero_si256();
        prefetch_group(qt, g, GROUP, BITS, PREFETCH_BYTES, 0);
        for (long c = g * GROUP / 4; c < (g + 1) * GROUP / 4; c++) {
            __m256i lo, hi;
            if (BITS == 4) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qt + c * 32));
                lo = _mm256_and_si256(v, low4);
                hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            } else {
                lo = _mm256_loadu_si256((const __m256i *)(qt + c * 64));
                hi = _mm256_loadu_si256((const __m256i *)(qt + c * 64 + 32));
            }
            for (int i = 0; i < R; i++) {
                int32_t four; /* X's four int8 values at these columns */
                memcpy(&four, x->xq8 + (r0 + i) * K + 4 * c, sizeof four);
                const __m256i xb = _mm256_set1_epi32(four);
                a_lo[i] = _mm256_dpbusd_epi32(a_lo[i], lo, xb);
                a_hi[i] = _mm256_dpbusd_epi32(a_hi[i], hi, xb);
            }
        }
        const __m512 s = group_values16(scale, g);
        const __m256 s_lo = half8(s, 0), s_hi = half8(s, 1);
        const __m512 m = HAS_MIN ? group_values16(min, g) : _mm512_setzero_ps();
        for (int i = 0; i < R; i++) {
            const long at = (r0 + i) * groups + g;
            if (HAS_OFFSET) {
                const __m256i correction = _mm256_set1_epi32(offset * x->qsum[at]);
                a_lo[i] = _mm256_sub_epi32(a_lo[i], correction);
                a_hi[i] = _mm256_sub_epi32(a_hi[i], correction);
            }
            const __m256 xs = _mm256_set1_ps(x->scale[at]);
            f_lo[i] = _mm256_fmadd_ps(s_lo, _mm256_mul_ps(xs, _mm256_cvtepi32_ps(a_lo[i])), f_lo[i]);
            f_hi[i] = _mm256_fmadd_ps(s_hi, _mm256_mul_ps(xs, _mm256_cvtepi32_ps(a_hi[i])), f_hi[i]);
            if (HAS_MIN) {
                const __m256 sum = _mm256_set1_ps(x->sum[at]);
                f_lo[i] = _mm256_fmadd_ps(half8(m, 0), sum, f_lo[i]);
                f_hi[i] = _mm256_fmadd_ps(half8(m, 1), sum, f_hi[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        _mm256_storeu_ps(y + (r0 + i) * ldy, f_lo[i]);
        _mm256_storeu_ps(y + (r0 + i) * ldy + 8, f_hi[i]);
    }
}

/* Every tile against every row, 4 rows at a time: one instance per (bits, group, offset or not, min or not), each
 * with its OpenMP loop where those are literals (see cpu_qgemm.h's QGEMM_FN for why). */
#define QGEMM_INT8_FN(BITS, GROUP, HAS_OFFSET, HAS_MIN)                                                              \
    static VNNI void qgemm_int8_##BITS##_##GROUP##_##HAS_OFFSET##_##HAS_MIN(                                         \
        const lp_rounded_rows *x, long M, long K, const uint8_t *q, int offset, const lp_scales *scales,              \
        long N_padded, float *Y) {                                                                                    \
        const long tile_bytes = K * 2 * BITS;                                                                         \
        _Pragma("omp parallel for schedule(static)") for (long t = 0; t < N_padded / TILE; t++) {                    \
            const uint8_t *qt = q + t * tile_bytes;                                                                   \
            const lp_tile_factors st = tile_factors(scales->unit, scales->mult, scales->unit_groups, t, K / GROUP);   \
            const lp_tile_factors mt = tile_factors(scales->min_unit, scales->min_mult, scales->unit_groups, t, K / GROUP); \
            float *y = Y + t * TILE;                                                                                  \
            long r = 0;                                                                                               \
            for (; r + 4 <= M; r += 4)                                                                                \
                tile_rows_vnni(BITS, GROUP, HAS_OFFSET, HAS_MIN, 4, x, r, K, qt, offset, st, mt, y, N_padded);       \
            switch (M - r) {                                                                                          \
                case 3: tile_rows_vnni(BITS, GROUP, HAS_OFFSET, HAS_MIN, 3, x, r, K, qt, offset, st, mt, y, N_padded); break; \
                case 2: tile_rows_vnni(BITS, GROUP, HAS_OFFSET, HAS_MIN, 2, x, r, K, qt, offset, st, mt, y, N_padded); break; \
                case 1: tile_rows_vnni(BITS, GROUP, HAS_OFFSET, HAS_MIN, 1, x, r, K, qt, offset, st, mt, y, N_padded); break; \
            }                                                                                                         \
        }                                                                                                             \
    }
#define QGEMM_INT8_FNS(BITS, GROUP) \
    QGEMM_INT8_FN(BITS, GROUP, 0, 0) QGEMM_INT8_FN(BITS, GROUP, 0, 1) QGEMM_INT8_FN(BITS, GROUP, 1, 0) QGEMM_INT8_FN(BITS, GROUP, 1, 1)
QGEMM_INT8_FNS(4, 32)
QGEMM_INT8_FNS(4, 16)
QGEMM_INT8_FNS(8, 32)
QGEMM_INT8_FNS(8, 16)

#define QGEMM_INT8_CALL(BITS, GROUP, HAS_OFFSET, HAS_MIN) \
    qgemm_int8_##BITS##_##GROUP##_##HAS_OFFSET##_##HAS_MIN(&x, M, K, q, offset, scales, N_padded, Y)
#define QGEMM_INT8_BY_MIN(BITS, GROUP, HAS_OFFSET) \
    (scales->min_unit ? QGEMM_INT8_CALL(BITS, GROUP, HAS_OFFSET, 1) : QGEMM_INT8_CALL(BITS, GROUP, HAS_OFFSET, 0))
#define QGEMM_INT8_BY_OFFSET(BITS, GROUP) \
    (offset ? QGEMM_INT8_BY_MIN(BITS, GROUP, 1) : QGEMM_INT8_BY_MIN(BITS, GROUP, 0))
#define QGEMM_INT8_BY_GROUP(BITS) (group == 16 ? QGEMM_INT8_BY_OFFSET(BITS, 16) : QGEMM_INT8_BY_OFFSET(BITS, 32))

#endif

/* X: [M, K] fp32; q in the quads layout of `bits` (4 or 8) with `offset`; scales as lp_qgemm takes them, in groups
 * of `group` (32 or 16, dividing K); Y: [M, N_padded]. */
int lp_qgemm_int8(const float *X, int64_t M, int64_t K, const int8_t *q_signed, const lp_scales *scales,
                  int64_t N_padded, int bits, int offset, int group, float *Y) {
    if ((bits != 4 && bits != 8) || !qgemm_sizes_fit(M, K, N_padded, group, scales)) return LP_BAD_ARGUMENT;
    const uint8_t *q = (const uint8_t *)q_signed;
    lp_rounded_rows x;
    int status = lp_round_rows(X, M, K, group, 8, &x);
    if (status != LP_OK) return status;
#if defined(__x86_64__)
    if (lp_has_vnni()) {
        if (bits == 4) QGEMM_INT8_BY_GROUP(4);
        else QGEMM_INT8_BY_GROUP(8);
        lp_free_rows(&x);
        return LP_OK;
    }
#endif
    const long tile_bytes = K * 2 * bits;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < N_padded / TILE; t++) {
        const float *st, *mt;
        if (tile_scales(0, scales, t, K / group, &st, &mt) != LP_OK) {
#pragma omp atomic write
            status = LP_OUT_OF_MEMORY;
            continue;
        }
        tile_rows_plain(&x, 0, M, K, group, q + t * tile_bytes, bits, offset, st, mt, Y + t * TILE, N_padded);
    }
    lp_free_rows(&x);
    return status;
}
