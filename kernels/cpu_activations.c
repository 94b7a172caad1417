/* lp_round_rows and lp_has_vnni (cpu_activations.h says what they are), built into every path's library: one
 * rounding for the int8 and the int16 kernels, in plain C, and for int16 with AVX-512 where the CPU has VNNI. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_activations.h"
#include "cpu_kernels.h"

/* One group of G values of x at BITS (8 or 16, a constant after inlining): its integers, scale, sum of floats and
 * sum of integers. |x inv| is at most the limit plus an ulp, so the clamp only keeps the int16 type's range. */
static inline __attribute__((always_inline)) void round_group_plain(const int BITS, const float *x, long G, void *xq,
                                                                    float *scale, float *sum, int32_t *qsum) {
    const float limit = BITS == 8 ? 127.0f : 32767.0f;
    float amax = 0.0f, total = 0.0f;
    for (long k = 0; k < G; k++) {
        amax = fmaxf(amax, fabsf(x[k]));
        total += x[k];
    }
    const float inv = amax > 0.0f ? limit / amax : 0.0f;
    int32_t qtotal = 0;
    for (long k = 0; k < G; k++) {
        const float v = nearbyintf(x[k] * inv);
        const int32_t u = (int32_t)(v > limit ? limit : v < -limit ? -limit : v);
        if (BITS == 8) ((int8_t *)xq)[k] = (int8_t)u;
        else ((int16_t *)xq)[k] = (int16_t)u;
        qtotal += u;
    }
    *scale = amax / limit, *sum = total, *qsum = qtotal;
}

#if defined(__x86_64__)
#include <immintrin.h>

/* The same at 16 bits with AVX-512, a group in one or two registers: the same ints and scale (the same divisions,
 * and the conversion rounds to nearest even as nearbyintf does), the float sum in another order. A plain C loop here
 * was most of a 16-row int16 matmul's time. */
static __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni"))) void round_group16_avx512(
    const float *x, long G, int16_t *xq, float *scale, float *sum, int32_t *qsum) {
    const __m512 a = _mm512_loadu_ps(x), b = G == 32 ? _mm512_loadu_ps(x + 16) : _mm512_setzero_ps();
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm256_storeu_si256((__m256i *)xq, _mm512_cvtsepi32_epi16(qa));
    if (G == 32) _mm256_storeu_si256((__m256i *)(xq + 16), _mm512_cvtsepi32_epi16(qb));
    *scale = amax / 32767.0f;
    *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}
#endif

int lp_has_vnni(void) {
#if defined(__x86_64__)
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

int lp_round_rows(const float *X, long M, long K, long G, int bits, lp_rounded_rows *r) {
    const long groups = M * (K / G), width = bits == 8 ? sizeof(int8_t) : sizeof(int16_t);
    char *memory = malloc(M * K * width + groups * (2 * sizeof(float) + sizeof(int32_t)) + 64);
    if (!memory) return LP_OUT_OF_MEMORY;
    r->scale = (float *)memory;
    r->sum = r->scale + groups;
    r->qsum = (int32_t *)(r->sum + groups);
    r->xq8 = (int8_t *)(r->qsum + groups);
#if defined(__x86_64__)
    const int vector = bits == 16 && lp_has_vnni();
#endif
#pragma omp parallel for schedule(static) if (M >= 16)
    for (long g = 0; g < groups; g++) {
#if defined(__x86_64__)
        if (vector) {
            round_group16_avx512(X + g * G, G, r->xq16 + g * G, r->scale + g, r->sum + g, r->qsum + g);
            continue;
        }
#endif
        if (bits == 8) round_group_plain(8, X + g * G, G, r->xq8 + g * G, r->scale + g, r->sum + g, r->qsum + g);
        else round_group_plain(16, X + g * G, G, r->xq16 + g * G, r->scale + g, r->sum + g, r->qsum + g);
    }
    return LP_OK;
}

void lp_free_rows(lp_rounded_rows *r) { free(r->scale); }
