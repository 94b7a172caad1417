/* lp_qgemm_int16_amx: lp_qgemm_int16's product for a batch of rows on AMX-INT8 tiles, bit for bit what its VNNI
 * kernel computes. Built into every path's library, compiled for AMX alone and chosen at run time by lp_qgemm_int16
 * (cpu_qgemm_int16.c) for batches of at least AMX_INT16_ROWS rows where lp_amx_int8 says the tiles run.
 *
 * Why: a decode step of many sequences multiplies every weight by each of their rows, and there the VNNI kernel is
 * bound by its vpdpwssd (32 products an instruction) where one AMX-INT8 instruction makes 16 x 16 x 32 of them.
 *
 * Exactness: an int16 value of a rounded row is 256 hi + lo, hi its signed upper byte and lo its unsigned lower one,
 * so a group's integer dot product with the weights' stored values u is 256 sum(hi u) + sum(lo u): one TDPBSSD and
 * one TDPBUSD per group (a tile's K is the group, 32 or 16 values), both exact int32 sums, combined exactly in int32
 * lanes. That is the integer the VNNI kernel's vpdpwssd chain makes; each group's integers then go through the same
 * float operations in the same order (offset, the rows' scale, the weights' scale, the min term), so the results
 * are the same bits whichever kernel ran, and a sequence's tokens do not depend on how many others shared its step
 * (tests/kernels/test_cpu_qgemm_int16_amx.py).
 *
 * Layout: X's rows in blocks of 16 (the last padded with zero rows), each group's lo and hi bytes as A operands of
 * 16 rows by G bytes; a weight tile's stored values as B operands, G / 4 rows of 16 weight rows by 4 columns, laid
 * out once per tile by the thread that takes it and swept by every row block. Each group's sums are scaled as soon
 * as they are stored: alternating two pairs of accumulator tiles, or scaling three groups behind, timed no faster.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_activations.h"
#include "cpu_amx.h"
#include "cpu_kernels.h"
#include "cpu_scales.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu_qgemm_pairs.h"

#define AMXI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,amx-tile,amx-int8")))
#define INLINE_AMXI static inline __attribute__((always_inline)) AMXI

/* The rows' bytes as A operands: for row block b and group g, 16 rows of G lo bytes at ((b * groups + g) * 2) * 16
 * * G, then their hi bytes; rows past M are zero. */
static AMXI void split_bytes(const int16_t *xq, long M, long Mp, long K, long G, uint8_t *a) {
    const long groups = K / G;
#pragma omp parallel for schedule(static)
    for (long i = 0; i < Mp; i++)
        for (long g = 0; g < groups; g++) {
            uint8_t *lo = a + ((i / 16 * groups + g) * 2 * 16 + i % 16) * G, *hi = lo + 16 * G;
            for (long k = 0; k < G; k += 16) {
                const __m256i v = i < M ? _mm256_loadu_si256((const __m256i *)(xq + i * K + g * G + k))
                                        : _mm256_setzero_si256();
                const __m256i low = _mm256_and_si256(v, _mm256_set1_epi16(255));
                _mm_storeu_si128((__m128i *)(lo + k), _mm256_cvtepi16_epi8(low));
                _mm_storeu_si128((__m128i *)(hi + k), _mm256_cvtepi16_epi8(_mm256_srai_epi16(v, 8)));
            }
        }
}

/* Each lane's two int16 values (pair_weights': columns 2p and 2p + 1) as their low bytes, in the lane's low half. */
INLINE_AMXI __m512i low_bytes(__m512i w) {
    return _mm512_ternarylogic_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0xFF)), _mm512_srli_epi32(w, 8),
                                     _mm512_set1_epi32(0xFF00), 0xF8); /* a | (b & c) */
}

/* Tile qt's stored values as B operands: row r (columns 4r .. 4r + 3) at b + 64 r, lane j row j's four bytes. */
INLINE_AMXI void layout_tile(const int BITS, const int8_t *qt, long K, __m512i *b) {
    for (long p = 0; p < K / 2; p += 2) {
        const __m512i lo = low_bytes(pair_weights(BITS, qt, K, p)), hi = low_bytes(pair_weights(BITS, qt, K, p + 1));
        _mm512_store_si512(b + p / 2, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

/* Group g's two sums (tiles lo and hi, stored into c) into the 16 rows' accumulators, as the VNNI kernel scales a
 * group's integers: at[i] is row i's index into the rows' per-group values. */
INLINE_AMXI void scale_group(const int HAS_OFFSET, const int HAS_MIN, const int32_t c[2][16][16],
                             const lp_rounded_rows *x, const long *at, int offset, lp_tile_factors st,
                             lp_tile_factors mt, long g, __m512 f[16]) {
    const __m512 s = group_values16(st, g);
    const __m512 mins = HAS_MIN ? group_values16(mt, g) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        __m512i dot = _mm512_add_epi32(_mm512_load_si512(c[0][i]), _mm512_slli_epi32(_mm512_load_si512(c[1][i]), 8));
        if (HAS_OFFSET) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset * x->qsum[at[i] + g]));
        const __m512 scaled = _mm512_mul_ps(_mm512_set1_ps(x->scale[at[i] + g]), _mm512_cvtepi32_ps(dot));
        f[i] = _mm512_fmadd_ps(s, scaled, f[i]);
        if (HAS_MIN) f[i] = _mm512_fmadd_ps(mins, _mm512_set1_ps(x->sum[at[i] + g]), f[i]);
    }
}

/* A group of a row block (its A operands at a, G bytes a row) times the tile's B operands at b, its two sums
 * stored into c. */
INLINE_AMXI void group_products(const uint8_t *a, const uint8_t *b, long G, int32_t c[2][16][16]) {
    _tile_loadd(4, a, G);
    _tile_loadd(5, a + 16 * G, G);
    _tile_loadd(6, b, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbssd(1, 5, 6);
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
}

/* This thread's tiles: the int32 sums in 0-1, X's lo and hi bytes in 4-5, the weights in 6 (the rest unused). */
INLINE_AMXI void configure(const int GROUP) {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, GROUP / 4, GROUP / 4};
    const uint16_t colsb[8] = {64, 64, 64, 64, GROUP, GROUP, 64, 64};
    lp_amx_configure_tiles(rows, colsb);
}

/* Every row block against weight tile t (its B operands in b), into Y's 16 columns of the tile. */
INLINE_AMXI void tile_rows(const int GROUP, const int HAS_OFFSET, const int HAS_MIN, const lp_rounded_rows *x,
                           long M, long Mp, long K, const uint8_t *a, const uint8_t *b, int offset, lp_tile_factors st,
                           lp_tile_factors mt, float *y, long ldy) {
    const long groups = K / GROUP, block = GROUP * 16; /* a group's bytes in an A or B operand */
    int32_t c[2][16][16] __attribute__((aligned(64)));
    for (long r0 = 0; r0 < Mp; r0 += 16) {
        __m512 f[16];
        long at[16];
        for (int i = 0; i < 16; i++) {
            f[i] = _mm512_setzero_ps();
            at[i] = (r0 + i < M ? r0 + i : M - 1) * groups; /* a padding row reads a real row's values, unused */
        }
        const uint8_t *ab = a + r0 / 16 * groups * 2 * block;
        for (long g = 0; g < groups; g++) {
            group_products(ab + g * 2 * block, b + g * block, GROUP, c);
            scale_group(HAS_OFFSET, HAS_MIN, c, x, at, offset, st, mt, g, f);
        }
        for (int i = 0; i < 16 && r0 + i < M; i++) _mm512_storeu_ps(y + (r0 + i) * ldy, f[i]);
    }
}

/* One function per (bits, group, offset or not, min or not), its OpenMP loop where those are literals. */
#define AMX16_FN(BITS, GROUP, HAS_OFFSET, HAS_MIN)                                                                    \
    static AMXI int amx16_##BITS##_##GROUP##_##HAS_OFFSET##_##HAS_MIN(const lp_rounded_rows *x, long M, long Mp,     \
                                                                       long K, const uint8_t *a, const int8_t *q,    \
                                                                       int offset, const lp_scales *scales,          \
                                                                       long N_padded, float *Y) {                    \
        int status = LP_OK;                                                                                           \
        _Pragma("omp parallel") {                                                                                     \
            __m512i *b = lp_amx_buffer(LP_AMX_PANEL, K / 4 * sizeof(__m512i));                                        \
            if (!b) {                                                                                                 \
                _Pragma("omp atomic write") status = LP_OUT_OF_MEMORY;                                                \
            } else {                                                                                                  \
                configure(GROUP);                                                                                     \
                _Pragma("omp for schedule(static)") for (long t = 0; t < N_padded / TILE; t++) {                     \
                    const int8_t *qt = q + t * K * 2 * BITS;                                                          \
                    layout_tile(BITS, qt, K, b);                                                                      \
                    tile_rows(GROUP, HAS_OFFSET, HAS_MIN, x, M, Mp, K, a, (const uint8_t *)b, offset,                \
                              tile_factors(scales->unit, scales->mult, scales->unit_groups, t, K / GROUP),           \
                              tile_factors(scales->min_unit, scales->min_mult, scales->unit_groups, t, K / GROUP),   \
                              Y + t * TILE, N_padded);                                                                \
                }                                                                                                     \
                _tile_release();                                                                                      \
            }                                                                                                         \
        }                                                                                                             \
        return status;                                                                                                \
    }
INT16_INSTANCES(AMX16_FN)

#define AMX16_CALL(BITS, GROUP, HAS_OFFSET, HAS_MIN) \
    amx16_##BITS##_##GROUP##_##HAS_OFFSET##_##HAS_MIN(x, M, Mp, K, a, q, offset, scales, N_padded, Y)

int lp_qgemm_int16_amx(const lp_rounded_rows *x, long M, long K, const int8_t *q, const lp_scales *scales,
                       long N_padded, int bits, int offset, int group, float *Y) {
    const long Mp = (M + 15) / 16 * 16;
    uint8_t *a = lp_amx_buffer(LP_AMX_ROWS, (size_t)Mp * K * 2);
    if (!a) return LP_OUT_OF_MEMORY;
    split_bytes(x->xq16, M, Mp, K, group, a);
    return INT16_DISPATCH(AMX16_CALL);
}

#else /* no AMX off x86-64: lp_amx_int8 is 0 and this is never called */

int lp_qgemm_int16_amx(const lp_rounded_rows *x, long M, long K, const int8_t *q, const lp_scales *scales,
                       long N_padded, int bits, int offset, int group, float *Y) {
    (void)x, (void)M, (void)K, (void)q, (void)scales, (void)N_padded, (void)bits, (void)offset, (void)group, (void)Y;
    return LP_BAD_ARGUMENT;
}
#endif
