/* lp_qgemm_amx: Y[M, N] = X[M, K] @ W[N, K]^T on AMX tiles, for a prompt's rows, on the packed tiles lp_qgemm_int16
 * reads (cpu_qgemm.h's layout). Built into every path's library, compiled for AMX alone and chosen at run time where
 * the CPU has AMX-BF16 and Linux grants it (lp_amx, cpu_cascade_amx.c); elsewhere it is lp_qgemm_int16.
 *
 * Why: a prefill's projections are bound by their multiply-adds, and one AMX instruction makes 16 x 16 x 32 bfloat16
 * products where a VNNI one makes 16 x 2 int16 ones.
 *
 * Exactness: a weight is unit * (mult * q) + min, unit an fp16 per block of groups (a K-quant's 256 weights, a legacy
 * type's 32), mult a small integer per group (cpu_scales.h). mult * q is an integer of at most 15 bits, so it is
 * exactly hi + lo in bfloat16 (its top 8 significant bits, then the rest). A value of X is hi + lo in bfloat16 too,
 * each rounded to nearest: within 2^-16 of it, where int16 activations are within 2^-16 of their group's largest. A
 * block's products are summed in float32 in the tile, x.hi w.hi + x.lo w.hi + x.hi w.lo (x.lo w.lo, under 2^-15 of
 * the product, is left out), then scaled by unit; the min term is each group's float32 sum of X times its min. Every
 * row's result is the same whatever the other rows of the call (tests/kernels/test_cpu_qgemm_amx.py).
 *
 * Layout: X's rows are split once into A operands, 16 rows by 32 columns, each 1 KiB contiguous. Each thread takes
 * PAIRS pairs of weight tiles (256 rows of W) and lays out BLOCK_COLS of their columns at a time as B operands (pairs
 * of columns, hi and lo: 512 KiB, in L2), which every 32 rows of X then sweep: four accumulator tiles (tiles 0-3:
 * X's rows 0-15 or 16-31 by W's first or second tile), X's hi or lo in tiles 4-5, W's hi or lo in tiles 6-7.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_scales.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu_amx.h"
#include "cpu_qgemm_pairs.h"

#define AMXQ __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512bf16,amx-tile,amx-bf16")))
#define INLINE_AMXQ static inline __attribute__((always_inline)) AMXQ

/* Pair p of tile qt as bfloat16 pairs of mult * (u - offset), hi and lo: lane j holds row j's columns 2p and 2p + 1
 * (2p's in the low half), as AMX's B operand takes a pair of columns. */
INLINE_AMXQ void pair_terms(const int BITS, const int8_t *qt, long K, long p, int offset, __m512i mult, __m512i *hi,
                            __m512i *lo) {
    const __m512i w = pair_weights(BITS, qt, K, p), off = _mm512_set1_epi32(offset);
    const __m512i upper = _mm512_set1_epi32((int)0xFFFF0000);
    const __m512i v0 = _mm512_mullo_epi32(_mm512_sub_epi32(_mm512_srai_epi32(_mm512_slli_epi32(w, 16), 16), off), mult);
    const __m512i v1 = _mm512_mullo_epi32(_mm512_sub_epi32(_mm512_srai_epi32(w, 16), off), mult);
    const __m512 f0 = _mm512_cvtepi32_ps(v0), f1 = _mm512_cvtepi32_ps(v1); /* exact: at most 15 bits */
    const __m512i h0 = _mm512_and_si512(_mm512_castps_si512(f0), upper), h1 = _mm512_and_si512(_mm512_castps_si512(f1), upper);
    const __m512i l0 = _mm512_castps_si512(_mm512_sub_ps(f0, _mm512_castsi512_ps(h0)));
    const __m512i l1 = _mm512_castps_si512(_mm512_sub_ps(f1, _mm512_castsi512_ps(h1)));
    *hi = _mm512_or_si512(h1, _mm512_srli_epi32(h0, 16));
    *lo = _mm512_or_si512(_mm512_and_si512(l1, upper), _mm512_srli_epi32(l0, 16));
}

/* X [M, K] as hi + lo bfloat16 (rows past M zero), in AMX A tiles of 16 rows by 32 columns, each tile's 1 KiB
 * contiguous: tile (row block b, columns c) at (b * K / 32 + c) * 512 values. Rows K * 2 bytes apart would put a
 * tile's 16 rows in one L1 set. And each group's float32 sum [Mp, K / G]. */
static AMXQ void split_rows(const float *X, long M, long Mp, long K, long G, uint16_t *hi, uint16_t *lo, float *sum) {
#pragma omp parallel for schedule(static)
    for (long i = 0; i < Mp; i++)
        for (long g = 0; g < K / G; g++) {
            __m512 total = _mm512_setzero_ps();
            for (long k = g * G; k < (g + 1) * G; k += 16) {
                const __m512 x = i < M ? _mm512_loadu_ps(X + i * K + k) : _mm512_setzero_ps();
                const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
                const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                const long at = ((i / 16 * (K / 32) + k / 32) * 16 + i % 16) * 32 + k % 32;
                _mm256_storeu_si256((__m256i *)(hi + at), h);
                _mm256_storeu_si256((__m256i *)(lo + at), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, hf)));
                total = _mm512_add_ps(total, x);
            }
            sum[i * (K / G) + g] = _mm512_reduce_add_ps(total);
        }
}

#define PAIRS 8        /* pairs of weight tiles a thread takes at a time */
#define BLOCK_COLS 512 /* their columns laid out at a time: whole blocks of groups (at most 256 columns each) */

/* The four accumulators plus X's rows 0-15 (a) and 16-31 (b) times the two weight tiles in tiles 6 and 7. */
INLINE_AMXQ void four_products(const uint16_t *a, const uint16_t *b) {
    _tile_loadd(4, a, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

/* X's rows r0 .. r0 + rows - 1 (rows <= 32) times nt (1 or 2) weight tiles laid out in b (columns kb .. k1 - 1,
 * block_pairs pairs of columns each for hi and lo), added into y (row stride ldy). */
INLINE_AMXQ void pair_rows(const int GROUP, const int HAS_MIN, long r0, long rows, long kb, long k1, long K,
                           long span, const uint16_t *xhi, const uint16_t *xlo, const float *xsum, const __m512i *b,
                           long block_pairs, const lp_tile_factors st[2], const lp_tile_factors mt[2], long nt,
                           float *y, long ldy) {
    float c[4][16][16] __attribute__((aligned(64)));
    const long groups = K / GROUP;
    const uint16_t *h0 = xhi + r0 * K, *h1 = xhi + (r0 + 16) * K, *l0 = xlo + r0 * K, *l1 = xlo + (r0 + 16) * K;
    for (long u0 = kb; u0 < k1; u0 += span) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long k = u0; k < u0 + span; k += 32) {
            /* tile (block, columns k .. k + 31) of X's split starts 16 * k values into the block (split_rows); W's
             * pair of columns p of the block at b[p] (hi of tile 0, lo of tile 0, hi of tile 1, lo of tile 1) */
            const __m512i *w = b + (k - kb) / 2;
            _tile_loadd(6, w, 64);
            _tile_loadd(7, w + 2 * block_pairs, 64);
            four_products(h0 + 16 * k, h1 + 16 * k); /* x.hi w.hi */
            four_products(l0 + 16 * k, l1 + 16 * k); /* x.lo w.hi */
            _tile_loadd(6, w + block_pairs, 64);
            _tile_loadd(7, w + 3 * block_pairs, 64);
            four_products(h0 + 16 * k, h1 + 16 * k); /* x.hi w.lo */
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        const long g0 = u0 / GROUP, ng = span / GROUP; /* at most 16 groups a span */
        for (long n = 0; n < nt; n++) {
            const __m512 unit = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st[n].unit + u0 / span * TILE)));
            __m512 mins[16];
            if (HAS_MIN)
                for (long g = 0; g < ng; g++) mins[g] = group_values16(mt[n], g0 + g);
            for (long i = 0; i < rows; i++) {
                float *at = y + i * ldy + 16 * n;
                __m512 a = _mm512_fmadd_ps(unit, _mm512_load_ps(c[2 * (i / 16) + n][i % 16]), _mm512_loadu_ps(at));
                if (HAS_MIN)
                    for (long g = 0; g < ng; g++)
                        a = _mm512_fmadd_ps(mins[g], _mm512_set1_ps(xsum[(r0 + i) * groups + g0 + g]), a);
                _mm512_storeu_ps(at, a);
            }
        }
    }
}

/* Weight tiles t0 .. t0 + tiles - 1 (at most 2 * PAIRS) against every row of X, BLOCK_COLS columns at a time,
 * added into Y (zeroed). panel: 4 * PAIRS * BLOCK_COLS / 2 vectors. */
INLINE_AMXQ void weight_block(const int BITS, const int GROUP, const int HAS_MIN, long t0, long tiles, long M, long Mp,
                              long K, const int8_t *q, int offset, const lp_scales *scales, const uint16_t *xhi,
                              const uint16_t *xlo, const float *xsum, __m512i *panel, float *Y, long N_padded) {
    const long groups = K / GROUP, span = GROUP * scales->unit_groups;
    lp_tile_factors st[2 * PAIRS], mt[2 * PAIRS];
    for (long n = 0; n < tiles; n++) {
        st[n] = tile_factors(scales->unit, scales->mult, scales->unit_groups, t0 + n, groups);
        mt[n] = tile_factors(scales->min_unit, scales->min_mult, scales->unit_groups, t0 + n, groups);
    }
    for (long kb = 0; kb < K; kb += BLOCK_COLS) {
        const long kn = K - kb < BLOCK_COLS ? K - kb : BLOCK_COLS, bp = kn / 2; /* a whole number of spans */
        for (long n = 0; n < 2 * PAIRS && n < tiles + tiles % 2; n++) {
            const int real = n < tiles;
            const int8_t *qt = q + (t0 + (real ? n : 0)) * K * 2 * BITS;
            __m512i *hi = panel + (n / 2) * 4 * bp + (n % 2) * 2 * bp;
            for (long p = 0; p < bp; p++) {
                const long at = kb / 2 + p;
                const __m512i mult = real ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(st[n].mult + 2 * at / GROUP * TILE)))
                                          : _mm512_setzero_si512();
                pair_terms(BITS, qt, K, at, offset, mult, hi + p, hi + bp + p);
            }
        }
        for (long r0 = 0; r0 < Mp; r0 += 32) {
            const long rows = M - r0 < 32 ? M - r0 : 32;
            for (long pr = 0; 2 * pr < tiles; pr++)
                pair_rows(GROUP, HAS_MIN, r0, rows, kb, kb + kn, K, span, xhi, xlo, xsum, panel + pr * 4 * bp, bp,
                          st + 2 * pr, mt + 2 * pr, tiles - 2 * pr < 2 ? 1 : 2, Y + r0 * N_padded + (t0 + 2 * pr) * TILE,
                          N_padded);
        }
    }
}

/* One function per (bits, group, min or not), its OpenMP loop where those are literals (see cpu_qgemm.h). */
#define AMX_FN(BITS, GROUP, HAS_MIN)                                                                                  \
    static AMXQ int qgemm_amx_##BITS##_##GROUP##_##HAS_MIN(long M, long Mp, long K, const int8_t *q, int offset,     \
                                                          const lp_scales *scales, const uint16_t *xhi,             \
                                                          const uint16_t *xlo, const float *xsum, long N_padded,     \
                                                          float *Y) {                                                \
        int status = LP_OK;                                                                                           \
        const long tiles = N_padded / TILE, per = 2 * PAIRS;                                                          \
        _Pragma("omp parallel") {                                                                                     \
            __m512i *panel = lp_amx_buffer(LP_AMX_PANEL, 2 * PAIRS * BLOCK_COLS * sizeof(__m512i));                   \
            if (!panel) {                                                                                             \
                _Pragma("omp atomic write") status = LP_OUT_OF_MEMORY;                                                \
            } else {                                                                                                  \
                lp_amx_configure();                                                                                   \
                _Pragma("omp for schedule(dynamic, 1)") for (long t = 0; t < tiles; t += per)                         \
                    weight_block(BITS, GROUP, HAS_MIN, t, tiles - t < per ? tiles - t : per, M, Mp, K, q, offset,     \
                                 scales, xhi, xlo, xsum, panel, Y, N_padded);                                         \
                _tile_release();                                                                                      \
            }                                                                                                         \
        }                                                                                                             \
        return status;                                                                                                \
    }
#define AMX_FNS(BITS) AMX_FN(BITS, 32, 0) AMX_FN(BITS, 32, 1) AMX_FN(BITS, 16, 0) AMX_FN(BITS, 16, 1)
AMX_FNS(4)
AMX_FNS(5)
AMX_FNS(6)
AMX_FNS(8)

#define AMX_CALL(BITS, GROUP, HAS_MIN) \
    qgemm_amx_##BITS##_##GROUP##_##HAS_MIN(M, Mp, K, q, offset, scales, xhi, xlo, xsum, N_padded, Y)
#define AMX_BY_MIN(BITS, GROUP) (scales->min_unit ? AMX_CALL(BITS, GROUP, 1) : AMX_CALL(BITS, GROUP, 0))
#define AMX_BY_GROUP(BITS) (group == 16 ? AMX_BY_MIN(BITS, 16) : AMX_BY_MIN(BITS, 32))

static int amx_qgemm(const float *X, long M, long K, const int8_t *q, const lp_scales *scales, long N_padded, int bits,
                     int offset, int group, float *Y) {
    const long Mp = (M + 31) / 32 * 32;
    const size_t split_bytes = (size_t)Mp * K * 2 * sizeof(uint16_t);
    uint16_t *xhi = lp_amx_buffer(LP_AMX_ROWS, split_bytes + (size_t)Mp * (K / group) * sizeof(float));
    if (!xhi) return LP_OUT_OF_MEMORY;
    uint16_t *xlo = xhi + Mp * K;
    float *xsum = (float *)(xhi + 2 * Mp * K);
    split_rows(X, M, Mp, K, group, xhi, xlo, xsum);
    memset(Y, 0, (size_t)M * N_padded * sizeof(float));
    const int status = bits == 4   ? AMX_BY_GROUP(4)
                       : bits == 5 ? AMX_BY_GROUP(5)
                       : bits == 6 ? AMX_BY_GROUP(6)
                                   : AMX_BY_GROUP(8);
    return status;
}
#endif

/* As lp_qgemm_int16 takes them. Where AMX does not run, or a block of groups (its unit's span) is not 32, 64, 128 or
 * 256 columns (GGUF's are 32 or 256), it is lp_qgemm_int16. */
int lp_qgemm_amx(const float *X, int64_t M, int64_t K, const int8_t *q, const lp_scales *scales, int64_t N_padded,
                 int bits, int offset, int group, float *Y) {
    if (!packed_bits(bits) || (bits == 8 && offset) || !qgemm_sizes_fit(M, K, N_padded, group, scales))
        return LP_BAD_ARGUMENT;
#if defined(__x86_64__)
    const long span = group * scales->unit_groups;
    if (lp_amx(-1) && span % 32 == 0 && 256 % span == 0 && M > 0)
        return amx_qgemm(X, M, K, q, scales, N_padded, bits, offset, group, Y);
#endif
    return lp_qgemm_int16(X, M, K, q, scales, N_padded, bits, offset, group, Y);
}
