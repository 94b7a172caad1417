/* A packed tile's columns two at a time as int16 pairs (cpu_qgemm.h's layout), for the kernels that multiply
 * pairs: lp_qgemm_int16's VNNI kernel (cpu_qgemm_int16.c) and lp_qgemm_amx's AMX tiles (cpu_qgemm_amx.c). */
#ifndef LP_CPU_QGEMM_PAIRS_H
#define LP_CPU_QGEMM_PAIRS_H

#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

/* Columns 2p and 2p + 1 of a tile: lane j holds row j's two stored values as int16 (2p's in the low half). 4, 5 and
 * 6 bits: row j's byte holds both nibbles; 5 bits add each column's fifth bit from its 16-bit word, 6 bits bits 4
 * and 5 from row j's word for the columns' 8. 8 bits: the two columns' 16 bytes each, sign-widened, then
 * interleaved. */
static inline __attribute__((always_inline)) __attribute__((target("avx512f,avx512bw"))) __m512i pair_weights(const int BITS, const int8_t *qt, long K,
                                                                         long p) {
    if (BITS == 8) {
        const __m512i words = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qt + 2 * p * TILE)));
        const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                                    7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        return _mm512_permutexvar_epi16(interleave, words);
    }
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qt + p * TILE)));
    /* (bytes | bytes << 12) & 0x000F000F: the low nibble stays, the high one moves to bit 16 */
    __m512i w = _mm512_ternarylogic_epi32(bytes, _mm512_slli_epi32(bytes, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    if (BITS == 5) {
        uint32_t words;
        memcpy(&words, qt + K * TILE / 2 + 4 * p, sizeof words); /* columns 2p and 2p + 1: bit j is row j's */
        const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i bits = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)words), lane),
                                              _mm512_set1_epi32(0x00010001));
        w = _mm512_or_si512(w, _mm512_slli_epi32(bits, 4));
    }
    if (BITS == 6) { /* lane j: row j's word for the 8 columns holding 2p, shifted to put 2p's bits 4-5 lowest */
        const __m256i words = _mm256_loadu_si256((const __m256i *)(qt + K * TILE / 2 + p / 4 * 32));
        const __m512i n = _mm512_srl_epi32(_mm512_cvtepu16_epi32(words), _mm_cvtsi32_si128(4 * (p % 4)));
        const __m512i even = _mm512_slli_epi32(_mm512_and_si512(n, _mm512_set1_epi32(3)), 4);
        const __m512i odd = _mm512_slli_epi32(_mm512_and_si512(n, _mm512_set1_epi32(12)), 18);
        w = _mm512_ternarylogic_epi32(w, even, odd, 0xFE); /* w | even | odd */
    }
    return w;
}

#endif

/* Every (bits, group, offset or not, min or not) a kernel on int16 inputs takes, one FN(BITS, GROUP, HAS_OFFSET,
 * HAS_MIN) each (8-bit values never have an offset): lp_qgemm_int16's VNNI and AMX-INT8 kernels instantiate theirs
 * with it. */
#define INT16_INSTANCES(FN)                                                                                      \
    FN(4, 32, 0, 0) FN(4, 32, 0, 1) FN(4, 32, 1, 0) FN(4, 32, 1, 1) FN(4, 16, 0, 0) FN(4, 16, 0, 1) FN(4, 16, 1, 0) \
        FN(4, 16, 1, 1) FN(5, 32, 0, 0) FN(5, 32, 0, 1) FN(5, 32, 1, 0) FN(5, 32, 1, 1) FN(5, 16, 0, 0)             \
            FN(5, 16, 0, 1) FN(5, 16, 1, 0) FN(5, 16, 1, 1) FN(6, 32, 0, 0) FN(6, 32, 0, 1) FN(6, 32, 1, 0)         \
                FN(6, 32, 1, 1) FN(6, 16, 0, 0) FN(6, 16, 0, 1) FN(6, 16, 1, 0) FN(6, 16, 1, 1) FN(8, 32, 0, 0)     \
                    FN(8, 32, 0, 1) FN(8, 16, 0, 0) FN(8, 16, 0, 1)

/* CALL(BITS, GROUP, HAS_OFFSET, HAS_MIN) for the instance of the variables bits, group, offset and scales in scope. */
#define INT16_DISPATCH(CALL)                 \
    (bits == 4   ? INT16_BY_GROUP(CALL, 4)   \
     : bits == 5 ? INT16_BY_GROUP(CALL, 5)   \
     : bits == 6 ? INT16_BY_GROUP(CALL, 6)   \
                 : (group == 16 ? INT16_BY_MIN(CALL, 8, 16, 0) : INT16_BY_MIN(CALL, 8, 32, 0)))
#define INT16_BY_GROUP(CALL, BITS) (group == 16 ? INT16_BY_OFFSET(CALL, BITS, 16) : INT16_BY_OFFSET(CALL, BITS, 32))
#define INT16_BY_OFFSET(CALL, BITS, GROUP) \
    (offset ? INT16_BY_MIN(CALL, BITS, GROUP, 1) : INT16_BY_MIN(CALL, BITS, GROUP, 0))
#define INT16_BY_MIN(CALL, BITS, GROUP, HAS_OFFSET) \
    (scales->min_unit ? CALL(BITS, GROUP, HAS_OFFSET, 1) : CALL(BITS, GROUP, HAS_OFFSET, 0))

#endif
