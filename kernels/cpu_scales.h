/* A packed weight's scales and mins as a GGUF stores them, and each tile's fp32 values rebuilt from them, for every
 * qgemm (cpu_qgemm.h's lp_qgemm, lp_qgemm_int16, lp_qgemm_int8).
 *
 * Every native GGUF type's per-group scale is an fp16 times a small integer: a K-quant's d per 256 weights times a
 * 6- or 8-bit sub-block scale, a legacy type's d per 32 times 1 (lp_scales in cpu_kernels.h). Kept that way, a
 * Q4_K weight costs 4.6 bits instead of 6 with an fp32 scale and min per group, a Q6_K one 8.6 instead of 10, and a
 * one-chat decode reads every weight each step. The product of an fp16 and an int8 is exact in fp32 (at most 19
 * significant bits), so the rebuilt values are those an fp32 table held: the same weights, bit for bit. The VNNI
 * kernels rebuild each group's 16 values in registers as they reach it (tile_factors, group_values16); the float32,
 * panel and plain C loops read a tile's table (K / G * 16 floats of each), rebuilt in L1 right before the loop
 * (tile_scales): rebuilt that way ahead of the VNNI loops, it cost more than the bytes it saved.
 */
#ifndef LP_CPU_SCALES_H
#define LP_CPU_SCALES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* fp16 bits -> the fp32 of the same value, exactly (subnormals, infinities and NaNs too). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) bits = sign | 0x7F800000u | mantissa << 13;
    else if (exponent) bits = sign | (exponent + 112) << 23 | mantissa << 13;
    else {
        const float magnitude = (float)mantissa * 0x1p-24f; /* a subnormal: exact */
        memcpy(&bits, &magnitude, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* unit [units][16] fp16 times mult [groups][16] int8, unit u serving groups u * per .. u * per + per - 1: into out
 * [groups][16] fp32. */
static inline void rebuild_plain(const uint16_t *unit, const int8_t *mult, long groups, long per, float *out) {
    for (long u = 0; u < groups / per; u++) {
        float base[TILE];
        for (int j = 0; j < TILE; j++) base[j] = half_to_float(unit[u * TILE + j]);
        for (long g = u * per; g < (u + 1) * per; g++)
            for (int j = 0; j < TILE; j++) out[g * TILE + j] = base[j] * (float)mult[g * TILE + j];
    }
}

#if defined(__x86_64__)
/* The same with AVX-512 (F16C's conversion of 16 lanes), for the kernels compiled for it. */
static inline __attribute__((target("avx512f,avx512bw,avx512vl"))) void rebuild_avx512(const uint16_t *unit,
                                                                                      const int8_t *mult, long groups,
                                                                                      long per, float *out) {
    for (long u = 0; u < groups / per; u++) {
        const __m512 base = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(unit + u * TILE)));
        for (long g = u * per; g < (u + 1) * per; g++) {
            const __m512i m = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(mult + g * TILE)));
            _mm512_storeu_ps(out + g * TILE, _mm512_mul_ps(base, _mm512_cvtepi32_ps(m)));
        }
    }
}
#endif

/* Tile t's part of one factored table (unit or min_unit, mult or min_mult; NULL where s has no min), for the VNNI
 * kernels, which rebuild each group's 16 values as they reach it instead of a table first. */
typedef struct {
    const uint16_t *unit;
    const int8_t *mult;
    int shift; /* log2 of the groups a unit serves: always a power of two (256 / G, or 1) */
} lp_tile_factors;

static inline lp_tile_factors tile_factors(const uint16_t *unit, const int8_t *mult, long unit_groups, long t,
                                           long groups) {
    const int shift = __builtin_ctzl((unsigned long)unit_groups);
    if (!unit) return (lp_tile_factors){NULL, NULL, shift};
    return (lp_tile_factors){unit + t * (groups >> shift) * TILE, mult + t * groups * TILE, shift};
}

#if defined(__x86_64__)
/* Group g's 16 values (rows 0-15 of the tile) from f. */
static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl"))) __m512
group_values16(lp_tile_factors f, long g) {
    const __m512 unit = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(f.unit + (g >> f.shift) * TILE)));
    return _mm512_mul_ps(unit, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(f.mult + g * TILE)))));
}

/* Rows 0-7 (half 0) or 8-15 (half 1) of 16 values, in 8 lanes. */
static inline __attribute__((always_inline, target("avx512f"))) __m256 half8(__m512 v, int half) {
    return half ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)) : _mm512_castps512_ps256(v);
}
#endif

/* Tile t's fp32 scales [groups][16] into *scale and its mins into *min (NULL where s has none), in this thread's
 * buffer: LP_OK, or LP_OUT_OF_MEMORY. AVX512 says whether the caller runs AVX-512 (a constant after inlining). */
static inline __attribute__((always_inline)) int tile_scales(const int AVX512, const lp_scales *s, long t,
                                                             long groups, const float **scale, const float **min) {
    static __thread float *buffer = NULL;
    static __thread long buffer_floats = 0;
    const long floats = 2 * groups * TILE, per = s->unit_groups, units = groups / per;
    if (buffer_floats < floats) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)floats * sizeof(float));
        buffer_floats = buffer ? floats : 0;
        if (!buffer) return LP_OUT_OF_MEMORY;
    }
    const uint16_t *unit = s->unit + t * units * TILE, *min_unit = s->min_unit ? s->min_unit + t * units * TILE : NULL;
    const int8_t *mult = s->mult + t * groups * TILE, *min_mult = s->min_mult ? s->min_mult + t * groups * TILE : NULL;
#if defined(__x86_64__)
    if (AVX512) {
        rebuild_avx512(unit, mult, groups, per, buffer);
        if (min_unit) rebuild_avx512(min_unit, min_mult, groups, per, buffer + groups * TILE);
    } else
#endif
    {
        rebuild_plain(unit, mult, groups, per, buffer);
        if (min_unit) rebuild_plain(min_unit, min_mult, groups, per, buffer + groups * TILE);
    }
    *scale = buffer;
    *min = min_unit ? buffer + groups * TILE : NULL;
    return LP_OK;
}

/* Whether s fits a weight of K columns in groups of G: units of a power of two of whole groups that divide K, and a
 * min's two parts together. */
static inline int scales_fit(const lp_scales *s, long K, long G) {
    return s && s->unit && s->mult && s->unit_groups > 0 && (s->unit_groups & (s->unit_groups - 1)) == 0 &&
           K % (G * s->unit_groups) == 0 &&
           !s->min_unit == !s->min_mult;
}

/* What every qgemm checks besides its weights' widths: M >= 0 rows of K > 0 columns, groups of 16 or 32 that divide
 * K, whole tiles of output rows and scales that fit. */
static inline int qgemm_sizes_fit(long M, long K, long N_padded, long group, const lp_scales *s) {
    return (group == 16 || group == 32) && K > 0 && K % group == 0 && N_padded % TILE == 0 && M >= 0 &&
           scales_fit(s, K, group);
}

#endif
