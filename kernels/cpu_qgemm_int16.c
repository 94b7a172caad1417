/* lp_qgemm_int16: Y[M, N] = X[M, K] @ W[N, K]^T with X's rows rounded to int16, on the same packed tiles as lp_qgemm
 * (cpu_qgemm.h's layout, lp_pack_q). Built into every path's library: plain C, plus an AVX-512 VNNI kernel
 * (vpdpwssd: 32 products of int16 pairs a register, added into 16 int32 lanes) compiled for that instruction set
 * alone and chosen at run time where the CPU has it.
 *
 * Why: for a batch of decode rows the float32 kernel is bound by its FMAs, 16 products an instruction; vpdpwssd
 * makes 32 in the same time (on Zen 4 both issue one a cycle), and a weight's small integer is an
 * int16 as it is. Each run ("group") of 32 or 16 values of a row of X becomes int16 with one fp32 scale
 * (amax / 32767), and a group's dot product is exact integer arithmetic (lp_round_rows, cpu_activations.h says
 * how). The only rounding added is X's to 16 bits,
 * a relative error under 2^-16 of each group's largest value, where a float16 KV cache rounds every value to 11
 * bits (engine/setup.py says when a model runs this way, and how its greedy output compares with the exact path).
 *
 * The VNNI kernel puts a tile's row j in lane j, as the int16 pair of its values at columns 2p and 2p + 1, so one
 * vpdpwssd against a row of X's pair (2p, 2p + 1) broadcast adds 2 columns x 16 rows. The plain C kernel computes
 * the same integers, scales and fused multiply-adds; only each run's float sum (the min term's) is added in another
 * order. Against lp_qgemm it is faster on every projection of the default model, most on 16-row batches, where the
 * float32 kernel is bound by its FMAs (benchmarks/cpu_kernel_bench.py's qgemm timings, "int16 x" rows). A batch of
 * AMX_INT16_ROWS rows or more goes to AMX-INT8 tiles where they run (cpu_qgemm_int16_amx.c): the same bits. One or
 * two rows (a decode step of one or two chats, which reads every weight from memory) go to tile_rows_bytes where the
 * CPU has AVX-512 VBMI and BITALG: the same bits from half the vector instructions, and so a faster read of the
 * weights.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_activations.h"
#include "cpu_amx.h"
#include "cpu_kernels.h"
#include "cpu_qgemm_pairs.h"
#include "cpu_scales.h"

/* Under 16 rows the tiles' padding rows cost more than the tiles save. */
#define AMX_INT16_ROWS 16
/* Up to this many rows go to tile_rows_bytes: from 3 rows its four products a row cost more than pairs unpacked once
 * for all of them (tile_rows_vnni16). */
#define BYTES_ROWS 2

#if defined(__x86_64__)
#include <immintrin.h>
#define VNNI16 __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")))
#endif

/* Row j of tile qt at column k: its stored u (lp_pack_q's layout, see cpu_qgemm.h). */
static inline int stored16(const int8_t *qt, int bits, long K, long k, int j) {
    if (bits == 8) return qt[k * TILE + j];
    const uint8_t byte = (uint8_t)qt[k / 2 * TILE + j];
    int u = k % 2 ? byte >> 4 : byte & 15;
    const uint8_t *high = (const uint8_t *)qt + K * TILE / 2;
    if (bits == 5) u |= ((high[2 * k + j / 8] >> (j % 8)) & 1) << 4;
    if (bits == 6) {
        const uint8_t *word = high + (k / 8 * TILE + j) * 2;
        u |= (((word[0] | word[1] << 8) >> 2 * (k % 8)) & 3) << 4;
    }
    return u;
}

/* A group's integer dot product into a row's fp32 sum, as fused multiply-adds whatever the build's contraction: the
 * VNNI kernel rounds the same way. */
static inline float scaled_group(float acc, int32_t dot, float w_scale, float x_scale) {
    return fmaf(w_scale, x_scale * (float)dot, acc);
}

/* Every row of X against tile t, in plain C: any CPU. */
static void tile_rows_plain16(const lp_rounded_rows *x, long M, long K, long G, const int8_t *qt, int bits,
                              int offset, const float *scale, const float *min, float *y, long ldy) {
    for (long i = 0; i < M; i++)
        for (int j = 0; j < TILE; j++) {
            float acc = 0.0f;
            for (long g = 0; g < K / G; g++) {
                int32_t dot = 0;
                for (long k = g * G; k < (g + 1) * G; k++) dot += stored16(qt, bits, K, k, j) * x->xq16[i * K + k];
                dot -= offset * x->qsum[i * (K / G) + g];
                acc = scaled_group(acc, dot, scale[g * TILE + j], x->scale[i * (K / G) + g]);
                if (min) acc = fmaf(min[g * TILE + j], x->sum[i * (K / G) + g], acc);
            }
            y[i * ldy + j] = acc;
        }
}

#if defined(__x86_64__)
/* R rows (<= 6, a constant after inlining) from r0 against one tile, its pairs from the expanded panel P (PANEL) or
 * unpacked from qt as they are needed: per group, each row's 16 integer dot products in one register, then scaled
 * into fp32 accumulators as scaled_group does. */
static inline __attribute__((always_inline)) VNNI16 void tile_rows_vnni16(
    const int BITS, const int GROUP, const int HAS_OFFSET, const int HAS_MIN, const int PANEL, const int R,
    const lp_rounded_rows *x, long r0, long K, const int8_t *qt, const __m512i *P, int offset, lp_tile_factors scale,
    lp_tile_factors min, float *y, long ldy) {
    const long groups = K / GROUP;
    /* One accumulator a row makes its vpdpwssd a chain, each waiting out the last one's latency (5 cycles): with one
     * or two rows that, not the memory, bounded a decode step. C independent sums a row, added at the group's end,
     * overlap; 3 rows and more overlap on their own. */
    const int C = R == 1 ? 4 : R == 2 ? 2 : 1;
    __m512 f[6];
    for (int i = 0; i < R; i++) f[i] = _mm512_setzero_ps();
    for (long g = 0; g < groups; g++) {
        __m512i a[6][4];
        for (int i = 0; i < R; i++)
            for (int c = 0; c < C; c++) a[i][c] = _mm512_setzero_si512();
        if (!PANEL) prefetch_group(qt, g, GROUP, BITS, PREFETCH_BYTES, 0);
        for (long p = g * GROUP / 2; p < (g + 1) * GROUP / 2; p += C)
            for (int c = 0; c < C; c++) {
                const __m512i w = PANEL ? _mm512_load_si512(P + p + c) : pair_weights(BITS, qt, K, p + c);
                for (int i = 0; i < R; i++)
                    a[i][c] = add_pair_products(a[i][c], w, x->xq16 + (r0 + i) * K + 2 * (p + c));
            }
        for (int i = 0; i < R; i++)
            for (int c = 1; c < C; c++) a[i][0] = _mm512_add_epi32(a[i][0], a[i][c]);
        const __m512 s = group_values16(scale, g);
        for (int i = 0; i < R; i++) {
            const long at = (r0 + i) * groups + g;
            if (HAS_OFFSET) a[i][0] = _mm512_sub_epi32(a[i][0], _mm512_set1_epi32(offset * x->qsum[at]));
            const __m512 scaled = _mm512_mul_ps(_mm512_set1_ps(x->scale[at]), _mm512_cvtepi32_ps(a[i][0]));
            f[i] = _mm512_fmadd_ps(s, scaled, f[i]);
            if (HAS_MIN) f[i] = _mm512_fmadd_ps(group_values16(min, g), _mm512_set1_ps(x->sum[at]), f[i]);
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(y + (r0 + i) * ldy, f[i]);
}

/* A few rows' int16 values split into bytes for tile_rows_bytes: x = 256 h + l, h = x >> 8 signed, l = x & 255
 * unsigned. Per 8 columns b .. b + 7 of a row, 16 bytes: h at the even columns (b, b + 2, b + 4, b + 6), h at the
 * odd ones, l at the even ones, l at the odd ones; per (row, group) the sum of h and the sum of l at odd columns. */
typedef struct {
    int32_t *fours; /* the 16 bytes of 8 columns as 4 words: what vpdpbusd broadcasts */
    int32_t *high_sum, *odd_low_sum;
} lp_split_rows;

#define VBMI __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni,avx512vbmi,avx512bitalg")))

/* split_rows' bytes and sums for the first whole 32s of the n values in xq, 32 a step: a value's low byte is its l,
 * its high byte its h, so one vpshufb puts each 8 columns' 16 bytes in order, and vpmaddwd sums a group's h and its
 * odd columns' l. Returns how many values it did. A plain loop here was most of a small projection's fixed cost. */
static VBMI long split_rows_avx512(const int16_t *xq, long n, long G, lp_split_rows *s) {
    const __m512i order = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 5, 9, 13, 3, 7, 11, 15, 0, 4, 8, 12, 2, 6, 10, 14));
    const __m512i ones = _mm512_set1_epi16(1), odd_low = _mm512_set1_epi32(0x00FF0000);
    long k = 0;
    for (; k + 32 <= n; k += 32) {
        const __m512i v = _mm512_loadu_si512(xq + k);
        _mm512_storeu_si512((char *)s->fours + 2 * k, _mm512_shuffle_epi8(v, order));
        const __m512i high = _mm512_madd_epi16(_mm512_srai_epi16(v, 8), ones);
        const __m512i low = _mm512_madd_epi16(_mm512_and_si512(v, odd_low), ones);
        for (long g = 0; g < 32 / G; g++) { /* G = 32: one group; G = 16: two, 8 words each */
            const __mmask16 words = G == 32 ? 0xFFFF : (__mmask16)(0xFF << 8 * g);
            s->high_sum[k / G + g] = _mm512_reduce_add_epi32(_mm512_maskz_mov_epi32(words, high));
            s->odd_low_sum[k / G + g] = _mm512_reduce_add_epi32(_mm512_maskz_mov_epi32(words, low));
        }
    }
    return k;
}

static int split_rows(const lp_rounded_rows *x, long M, long K, long G, lp_split_rows *s) {
    const long groups = M * (K / G);
    char *memory = malloc(M * K * 2 + groups * 2 * sizeof(int32_t));
    if (!memory) return LP_OUT_OF_MEMORY;
    s->high_sum = (int32_t *)memory;
    s->odd_low_sum = s->high_sum + groups;
    s->fours = s->odd_low_sum + groups;
    /* the rest (M K not a multiple of 32) starts at a group: G is 16 or 32 */
    for (long g = split_rows_avx512(x->xq16, M * K, G, s) / G; g < groups; g++) {
        int32_t high = 0, odd_low = 0;
        for (long k = g * G; k < (g + 1) * G; k++) {
            const int v = x->xq16[k], h = v >> 8, l = v & 255, odd = k % 2;
            uint8_t *eight = (uint8_t *)s->fours + k / 8 * 16 + k % 8 / 2;
            eight[4 * odd] = (uint8_t)h;
            eight[8 + 4 * odd] = (uint8_t)l;
            high += h;
            odd_low += odd ? l : 0;
        }
        s->high_sum[g] = high, s->odd_low_sum[g] = odd_low;
    }
    return LP_OK;
}

/* A 5- or 6-bit tile's high bits (2 or 4 bytes a column after its nibbles) are a stream of their own, which the
 * hardware prefetcher would pick up anew in every tile, so they are prefetched too: HIGH_AHEAD groups on, or past the
 * tile's end the next tile's first ones (measured against 4 and 16 groups on, and none). */
#define HIGH_AHEAD 8
static inline __attribute__((always_inline)) void prefetch_high_bits(const int8_t *qt, long g, int group, int bits,
                                                                     long K) {
    const long width = 2 * (bits - 4), at = (g + HIGH_AHEAD) * group * width; /* a byte of the high bits */
    const char *high = (const char *)qt + K * 8;
    for (long line = 0; line < group * width; line += 64)
        __builtin_prefetch(at < K * width ? high + at + line : high + K * 2 * bits + at - K * width + line);
}

/* R rows (<= BYTES_ROWS) of X against one tile, 8 columns a step, with vpdpbusd (64 byte products a
 * register): each row's dot product is its high bytes' times 256 plus its low bytes', the very integers of
 * tile_rows_vnni16, so the same bits, from half its vector instructions a weight. One vpermb (4 to 6 bits) or two
 * vpermt2b (8 bits) put each row's 4 even or 4 odd columns in its lane; 5 bits add each one's fifth bit, picked from
 * its column's word by vpshufbitqmb, 6 bits its bits 4-5 from its row's word by vpmultishiftqb. A 4-bit tile's odd
 * columns stay in their high nibble (16 w). vpdpbusd takes one operand unsigned and one signed: h is signed, so the
 * weights go unsigned against it (8 bits: w + 128), l is unsigned, so the weights go signed (4 bits at odd columns:
 * 16 w - 128), and each group takes back the sums those shifts added. */
static inline __attribute__((always_inline)) VBMI void tile_rows_bytes(
    const int BITS, const int GROUP, const int HAS_OFFSET, const int HAS_MIN, const int R, const lp_rounded_rows *x,
    const lp_split_rows *xs, long K, const int8_t *qt, int offset, lp_tile_factors scale,
    lp_tile_factors min, float *y, long ldy) {
    const long groups = K / GROUP;
    /* 4 to 6 bits: byte 4 j + i of the step's pairs (pair i, row j) from byte 16 i + j; 8 bits: row j's even columns
     * 0, 2, 4, 6 (of two registers of 4 columns) from byte 32 i + j, its odd ones from 32 i + 16 + j */
    __m512i gather[2];
    {
        uint8_t even[64], odd[64];
        for (int j = 0; j < TILE; j++)
            for (int i = 0; i < 4; i++) {
                even[4 * j + i] = (uint8_t)(BITS == 8 ? 32 * i + j : 16 * i + j);
                odd[4 * j + i] = (uint8_t)(32 * i + 16 + j);
            }
        gather[0] = _mm512_loadu_si512(even), gather[1] = _mm512_loadu_si512(odd);
    }
    /* 5 bits: every 64-bit lane of the step's 8 words of fifth bits (word c: column b + c, bit j: row j) made the
     * even columns' words, or the odd ones'; then byte 4 j + i takes bit j of word i */
    __m512i fifth[3];
    {
        uint16_t even[32], odd[32];
        uint8_t bit[64];
        for (int n = 0; n < 32; n++) even[n] = (uint16_t)(2 * (n % 4)), odd[n] = (uint16_t)(2 * (n % 4) + 1);
        for (int n = 0; n < 64; n++) bit[n] = (uint8_t)(16 * (n % 4) + n / 4);
        fifth[0] = _mm512_loadu_si512(even), fifth[1] = _mm512_loadu_si512(odd), fifth[2] = _mm512_loadu_si512(bit);
    }
    /* 6 bits: in a lane holding rows 2L and 2L + 1's words, row j's pair i has its even column's bits 4-5 at bit
     * 16 (j % 2) + 4 i (the odd column's 2 above); byte 4 j + i takes the 8 bits from 4 below, putting them at its
     * bits 4-5 */
    __m512i sixth[2];
    {
        uint8_t even[64], odd[64];
        for (int n = 0; n < 64; n++) {
            const int at = 16 * (n % 8 / 4) + 4 * (n % 4);
            even[n] = (uint8_t)((at - 4) & 63), odd[n] = (uint8_t)((at - 2) & 63);
        }
        sixth[0] = _mm512_loadu_si512(even), sixth[1] = _mm512_loadu_si512(odd);
    }
    const __m512i sixteen = _mm512_set1_epi8(16), bits45 = _mm512_set1_epi8(0x30);
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8((char)0xF0);
    const __m512i top = _mm512_set1_epi8((char)0x80);
    __m512 f[BYTES_ROWS];
    for (int i = 0; i < R; i++) f[i] = _mm512_setzero_ps();
    for (long g = 0; g < groups; g++) {
        __m512i a[BYTES_ROWS][4];
        for (int i = 0; i < R; i++)
            for (int c = 0; c < 4; c++) a[i][c] = _mm512_setzero_si512();
        prefetch_group(qt, g, GROUP, BITS, PREFETCH_BYTES_FAST, PREFETCH_BYTES);
        if (BITS == 5 || BITS == 6) prefetch_high_bits(qt, g, GROUP, BITS, K);
        for (long b = g * GROUP; b < (g + 1) * GROUP; b += 8) {
            __m512i even_u, odd_u, even_s, odd_s;
            const __m512i v = BITS == 8 ? _mm512_setzero_si512()
                                        : _mm512_permutexvar_epi8(gather[0], _mm512_loadu_si512(qt + b * 8));
            if (BITS == 4) {
                even_u = even_s = _mm512_and_si512(v, low4);
                odd_u = _mm512_and_si512(v, high4);
                odd_s = _mm512_ternarylogic_epi32(v, high4, top, 0x6A); /* (v & 0xF0) ^ 0x80 */
            } else if (BITS == 5) {
                const __m512i words = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(qt + K * 8 + 2 * b)));
                const __m512i even_words = _mm512_permutexvar_epi16(fifth[0], words);
                const __m512i odd_words = _mm512_permutexvar_epi16(fifth[1], words);
                const __mmask64 even5 = _mm512_bitshuffle_epi64_mask(even_words, fifth[2]);
                const __mmask64 odd5 = _mm512_bitshuffle_epi64_mask(odd_words, fifth[2]);
                even_u = _mm512_and_si512(v, low4);
                odd_u = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                even_u = even_s = _mm512_mask_add_epi8(even_u, even5, even_u, sixteen);
                odd_u = odd_s = _mm512_mask_add_epi8(odd_u, odd5, odd_u, sixteen);
            } else if (BITS == 6) { /* lane L: rows 2L and 2L + 1's words; each byte's bits 4-5 picked into place */
                const __m256i step = _mm256_loadu_si256((const __m256i *)(qt + K * 8 + 4 * b));
                const __m512i words = _mm512_cvtepu32_epi64(step);
                const __m512i even = _mm512_multishift_epi64_epi8(sixth[0], words);
                const __m512i odd = _mm512_multishift_epi64_epi8(sixth[1], words);
                /* nibble | (high & 0x30) */
                even_u = even_s = _mm512_ternarylogic_epi32(_mm512_and_si512(v, low4), even, bits45, 0xF8);
                odd_u = odd_s = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), odd, bits45,
                                                          0xF8);
            } else {
                const __m512i v0 = _mm512_loadu_si512(qt + b * 16), v1 = _mm512_loadu_si512(qt + b * 16 + 64);
                even_s = _mm512_permutex2var_epi8(v0, gather[0], v1);
                odd_s = _mm512_permutex2var_epi8(v0, gather[1], v1);
                even_u = _mm512_xor_si512(even_s, top);
                odd_u = _mm512_xor_si512(odd_s, top);
            }
            for (int i = 0; i < R; i++) {
                const int32_t *four = xs->fours + (i * K + b) / 2;
                a[i][0] = _mm512_dpbusd_epi32(a[i][0], even_u, _mm512_set1_epi32(four[0]));
                a[i][1] = _mm512_dpbusd_epi32(a[i][1], odd_u, _mm512_set1_epi32(four[1]));
                a[i][2] = _mm512_dpbusd_epi32(a[i][2], _mm512_set1_epi32(four[2]), even_s);
                a[i][3] = _mm512_dpbusd_epi32(a[i][3], _mm512_set1_epi32(four[3]), odd_s);
            }
        }
        const __m512 s = group_values16(scale, g);
        for (int i = 0; i < R; i++) {
            const long at = i * groups + g;
            __m512i dot;
            if (BITS == 4) { /* 16 (dot - offset qsum) = 4096 a0 + 256 a1 + 16 a2 + a3 + 128 odd_low - 16 offset qsum */
                __m512i t = _mm512_add_epi32(_mm512_slli_epi32(a[i][0], 4), a[i][1]);
                t = _mm512_add_epi32(_mm512_slli_epi32(t, 4), a[i][2]);
                t = _mm512_add_epi32(_mm512_slli_epi32(t, 4), a[i][3]);
                const int32_t back = 128 * xs->odd_low_sum[at] - (HAS_OFFSET ? 16 * offset * x->qsum[at] : 0);
                dot = _mm512_srai_epi32(_mm512_add_epi32(t, _mm512_set1_epi32(back)), 4);
            } else if (BITS < 8) { /* 5 and 6 bits: dot = 256 (a0 + a1) + a2 + a3 - offset qsum */
                dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a[i][0], a[i][1]), 8),
                                       _mm512_add_epi32(a[i][2], a[i][3]));
                if (HAS_OFFSET) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset * x->qsum[at]));
            } else { /* dot = 256 (a0 + a1) + a2 + a3 - 32768 high */
                const __m512i high = _mm512_slli_epi32(_mm512_add_epi32(a[i][0], a[i][1]), 8);
                dot = _mm512_add_epi32(_mm512_add_epi32(high, a[i][2]),
                                       _mm512_sub_epi32(a[i][3], _mm512_set1_epi32(32768 * xs->high_sum[at])));
            }
            const __m512 scaled = _mm512_mul_ps(_mm512_set1_ps(x->scale[at]), _mm512_cvtepi32_ps(dot));
            f[i] = _mm512_fmadd_ps(s, scaled, f[i]);
            if (HAS_MIN) f[i] = _mm512_fmadd_ps(group_values16(min, g), _mm512_set1_ps(x->sum[at]), f[i]);
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(y + i * ldy, f[i]);
}

#define TILE_ROWS_BYTES(BITS, GROUP, HAS_OFFSET, HAS_MIN, R) \
    tile_rows_bytes(BITS, GROUP, HAS_OFFSET, HAS_MIN, R, x, xs, K, qt, offset, st, mt, y, N_padded)
#define QGEMM_BYTES_FN(BITS, GROUP, HAS_OFFSET, HAS_MIN)                                                              \
    static VBMI int qgemm_bytes_##BITS##_##GROUP##_##HAS_OFFSET##_##HAS_MIN(                                          \
        const lp_rounded_rows *x, const lp_split_rows *xs, long M, long K, const int8_t *q, int offset,                \
        const lp_scales *scales, long N_padded, float *Y) {                                                            \
        const long tile_bytes = K * 2 * BITS;                                                                          \
        /* guided: each thread streams a few long runs of tiles, and the last ones go to whichever thread is free, so  \
         * the threads end together where a static half each left one waiting out the other's slower memory */       \
        _Pragma("omp parallel for schedule(guided)") for (long t = 0; t < N_padded / TILE; t++) {                     \
            const int8_t *qt = q + t * tile_bytes;                                                                     \
            const lp_tile_factors st = tile_factors(scales->unit, scales->mult, scales->unit_groups, t, K / GROUP);    \
            const lp_tile_factors mt = tile_factors(scales->min_unit, scales->min_mult, scales->unit_groups, t, K / GROUP); \
            float *y = Y + t * TILE;                                                                                   \
            switch (M) {                                                                                               \
                case 2: TILE_ROWS_BYTES(BITS, GROUP, HAS_OFFSET, HAS_MIN, 2); break;                                   \
                case 1: TILE_ROWS_BYTES(BITS, GROUP, HAS_OFFSET, HAS_MIN, 1); break;                                   \
            }                                                                                                          \
        }                                                                                                              \
        return LP_OK;                                                                                                  \
    }
INT16_INSTANCES(QGEMM_BYTES_FN)

#define QGEMM_BYTES_CALL(BITS, GROUP, HAS_OFFSET, HAS_MIN) \
    qgemm_bytes_##BITS##_##GROUP##_##HAS_OFFSET##_##HAS_MIN(x, &xs, M, K, q, offset, scales, N_padded, Y)

static int has_vbmi_bitalg(void) {
    return __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bitalg");
}

/* X's rounded rows (at most BYTES_ROWS) split into bytes, then through tile_rows_bytes. */
static int qgemm_bytes(const lp_rounded_rows *x, long M, long K, const int8_t *q, const lp_scales *scales,
                       long N_padded, int bits, int offset, int group, float *Y) {
    lp_split_rows xs;
    int status = split_rows(x, M, K, group, &xs);
    if (status != LP_OK) return status;
    status = INT16_DISPATCH(QGEMM_BYTES_CALL);
    free(xs.high_sum);
    return status;
}

/* Up to 4 rows (those tile_rows_bytes does not take) read each pair straight from the packed bytes; more unpack the
 * tile once into a panel of pairs (in L1/L2, K * 32 bytes, one per thread) swept 6 rows at a time. One instance per
 * (bits, group, offset or not, min or not), each with its OpenMP loop where those are literals (see cpu_qgemm.h's
 * QGEMM_FN for why). */
#define TILE_ROWS(BITS, GROUP, HAS_OFFSET, HAS_MIN, PANEL, R) \
    tile_rows_vnni16(BITS, GROUP, HAS_OFFSET, HAS_MIN, PANEL, R, x, r, K, qt, panel, offset, st, mt, y, N_padded)
#define QGEMM_INT16_FN(BITS, GROUP, HAS_OFFSET, HAS_MIN)                                                              \
    static VNNI16 int qgemm_int16_##BITS##_##GROUP##_##HAS_OFFSET##_##HAS_MIN(                                         \
        const lp_rounded_rows *x, long M, long K, const int8_t *q, int offset, const lp_scales *scales,               \
        long N_padded, float *Y) {                                                                                     \
        const long tile_bytes = K * 2 * BITS;                                                                          \
        int status = LP_OK;                                                                                            \
        _Pragma("omp parallel") {                                                                                      \
            __m512i *panel = M > 4 ? aligned_alloc(64, K / 2 * sizeof(__m512i)) : NULL;                               \
            if (M > 4 && !panel) {                                                                                     \
                _Pragma("omp atomic write") status = LP_OUT_OF_MEMORY;                                                 \
            }                                                                                                          \
            _Pragma("omp for schedule(static)") for (long t = 0; t < N_padded / TILE; t++) {                          \
                const int8_t *qt = q + t * tile_bytes;                                                                 \
                const lp_tile_factors st = tile_factors(scales->unit, scales->mult, scales->unit_groups, t, K / GROUP); \
                const lp_tile_factors mt =                                                                             \
                    tile_factors(scales->min_unit, scales->min_mult, scales->unit_groups, t, K / GROUP);              \
                float *y = Y + t * TILE;                                                                               \
                long r = 0;                                                                                            \
                if (M <= 4) {                                                                                          \
                    switch (M) {                                                                                       \
                        case 4: TILE_ROWS(BITS, GROUP, HAS_OFFSET, HAS_MIN, 0, 4); break;                                                                \
                        case 3: TILE_ROWS(BITS, GROUP, HAS_OFFSET, HAS_MIN, 0, 3); break;                                                                \
                        case 2: TILE_ROWS(BITS, GROUP, HAS_OFFSET, HAS_MIN, 0, 2); break;                                                                \
                        case 1: TILE_ROWS(BITS, GROUP, HAS_OFFSET, HAS_MIN, 0, 1); break;                                                                \
                    }                                                                                                  \
                    continue;                                                                                          \
                }                                                                                                      \
                if (!panel) continue;                                                                                  \
                for (long p = 0; p < K / 2; p++) _mm512_store_si512(panel + p, pair_weights(BITS, qt, K, p));          \
                for (; r + 6 <= M; r += 6) TILE_ROWS(BITS, GROUP, HAS_OFFSET, HAS_MIN, 1, 6);                                                            \
                switch (M - r) {                                                                                       \
                    case 5: TILE_ROWS(BITS, GROUP, HAS_OFFSET, HAS_MIN, 1, 5); break;                                                                    \
                    case 4: TILE_ROWS(BITS, GROUP, HAS_OFFSET, HAS_MIN, 1, 4); break;                                                                    \
                    case 3: TILE_ROWS(BITS, GROUP, HAS_OFFSET, HAS_MIN, 1, 3); break;                                                                    \
                    case 2: TILE_ROWS(BITS, GROUP, HAS_OFFSET, HAS_MIN, 1, 2); break;                                                                    \
                    case 1: TILE_ROWS(BITS, GROUP, HAS_OFFSET, HAS_MIN, 1, 1); break;                                                                    \
                }                                                                                                      \
            }                                                                                                          \
            free(panel);                                                                                               \
        }                                                                                                              \
        return status;                                                                                                 \
    }
INT16_INSTANCES(QGEMM_INT16_FN)

#define QGEMM_INT16_CALL(BITS, GROUP, HAS_OFFSET, HAS_MIN) \
    qgemm_int16_##BITS##_##GROUP##_##HAS_OFFSET##_##HAS_MIN(&x, M, K, q, offset, scales, N_padded, Y)
#endif


/* X: [M, K] fp32; q, scales, bits (8, 4, 5 or 6), offset and group (32 or 16, dividing K) as lp_qgemm takes them
 * (8-bit values never have an offset); Y: [M, N_padded]. */
int lp_qgemm_int16(const float *X, int64_t M, int64_t K, const int8_t *q, const lp_scales *scales, int64_t N_padded,
                   int bits, int offset, int group, float *Y) {
    if (!packed_bits(bits) || (bits == 8 && offset) || !qgemm_sizes_fit(M, K, N_padded, group, scales))
        return LP_BAD_ARGUMENT;
    lp_rounded_rows x;
    int status = lp_round_rows(X, M, K, group, 16, &x);
    if (status != LP_OK) return status;
#if defined(__x86_64__)
    if (lp_has_vnni()) {
        status = M <= BYTES_ROWS && has_vbmi_bitalg()
                     ? qgemm_bytes(&x, M, K, q, scales, N_padded, bits, offset, group, Y)
                 : M >= AMX_INT16_ROWS && lp_amx_int8()
                     ? lp_qgemm_int16_amx(&x, M, K, q, scales, N_padded, bits, offset, group, Y)
                 : INT16_DISPATCH(QGEMM_INT16_CALL);
        lp_free_rows(&x);
        return status;
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
        tile_rows_plain16(&x, M, K, group, q + t * tile_bytes, bits, offset, st, mt, Y + t * TILE, N_padded);
    }
    lp_free_rows(&x);
    return status;
}
