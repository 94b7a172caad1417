/* Native CPU kernels in plain C: GCC/Clang vector extensions and OpenMP, no intrinsics (kernels/cpu.py's
 * "portable" path on ARM and on x86 CPUs without AVX2, and its "avx512" path: this source built with AVX-512
 * flags, where each 16-float vector below is one register, included by cpu_kernels_avx512.c for F16C's fp16
 * conversions): the generic fallback. Same interface (cpu_kernels.h), shared scaffolding (cpu_qgemm.h,
 * cpu_kv_dispatch.h) and numbers as the AVX2 kernels of cpu_kernels_avx2.c: read that file for how each kernel
 * works; here only what differs.
 *
 * Built with -ffp-contract=fast, so a product and a sum fuse into one FMA wherever the CPU has it (dot products,
 * exp's polynomial). Where the result must be rounded step by step, the product goes through ROUNDED, which no
 * contraction crosses: the weights' expansion (scale * q, then + min: exactly gguf-py's dequantised values) and
 * RoPE (bit for bit torch's elementwise ops).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#if !defined(__has_builtin) || !__has_builtin(__builtin_assoc_barrier) || !__has_builtin(__builtin_shufflevector) || \
    !__has_builtin(__builtin_convertvector)
#error "cpu_kernels_portable.c needs GCC 12 or later (for __builtin_assoc_barrier, shufflevector, convertvector)"
#endif
/* ROUNDED(x): x as computed, never fused with what consumes it. GCC 12 splits 64-byte vectors around its barrier
 * builtin into single lanes when AVX-512VL is on (a qgemm many times slower), so there an empty asm holding the
 * value in a vector register ("v") does the same job; x86 without FMA has nothing to fuse. */
#if defined(__AVX512F__)
#define ROUNDED(x) __extension__({ __typeof__(x) rounded_ = (x); __asm__("" : "+v"(rounded_)); rounded_; })
#elif defined(__x86_64__) && !defined(__FMA__)
#define ROUNDED(x) (x)
#else
#define ROUNDED(x) __builtin_assoc_barrier(x)
#endif
#define ALWAYS_INLINE inline __attribute__((always_inline))

typedef float floats16 __attribute__((vector_size(64))); /* one tile column: 16 weight rows */
typedef int32_t ints16 __attribute__((vector_size(64)));
typedef int16_t shorts16 __attribute__((vector_size(32)));
typedef int8_t bytes16 __attribute__((vector_size(16)));
typedef int8_t bytes8 __attribute__((vector_size(8)));
typedef float floats8 __attribute__((vector_size(32))); /* attention and row kernels: widths are multiples of 8 */
typedef int32_t ints8 __attribute__((vector_size(32)));
typedef float floats4 __attribute__((vector_size(16)));
typedef uint32_t uints8 __attribute__((vector_size(32))); /* 16-bit cache values, worked on as 32-bit bit patterns */
typedef uint16_t halves8 __attribute__((vector_size(16)));

/* Unaligned loads and stores: memcpy is what compilers turn into one vector move, without aliasing doubts. */
static ALWAYS_INLINE floats16 load16(const float *p) {
    floats16 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static ALWAYS_INLINE void store16(float *p, floats16 v) { memcpy(p, &v, sizeof v); }
static ALWAYS_INLINE floats8 load8(const float *p) {
    floats8 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static ALWAYS_INLINE void store8(float *p, floats8 v) { memcpy(p, &v, sizeof v); }

int lp_abi_version(void) { return LP_ABI_VERSION; }

/* The stored values' offset, as lp_qgemm takes it: narrowed to the int8_t the loops take off each value where a
 * tile's loops are called. */
typedef int qgemm_offset;
static ALWAYS_INLINE qgemm_offset qgemm_offset_of(int q_offset) { return q_offset; }

/* 16 signed bytes as 32-bit integers, written the way GCC 12 turns into vector code on each target (as read in
 * its output): its direct conversion goes one byte at a time, and each other form is good on one target only. */
static ALWAYS_INLINE ints16 widen(bytes16 v) {
#if defined(__AVX512F__) /* one vpmovsxbd */
    const ints16 w = {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]};
    return w;
#elif defined(__aarch64__) /* sxtl, sxtl2 */
    ints16 w;
    for (int j = 0; j < 16; j++) w[j] = v[j];
    return w;
#else
    return __builtin_convertvector(__builtin_convertvector(v, shorts16), ints16);
#endif
}

/* Columns k and k + 1 of a tile (k even): their 16 q values each, as floats in 32-bit lanes. 8 bits: a byte a
 * value, widened. 4, 5 and 6 bits: row j's byte holds both columns' nibbles (k's low, k + 1's high), widened once
 * and shifted for the second column; 5 bits add bit 4 from the column's 16-bit word (bit j for row j), 6 bits bits
 * 4 and 5 from row j's word for the column's 8.
 * No lane crosses another. With AVX-512 a 4- or 5-bit value's float (offset taken off) is looked up in a table of
 * 16 or 32 floats by one vpermps or vpermt2ps, which read only the low 4 or 5 bits of their index: no mask and no
 * conversion where 4 bits otherwise take a shift, a mask and a conversion a column, a large share of a one-row
 * projection's time (the one-row qgemm timings of benchmarks/cpu_kernel_bench.py); the same floats, so the same
 * sums. */
static ALWAYS_INLINE void load_columns(const int BITS, const int HAS_OFFSET, const int8_t *q, long K, long k,
                                       int8_t offset, floats16 w[2]) {
    if (BITS == 8) {
        for (int c = 0; c < 2; c++) {
            bytes16 v;
            memcpy(&v, q + (k + c) * TILE, sizeof v);
            w[c] = __builtin_convertvector(widen(v), floats16);
        }
        return;
    }
    bytes16 b;
    memcpy(&b, q + k * TILE / 2, sizeof b);
    const ints16 bytes = widen(b);
    ints16 v[2] = {bytes, bytes >> 4}; /* each column's value in the low four bits */
    if (BITS == 5) {
        const ints16 row = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        for (int c = 0; c < 2; c++) {
            uint16_t word;
            memcpy(&word, q + K * TILE / 2 + 2 * (k + c), sizeof word);
            v[c] = (v[c] & 15) | (((ints16){0} + word) >> row & 1) << 4;
        }
    }
    if (BITS == 6) { /* each row's word for the 8 columns holding k: bits 2 (k % 8) .. + 3 are k and k + 1's 4-5 */
        shorts16 words;
        memcpy(&words, q + K * TILE / 2 + k / 8 * 32, sizeof words);
        const ints16 n = __builtin_convertvector(words, ints16) >> 2 * (k % 8);
        v[0] = (v[0] & 15) | (n & 3) << 4;
        v[1] = (v[1] & 15) | (n >> 2 & 3) << 4;
    }
#if defined(__AVX512F__)
    if (BITS <= 5) { /* 6 bits would take a table of 64 floats: converted as below */
        const floats16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const floats16 low = HAS_OFFSET ? iota - (float)offset : iota, high = low + 16.0f;
        for (int c = 0; c < 2; c++)
            w[c] = BITS == 4 ? __builtin_shuffle(low, v[c]) : __builtin_shuffle(low, high, v[c]);
        return;
    }
#endif
    for (int c = 0; c < 2; c++) {
        if (BITS == 4) v[c] &= 15;
        if (HAS_OFFSET) v[c] -= offset;
        w[c] = __builtin_convertvector(v[c], floats16);
    }
}

/* The 16 weights of a column of q values: scale * q, then + min, each rounded (see the top). */
static ALWAYS_INLINE floats16 weights(const int HAS_MIN, floats16 q, floats16 s, floats16 m) {
    const floats16 w = ROUNDED(s * q);
    return HAS_MIN ? w + m : w;
}

/* R rows of X (R <= 6, a constant after inlining) times one panel: R accumulators of 16 floats. */
static ALWAYS_INLINE void rows_times_panel(const int R, const float *X, long K, const float *P, float *Y, long ldy) {
    floats16 a[6];
    for (int i = 0; i < R; i++) a[i] = (floats16){0};
    for (long k = 0; k < K; k++) {
        const floats16 w = load16(P + k * TILE);
        for (int i = 0; i < R; i++) a[i] += X[i * K + k] * w;
    }
    for (int i = 0; i < R; i++) store16(Y + i * ldy, a[i]);
}

static ALWAYS_INLINE float sum8(floats8 v) {
    const floats4 h = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (h[0] + h[2]) + (h[1] + h[3]);
}

/* The sum of n floats (n a multiple of 8). */
static ALWAYS_INLINE float sum_floats(const float *x, const int n) {
    floats8 acc = load8(x);
    for (int j = 8; j < n; j += 8) acc += load8(x + j);
    return sum8(acc);
}

/* R rows of X (R <= 4) times one tile, each column of q expanded in registers as it goes. Within a group the
 * weights share a scale and a min, so a row's share of the group is scale * sum(x q) + min * sum(x): two
 * multiply-adds a group instead of a multiply and an add for every weight. Each weight's product is still with
 * q exactly, the result the same float32 dot product summed in another order (a one-hot row still reads back
 * exactly scale * q + min). It made every one-row projection of the default model faster on both the AVX-512 and
 * the AVX2 path, and one chat's decode with them (benchmarks/cpu_kernel_bench.py, and its --engine for the decode).
 * Four chains for one row instead of two bought nothing. With one or two rows each row sums even and odd columns
 * apart: a single chain waits out every FMA's latency. */
static ALWAYS_INLINE void rows_times_tile(const int BITS, const int HAS_OFFSET, const int GROUP, const int HAS_MIN,
                                          const int R, const float *X, long K, const int8_t *q, int8_t offset,
                                          const float *scale, const float *min, float *Y, long ldy) {
    const int CHAINS = R <= 2 ? 2 : 1;
    floats16 a[4];
    for (int i = 0; i < R; i++) a[i] = (floats16){0};
    for (long kb = 0; kb < K / GROUP; kb++) {
        floats16 g[4][2]; /* each row's sum of x q over the group, per chain */
        for (int i = 0; i < R; i++)
            for (int c = 0; c < CHAINS; c++) g[i][c] = (floats16){0};
        prefetch_group(q, kb, GROUP, BITS, PREFETCH_BYTES, 0);
        for (long k = kb * GROUP; k < (kb + 1) * GROUP; k += 2) {
            floats16 w[2];
            load_columns(BITS, HAS_OFFSET, q, K, k, offset, w);
            for (int c = 0; c < 2; c++)
                for (int i = 0; i < R; i++) g[i][c % CHAINS] += X[i * K + k + c] * w[c];
        }
        const floats16 s = load16(scale + kb * TILE);
        for (int i = 0; i < R; i++) {
            for (int c = 1; c < CHAINS; c++) g[i][0] += g[i][c];
            a[i] += s * g[i][0];
            if (HAS_MIN) a[i] += load16(min + kb * TILE) * sum_floats(X + i * K + kb * GROUP, GROUP);
        }
    }
    for (int i = 0; i < R; i++) store16(Y + i * ldy, a[i]);
}

/* A tile into the fp32 panel P: each column's weights (see weights) at P + k * TILE. */
static ALWAYS_INLINE void expand_panel(const int BITS, const int HAS_OFFSET, const int GROUP, const int HAS_MIN,
                                       const int8_t *q, int8_t offset, const float *scale, const float *min, long K,
                                       float *P) {
    for (long kb = 0; kb < K / GROUP; kb++) {
        const floats16 s = load16(scale + kb * TILE), m = HAS_MIN ? load16(min + kb * TILE) : (floats16){0};
        for (long k = kb * GROUP; k < (kb + 1) * GROUP; k += 2) {
            floats16 q2[2];
            load_columns(BITS, HAS_OFFSET, q, K, k, offset, q2);
            for (int c = 0; c < 2; c++) store16(P + (k + c) * TILE, weights(HAS_MIN, q2[c], s, m));
        }
    }
}

#include "cpu_qgemm.h" /* qgemm_tile over the loops above, every (bits, offset, group, min) instance, lp_qgemm */

static ALWAYS_INLINE floats8 select8(ints8 mask, floats8 yes, floats8 no) {
    return (floats8)((mask & (ints8)yes) | (~mask & (ints8)no));
}

/* exp for 8 floats, as exp8 in cpu_kernels_avx2.c (Cephes' expf, inputs clamped to [-87.3, 88.3]); n = round(x / ln 2)
 * by adding and taking off 1.5 * 2^23, which rounds to the nearest integer as the AVX2 version's round does. */
static ALWAYS_INLINE floats8 exp8(floats8 x) {
    const floats8 lowest = (floats8){0} - 87.3f, highest = (floats8){0} + 88.3f;
    x = select8(x < lowest, lowest, select8(x > highest, highest, x));
    const float shifter = 12582912.0f;
    const floats8 n = (x * 1.44269504088896341f + shifter) - shifter;
    x = x - n * 0.693359375f;
    x = x - n * -2.12194440e-4f;
    floats8 y = 1.9875691500e-4f + (floats8){0};
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + (x + 1.0f);
    const ints8 e = (__builtin_convertvector(n, ints8) + 127) << 23;
    return y * (floats8)e;
}

/* 8 16-bit values as 32-bit lanes and back, written the way GCC 12 turns into one instruction each (vpmovzxwd and
 * vpmovdw, uxtl and uzp1); its __builtin_convertvector takes 5 instructions on AVX-512 for the first. */
static ALWAYS_INLINE uints8 widen_halves(halves8 h) { return (uints8){h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]}; }
static ALWAYS_INLINE halves8 narrow_halves(uints8 w) {
    return (halves8){w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]};
}

static ALWAYS_INLINE uints8 select_bits(ints8 mask, uints8 yes, uints8 no) {
    return ((uints8)mask & yes) | (~(uints8)mask & no);
}

/* fp16 <-> fp32, 8 values at a time: F16_TO_F32(halves8) exactly, F32_TO_F16(floats8) rounded to nearest even as
 * torch's .to() rounds (overflow to infinity, subnormals kept, a NaN a NaN). By the hardware where the compiler
 * gives its vector conversions: F16C in cpu_kernels_avx512.c, which defines both and includes this file, and
 * _Float16 on AArch64 (fcvtl; narrowing goes a lane at a time, only on the KV write). Elsewhere, GCC 12 converts
 * _Float16 a lane at a time (x86) or has no such type, so integer ops do it. */
#if defined(F16_TO_F32)
#elif defined(__aarch64__)
typedef _Float16 float16s8 __attribute__((vector_size(16)));
#define F16_TO_F32(h) __builtin_convertvector((float16s8)(h), floats8)
#define F32_TO_F16(x) ((halves8)__builtin_convertvector((x), float16s8))
#else
/* A normal number's exponent is rebased by 112 (127 - 15); infinity and NaN (exponent 31) by 224, to fp32's 255,
 * the payload kept; a subnormal, m * 2^-24, is m converted and scaled: normal fp32 arithmetic, which no
 * flush-to-zero mode changes. */
static ALWAYS_INLINE floats8 widen_f16(halves8 half) {
    const uints8 h = widen_halves(half);
    const ints8 exponent = (ints8)(h & 0x7C00);
    uints8 bits = ((h & 0x7FFF) << 13) + (112u << 23);
    bits = select_bits(exponent == 0x7C00, bits + (112u << 23), bits);
    bits = select_bits(exponent == 0, (uints8)(__builtin_convertvector((ints8)(h & 0x3FF), floats8) * 0x1p-24f), bits);
    return (floats8)(bits | (h & 0x8000) << 16);
}

/* A result of 2^-14 or more: the exponent rebased, then 0xFFF plus the lowest kept bit added before the low 13 bits
 * are dropped (a carry out of 65504 makes the infinity 0x7C00). Below 2^-14, |x| + 0.5 in fp32 leaves |x| rounded
 * to a multiple of 2^-24, the subnormal's bits, in its mantissa. Past 65535 the result is infinity, and a NaN is the
 * quiet NaN 0x7E00, each with x's sign, as torch's scalar conversion gives. */
static ALWAYS_INLINE halves8 narrow_f16(floats8 x) {
    const uints8 u = (uints8)x, magnitude = u & 0x7FFFFFFF, half = (uints8)((floats8){0} + 0.5f);
    uints8 h = (magnitude - (112u << 23) + 0xFFF + (magnitude >> 13 & 1)) >> 13;
    h = select_bits((ints8)(magnitude < (113u << 23)), (uints8)((floats8)magnitude + 0.5f) - half, h);
    h = select_bits((ints8)(magnitude >= (143u << 23)), (uints8){0} + 0x7C00, h);
    h = select_bits((ints8)(magnitude > 0x7F800000), (uints8){0} + 0x7E00, h);
    return narrow_halves(h | (u >> 16 & 0x8000));
}
#define F16_TO_F32(h) widen_f16(h)
#define F32_TO_F16(x) narrow_f16(x)
#endif

/* Cache values i .. i + 7 of p, as fp32 (exactly, for every type): bf16 is an fp32's top half. KV is a constant
 * after inlining. */
static ALWAYS_INLINE floats8 load_kv8(const int KV, const void *p, long i) {
    if (KV == LP_KV_F32) return load8((const float *)p + i);
    halves8 h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return KV == LP_KV_F16 ? F16_TO_F32(h) : (floats8)(widen_halves(h) << 16);
}

/* x into cache values i .. i + 7 of p, rounded to nearest even as torch's .to() rounds; bf16 by adding 0x7FFF plus
 * the lowest kept bit, then dropping the low half (a NaN is stored as the quiet NaN 0x7FC0: rounding would carry
 * some NaNs into an infinity). */
static ALWAYS_INLINE void store_kv8(const int KV, void *p, long i, floats8 x) {
    if (KV == LP_KV_F32) {
        store8((float *)p + i, x);
        return;
    }
    halves8 h;
    if (KV == LP_KV_F16) {
        h = F32_TO_F16(x);
    } else {
        const uints8 u = (uints8)x, rounded = (u + 0x7FFF + (u >> 16 & 1)) >> 16;
        h = narrow_halves(select_bits((ints8)((u & 0x7FFFFFFF) > 0x7F800000), (uints8){0} + 0x7FC0, rounded));
    }
    memcpy((uint16_t *)p + i, &h, sizeof h);
}

/* How many query heads of a KV head one walk over its keys serves: each K and V row is widened once for all of them,
 * and each 8 keys' dot products are summed across lanes together (sum8x8) instead of one by one. Three heads'
 * accumulators (3 x 8 vectors) fit AVX-512's 32 registers; elsewhere one head a walk (cpu_kernels_avx2.c does three
 * heads with 4 keys at a time in AVX2's 16). Against one head a walk it decodes a batch of sequences faster
 * (benchmarks/cpu_kernel_bench.py's paged_decode timings of 16 sequences, avx512 column). */
#if defined(__AVX512F__)
#define HEADS_A_WALK 3
#else
#define HEADS_A_WALK 1
#endif

/* 8 sums of 8 floats, r[t] = the sum of a[t]'s lanes, by pairwise shuffles and adds. */
static ALWAYS_INLINE floats8 sum8x8(const floats8 a[8]) {
    floats8 b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* The decode attention's vector: on the AVX-512 build (cpu_kernels_avx512.c, which gives F16_TO_F32_16) a whole
 * register, half the conversions and multiply-adds a key of 8-float vectors; elsewhere 8 floats (NEON's or SSE's
 * registers would spill GB x 8 accumulators of 16). A head_dim that is not a multiple of 16 ends in an 8-float
 * step. */
#if defined(__AVX512F__) && defined(F16_TO_F32_16)
typedef floats16 kvvec;
#define KV_LANES 16
typedef uint16_t halves16 __attribute__((vector_size(32)));
typedef uint32_t uints16 __attribute__((vector_size(64)));
static ALWAYS_INLINE kvvec load_kvvec(const int KV, const void *p, long i) {
    if (KV == LP_KV_F32) return load16((const float *)p + i);
    halves16 h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    if (KV == LP_KV_F16) return F16_TO_F32_16(h);
    const uints16 w = {h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9], h[10], h[11], h[12], h[13], h[14],
                       h[15]};
    return (kvvec)(w << 16);
}
static ALWAYS_INLINE kvvec load_vec(const float *p) { return load16(p); }
static ALWAYS_INLINE void store_vec(float *p, kvvec v) { store16(p, v); }
static ALWAYS_INLINE floats8 fold8(kvvec v) {
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else
typedef floats8 kvvec;
#define KV_LANES 8
static ALWAYS_INLINE kvvec load_kvvec(const int KV, const void *p, long i) { return load_kv8(KV, p, i); }
static ALWAYS_INLINE kvvec load_vec(const float *p) { return load8(p); }
static ALWAYS_INLINE void store_vec(float *p, kvvec v) { store8(p, v); }
static ALWAYS_INLINE floats8 fold8(kvvec v) { return v; }
#endif

/* scores[g][j] (rows n apart) = scale * q_g . K row of key first + j, for GB heads (q_g at qh + g D) and every key
 * first .. first + n - 1: 8 keys at a time, each K row widened once and multiplied into GB x 8 independent chains
 * (a D that is not a multiple of KV_LANES ends in 8-float ones). */
static ALWAYS_INLINE void keys_times_heads(const int KV, const int GB, const float *qh, const void *k_cache,
                                           const int32_t *table, long first, long n, long kvh, long KVH, long D,
                                           float scale, float *scores) {
#define KROW(j) ((((long)table[(j) / 16] * 16 + (j) % 16) * KVH + kvh) * D) /* where token j's K starts */
    const long whole = D / KV_LANES * KV_LANES;
    long j = 0;
    for (; j + 8 <= n; j += 8) {
        long k[8];
        kvvec acc[3][8];
        floats8 sums[3][8];
        for (int t = 0; t < 8; t++) k[t] = KROW(first + j + t);
        for (int g = 0; g < GB; g++)
            for (int t = 0; t < 8; t++) acc[g][t] = (kvvec){0};
        for (long d = 0; d < whole; d += KV_LANES) {
            kvvec qd[3];
            for (int g = 0; g < GB; g++) qd[g] = load_vec(qh + g * D + d);
            for (int t = 0; t < 8; t++) {
                const kvvec key = load_kvvec(KV, k_cache, k[t] + d);
                for (int g = 0; g < GB; g++) acc[g][t] += qd[g] * key;
            }
        }
        for (int g = 0; g < GB; g++)
            for (int t = 0; t < 8; t++) sums[g][t] = fold8(acc[g][t]);
        if (whole < D) {
            floats8 qd[3];
            for (int g = 0; g < GB; g++) qd[g] = load8(qh + g * D + whole);
            for (int t = 0; t < 8; t++) {
                const floats8 key = load_kv8(KV, k_cache, k[t] + whole);
                for (int g = 0; g < GB; g++) sums[g][t] += qd[g] * key;
            }
        }
        for (int g = 0; g < GB; g++) store8(scores + g * n + j, sum8x8(sums[g]) * scale);
    }
    for (; j < n; j++) {
        const long k = KROW(first + j);
        floats8 acc[3];
        for (int g = 0; g < GB; g++) acc[g] = (floats8){0};
        for (long d = 0; d < D; d += 8) {
            const floats8 key = load_kv8(KV, k_cache, k + d);
            for (int g = 0; g < GB; g++) acc[g] += load8(qh + g * D + d) * key;
        }
        for (int g = 0; g < GB; g++) scores[g * n + j] = sum8(acc[g]) * scale;
    }
#undef KROW
}

/* o_g[0 : 8*VECS] (rows D apart) = inv[g] * sum over keys first .. first + n - 1 (first a multiple of 16) of p_g[t]
 * * V row t (p_g rows n apart), from column col of each row on, for GB heads: each V row widened once, in vectors
 * of KV_LANES (and an 8-float one where VECS is odd on AVX-512). */
static ALWAYS_INLINE void weighted_rows(const int KV, const int GB, const int VECS, const float *p, long first, long n,
                                        const int32_t *table, const void *v, long col, long stride, const float *inv,
                                        long D, float *o) {
    const int WIDE = VECS * 8 / KV_LANES, TAIL = VECS * 8 % KV_LANES != 0; /* constants after inlining */
    kvvec a[3][8];
    floats8 tail[3] = {{0}};
    for (int g = 0; g < GB; g++)
        for (int i = 0; i < WIDE; i++) a[g][i] = (kvvec){0};
    for (long blk = 0; blk * 16 < n; blk++) {
        const long vb = (long)table[first / 16 + blk] * 16 * stride + col;
        const long count = n - blk * 16 < 16 ? n - blk * 16 : 16;
        for (long t = 0; t < count; t++) {
            float w[3];
            for (int g = 0; g < GB; g++) w[g] = p[g * n + blk * 16 + t];
            for (int i = 0; i < WIDE; i++) {
                const kvvec value = load_kvvec(KV, v, vb + t * stride + KV_LANES * i);
                for (int g = 0; g < GB; g++) a[g][i] += w[g] * value;
            }
            if (TAIL) {
                const floats8 value = load_kv8(KV, v, vb + t * stride + KV_LANES * WIDE);
                for (int g = 0; g < GB; g++) tail[g] += w[g] * value;
            }
        }
    }
    for (int g = 0; g < GB; g++) {
        for (int i = 0; i < WIDE; i++) store_vec(o + g * D + KV_LANES * i, a[g][i] * inv[g]);
        if (TAIL) store8(o + g * D + KV_LANES * WIDE, tail[g] * inv[g]);
    }
}

#define COLUMNS_A_WALK(GB) 64 /* columns of V one walk takes for GB heads */

/* s[0 .. n - 1] (n >= 1) into exp(s - mx) in place (mx: their max, scores_max); the sum of the exps. */
static ALWAYS_INLINE void exp_scores(float *s, long n, float mx, float *sum) {
    float total = 0.0f;
    long j = 0;
    floats8 acc = {0};
    for (; j + 8 <= n; j += 8) {
        const floats8 e = exp8(load8(s + j) - mx);
        store8(s + j, e);
        acc += e;
    }
    total = sum8(acc);
    if (j < n) {
        float tail[8] = {0};
        for (long t = j; t < n; t++) tail[t - j] = s[t] - mx;
        const floats8 e = exp8(load8(tail));
        for (long t = j; t < n; t++) s[t] = e[t - j], total += e[t - j];
    }
    *sum = total;
}

/* The small per-layer steps' rows, as in cpu_kernels_avx2.c; the row loop in cpu_rows.h. */

static inline void add_rms_norm_row(const float *x, const float *residual, const float *weight, long D, float eps,
                                    float *sum, float *out) {
    floats8 sq = {0};
    for (long d = 0; d < D; d += 8) {
        floats8 v = load8(x + d);
        if (residual) v += load8(residual + d);
        store8(sum + d, v);
        sq += v * v;
    }
    const float inv = 1.0f / sqrtf(sum8(sq) / (float)D + eps);
    for (long d = 0; d < D; d += 8) store8(out + d, load8(sum + d) * inv * load8(weight + d));
}

static inline void silu_mul_row(const float *gate, const float *up, long I, float *out) {
    for (long i = 0; i < I; i += 8) {
        const floats8 x = load8(gate + i);
        store8(out + i, x / (1.0f + exp8(-x)) * load8(up + i)); /* exp(-x): large -x saturates, silu -> 0 */
    }
}

#include "cpu_rows.h"

/* Token n of lp_rope_write_kv, as rope_write_row in cpu_kernels_avx2.c; each product ROUNDED, so q and k equal torch's
 * bit for bit before the cache's rounding. */
static ALWAYS_INLINE void rope_write_row(const int KV, long n, long slot, const float *qkv, const float *cos,
                                         const float *sin, long H, long KVH, long D, long R, void *k_cache,
                                         void *v_cache, float *q_out) {
    const long half = R / 2, width = (H + 2 * KVH) * D;
    const float *row = qkv + n * width, *c = cos + n * half, *s = sin + n * half;
    for (long h = 0; h < H + KVH; h++) {
        if (h >= H && slot < 0) break;
        const float *x = row + h * D;
        for (long i = 0; i < half; i += 8) {
            const floats8 x1 = load8(x + i), x2 = load8(x + half + i), cv = load8(c + i), sv = load8(s + i);
            const floats8 lo = ROUNDED(x1 * cv) - ROUNDED(x2 * sv), hi = ROUNDED(x2 * cv) + ROUNDED(x1 * sv);
            if (h < H) {
                store8(q_out + (n * H + h) * D + i, lo);
                store8(q_out + (n * H + h) * D + half + i, hi);
            } else {
                const long k = (slot * KVH + h - H) * D;
                store_kv8(KV, k_cache, k + i, lo);
                store_kv8(KV, k_cache, k + half + i, hi);
            }
        }
        for (long i = R; i < D; i += 8) /* past the rotary dimensions: as they are */
            if (h < H)
                store8(q_out + (n * H + h) * D + i, load8(x + i));
            else
                store_kv8(KV, k_cache, (slot * KVH + h - H) * D + i, load8(x + i));
    }
    if (slot >= 0)
        for (long i = 0; i < KVH * D; i += 8)
            store_kv8(KV, v_cache, slot * KVH * D + i, load8(row + (H + KVH) * D + i));
}

/* The steps of a prefill tile (prefill_task in cpu_kv_dispatch.h says what each computes). Scores and weights lie
 * key by key, ROW_LANES rows to a vector, so that the softmax's max and sum run down the keys, lane by lane, with no
 * reduction across a vector. A vector is one register: 16 floats on AVX-512, where a step takes two blocks (32 keys)
 * and the scores 8 keys at a time; elsewhere 8 floats (two NEON or SSE registers: wider vectors, which GCC splits,
 * ran the weighted sum of V several times slower on SSE2), one block a step and the scores 4 keys at a time. */
#if defined(__AVX512F__)
typedef floats16 lanes;
typedef ints16 lane_ints;
#define load_lanes load16
#define store_lanes store16
#define ROW_LANES 16
#define PREFILL_KEYS 32
#define KEY_GROUP 8
#define VALUE_ROWS 6
#else
typedef floats8 lanes;
typedef ints8 lane_ints;
#define load_lanes load8
#define store_lanes store8
#define ROW_LANES 8
#define PREFILL_KEYS 16
#define KEY_GROUP 4
#define VALUE_ROWS 2
#endif
#define VALUE_VECS 4 /* vectors of V columns a pass */

static ALWAYS_INLINE lane_ints load_lane_ints(const int32_t *p) {
    lane_ints v;
    memcpy(&v, p, sizeof v);
    return v;
}
static ALWAYS_INLINE lanes select_lanes(lane_ints mask, lanes yes, lanes no) {
    return (lanes)((mask & (lane_ints)yes) | (~mask & (lane_ints)no));
}

/* 2^x: Cephes' exp2f polynomial (relative error 1.7e-7) on x less its nearest integer n, times 2^n through the
 * exponent bits. x is clamped at -126: 2^-126 ~ 1e-38 stands for 0 (an empty row's rescaling: what it scales is 0),
 * and softmax_rows zeroes the weights of keys past a row itself. The prefill's scores are in log2 units (q was
 * scaled by log2 e) for it: 2^x takes 15 vector operations where exp, with its Cody-Waite steps, takes 20. */
static ALWAYS_INLINE lanes exp2_lanes(lanes x) {
    const lanes lowest = (lanes){0} - 126.0f;
    x = select_lanes(x < lowest, lowest, x);
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding and taking it off rounds to the nearest integer */
    const lanes n = (x + shifter) - shifter, f = x - n;
    lanes y = 1.535336188319500e-4f + (lanes){0};
    y = y * f + 1.339887440266574e-3f;
    y = y * f + 9.618437357674640e-3f;
    y = y * f + 5.550332471162809e-2f;
    y = y * f + 2.402264791363012e-1f;
    y = y * f + 6.931472028550421e-1f;
    y = y * f + 1.0f;
    return y * (lanes)((__builtin_convertvector(n, lane_ints) + 127) << 23);
}

static ALWAYS_INLINE void widen_rows(const int KV, const void *cache, long row0, long stride, long n, long D,
                                     long width, float *out) {
    for (long j = 0; j < n; j++) {
        for (long d = 0; d < D; d += 8) store8(out + j * width + d, load_kv8(KV, cache, row0 + j * stride + d));
        for (long d = D; d < width; d++) out[j * width + d] = 0.0f;
    }
}

/* s[j][r0 ..] for the KEY_GROUP keys from k (rows k_stride apart) and the ROW_LANES rows from r0: KEY_GROUP
 * accumulators, each k[j][d] broadcast. Several vectors of rows a pass ran no faster on AVX-512 and, with
 * GCC's 8-float vectors on SSE2, several times slower. */
static ALWAYS_INLINE void keys_times_row_vector(const float *k, long k_stride, const float *qt, long rows, long r0,
                                                long D, float *s) {
    lanes a[KEY_GROUP];
    for (int j = 0; j < KEY_GROUP; j++) a[j] = (lanes){0};
    for (long d = 0; d < D; d++) {
        const lanes q = load_lanes(qt + d * rows + r0);
        for (int j = 0; j < KEY_GROUP; j++) a[j] += k[j * k_stride + d] * q;
    }
    for (int j = 0; j < KEY_GROUP; j++) store_lanes(s + j * rows + r0, a[j]);
}

static ALWAYS_INLINE void keys_times_rows(const float *const k[], long k_stride, long n, const float *qt, long rows,
                                          long D, float *s) {
    for (long j0 = 0; j0 < n; j0 += KEY_GROUP)
        for (long r0 = 0; r0 < rows; r0 += ROW_LANES)
            keys_times_row_vector(k[j0 / 16] + j0 % 16 * k_stride, k_stride, qt, rows, r0, D, s + j0 * rows);
}

static ALWAYS_INLINE void softmax_rows(float *s, long rows, const int32_t *pos, long k0, float *m, float *l,
                                       float *alpha) {
    const lanes minus_inf = (lanes){0} - INFINITY;
    for (long v = 0; v < rows; v += ROW_LANES) {
        const lane_ints last = load_lane_ints(pos + v) - (int32_t)k0; /* key j is past a row when j > last */
        const int masked = k0 + PREFILL_KEYS - 1 > pos[v];            /* pos[v], the vector's first row, is its least */
        const lanes old = load_lanes(m + v);
        lanes top = old;
        for (long j = 0; j < PREFILL_KEYS; j++) {
            lanes x = load_lanes(s + j * rows + v);
            if (masked) x = select_lanes((lane_ints){0} + (int32_t)j > last, minus_inf, x);
            top = select_lanes(x > top, x, top);
        }
        const lanes rescale = exp2_lanes(old - top);
        lanes total = {0};
        for (long j = 0; j < PREFILL_KEYS; j++) {
            lanes e = exp2_lanes(load_lanes(s + j * rows + v) - top);
            if (masked) e = select_lanes((lane_ints){0} + (int32_t)j > last, (lanes){0}, e);
            store_lanes(s + j * rows + v, e);
            total += e;
        }
        store_lanes(m + v, top);
        store_lanes(alpha + v, rescale);
        store_lanes(l + v, load_lanes(l + v) * rescale + total);
    }
}

/* ROWS rows from r0 (<= VALUE_ROWS) by VECS vectors of columns from d0 (<= VALUE_VECS): acc = alpha acc + p V, key
 * j's V row at v[j / 16] + j % 16 * v_stride. */
static ALWAYS_INLINE void rows_times_values(const int ROWS, const int VECS, const float *p, long rows, long r0,
                                            const float *const v[], long v_stride, long n, long d0, long D,
                                            const float *alpha, float *acc) {
    lanes a[VALUE_ROWS][VALUE_VECS];
    for (int i = 0; i < ROWS; i++)
        for (int c = 0; c < VECS; c++) a[i][c] = load_lanes(acc + (r0 + i) * D + d0 + ROW_LANES * c) * alpha[r0 + i];
    for (long j = 0; j < n; j++) {
        const float *vj = v[j / 16] + j % 16 * v_stride + d0;
        lanes x[VALUE_VECS];
        for (int c = 0; c < VECS; c++) x[c] = load_lanes(vj + ROW_LANES * c);
        for (int i = 0; i < ROWS; i++) {
            const float w = p[j * rows + r0 + i];
            for (int c = 0; c < VECS; c++) a[i][c] += w * x[c];
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int c = 0; c < VECS; c++) store_lanes(acc + (r0 + i) * D + d0 + ROW_LANES * c, a[i][c]);
}

static ALWAYS_INLINE void rows_times_value_columns(const int ROWS, const float *p, long rows, long r0,
                                                   const float *const v[], long v_stride, long n, long D,
                                                   const float *alpha, float *acc) {
    enum { PASS = ROW_LANES * VALUE_VECS };
    for (long d0 = 0; d0 < D; d0 += PASS) switch ((D - d0 < PASS ? D - d0 : PASS) / ROW_LANES) {
            case 4: rows_times_values(ROWS, 4, p, rows, r0, v, v_stride, n, d0, D, alpha, acc); break;
            case 3: rows_times_values(ROWS, 3, p, rows, r0, v, v_stride, n, d0, D, alpha, acc); break;
            case 2: rows_times_values(ROWS, 2, p, rows, r0, v, v_stride, n, d0, D, alpha, acc); break;
            case 1: rows_times_values(ROWS, 1, p, rows, r0, v, v_stride, n, d0, D, alpha, acc); break;
        }
}

static ALWAYS_INLINE void accumulate_values(const float *p, long rows, long R, const float *const v[], long v_stride,
                                            long n, long D, const float *alpha, float *acc) {
    long r = 0;
    for (; r + VALUE_ROWS <= R; r += VALUE_ROWS)
        rows_times_value_columns(VALUE_ROWS, p, rows, r, v, v_stride, n, D, alpha, acc);
    for (; r < R; r++) rows_times_value_columns(1, p, rows, r, v, v_stride, n, D, alpha, acc);
}

#include "cpu_kv_dispatch.h"
