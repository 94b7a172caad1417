/* The "avx2" path of kernels/cpu_isa.py: the native CPU kernels written with AVX2 + FMA + F16C intrinsics (OpenMP),
 * loaded by kernels/cpu.py where the CPU has those but not AVX-512. The scaffolding every path shares is included:
 * lp_qgemm's (cpu_qgemm.h: the packed layout, the panel, the tiling, the OpenMP wrapper) and the attention
 * kernels' (cpu_kv_dispatch.h); this file holds their inner loops, under the names those headers call. The weights'
 * expansion multiplies then adds in separate roundings (this file is built with -ffp-contract=off), so the weights
 * used are exactly gguf-py's dequantised fp32 values.
 *
 * The interface kernels/cpu.py binds (statuses, ABI version, signatures) is declared in cpu_kernels.h; lp_pack_q,
 * plain C, is cpu_pack.c, built into every path's library. kernels/cpu.py picks this build, the AVX-512 one
 * (cpu_kernels_avx512.c) or the portable one (cpu_kernels_portable.c) by what the CPU reports.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

int lp_abi_version(void) { return LP_ABI_VERSION; }

/* The stored values' offset, one byte in every lane, taken off a column's 16 bytes at once. */
typedef __m128i qgemm_offset;
static inline qgemm_offset qgemm_offset_of(int q_offset) { return _mm_set1_epi8((char)q_offset); }

/* Columns k and k + 1 of a tile (k even): their 16 q values each as two vectors of 8 floats (rows 0-7 and 8-15),
 * w[c][0] and w[c][1] for column k + c. 4-bit values with no offset (Q4_1, Q4_K: 0..15) widen straight from their
 * nibbles. Otherwise each column's 16 values are first put together as bytes (the high bits spread by a byte
 * shuffle, the offset taken off), then widened the same way for every width. The 4-bit shortcut skips the generic
 * path's unpack and sign-widening, a large share of each column's cost in a one-row projection (the one-row qgemm
 * timings of benchmarks/cpu_kernel_bench.py). */
static inline __attribute__((always_inline)) void load_columns(
    const int BITS, const int HAS_OFFSET, const int8_t *q, long K, long k, __m128i offset, __m256 w[2][2]) {
    __m128i v[2];
    if (BITS == 8) {
        for (int c = 0; c < 2; c++) v[c] = _mm_loadu_si128((const __m128i *)(q + (k + c) * TILE));
    } else {
        const __m128i b = _mm_loadu_si128((const __m128i *)(q + k * TILE / 2)), low4 = _mm_set1_epi8(0x0F);
        v[0] = _mm_and_si128(b, low4), v[1] = _mm_and_si128(_mm_srli_epi16(b, 4), low4); /* rows 0-15 */
        if (BITS == 4 && !HAS_OFFSET) {
            for (int c = 0; c < 2; c++) {
                w[c][0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v[c]));
                w[c][1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v[c], 8)));
            }
            return;
        }
        for (int c = 0; c < 2 && BITS == 5; c++) {
            const __m128i word = _mm_set1_epi16(((const int16_t *)(q + K * TILE / 2))[k + c]);
            const __m128i spread = _mm_shuffle_epi8(word, _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
            const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
            v[c] = _mm_or_si128(v[c], _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(16)));
        }
        if (BITS == 6) { /* each row's word for the 8 columns holding k: columns k and k + 1's bits 4-5 to its byte */
            const __m256i words = _mm256_loadu_si256((const __m256i *)(q + K * TILE / 2 + k / 8 * 32));
            const __m256i four = _mm256_and_si256(_mm256_srl_epi16(words, _mm_cvtsi32_si128(2 * (k % 8))),
                                                  _mm256_set1_epi16(15));
            const __m128i n = _mm_packus_epi16(_mm256_castsi256_si128(four), _mm256_extracti128_si256(four, 1));
            v[0] = _mm_or_si128(v[0], _mm_slli_epi16(_mm_and_si128(n, _mm_set1_epi8(3)), 4));
            v[1] = _mm_or_si128(v[1], _mm_slli_epi16(_mm_and_si128(n, _mm_set1_epi8(12)), 2));
        }
        for (int c = 0; c < 2 && HAS_OFFSET; c++) v[c] = _mm_sub_epi8(v[c], offset);
    }
    for (int c = 0; c < 2; c++) {
        w[c][0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v[c]));
        w[c][1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v[c], 8)));
    }
}

static inline __attribute__((always_inline)) void expand_panel(
    const int BITS, const int HAS_OFFSET, const int GROUP, const int HAS_MIN, const int8_t *q, __m128i offset,
    const float *scale, const float *min, long K, float *P) {
    for (long kb = 0; kb < K / GROUP; kb++) {
        __m256 s0 = _mm256_loadu_ps(scale + kb * TILE), s1 = _mm256_loadu_ps(scale + kb * TILE + 8);
        __m256 m0 = _mm256_setzero_ps(), m1 = m0;
        if (HAS_MIN) m0 = _mm256_loadu_ps(min + kb * TILE), m1 = _mm256_loadu_ps(min + kb * TILE + 8);
        for (long k = kb * GROUP; k < (kb + 1) * GROUP; k += 2) {
            __m256 qc[2][2];
            load_columns(BITS, HAS_OFFSET, q, K, k, offset, qc);
            for (int c = 0; c < 2; c++) {
                __m256 w0 = _mm256_mul_ps(s0, qc[c][0]), w1 = _mm256_mul_ps(s1, qc[c][1]);
                if (HAS_MIN) w0 = _mm256_add_ps(w0, m0), w1 = _mm256_add_ps(w1, m1);
                _mm256_store_ps(P + (k + c) * TILE, w0);
                _mm256_store_ps(P + (k + c) * TILE + 8, w1);
            }
        }
    }
}

/* R rows of X (R <= 6, a constant after inlining) times one panel: 2R accumulators in registers. */
static inline __attribute__((always_inline)) void rows_times_panel(
    const int R, const float *X, long K, const float *P, float *Y, long ldy) {
    __m256 a0[6], a1[6];
    for (int i = 0; i < R; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (long k = 0; k < K; k++) {
        __m256 w0 = _mm256_load_ps(P + k * TILE), w1 = _mm256_load_ps(P + k * TILE + 8);
        for (int i = 0; i < R; i++) {
            __m256 x = _mm256_broadcast_ss(X + i * K + k);
            a0[i] = _mm256_fmadd_ps(x, w0, a0[i]);
            a1[i] = _mm256_fmadd_ps(x, w1, a1[i]);
        }
    }
    for (int i = 0; i < R; i++) {
        _mm256_storeu_ps(Y + i * ldy, a0[i]);
        _mm256_storeu_ps(Y + i * ldy + 8, a1[i]);
    }
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The sum of n floats (n a multiple of 8). */
static inline float sum_floats(const float *x, const int n) {
    __m256 acc = _mm256_loadu_ps(x);
    for (int j = 8; j < n; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + j));
    return sum8(acc);
}

/* R rows of X (R <= 4, a constant after inlining) times one tile, expanding each column of 16 q values in
 * registers as it goes: with so few rows, writing and rereading a panel costs more than the FMAs. Within a group
 * the weights share a scale and a min, so a row's share of the group is scale * sum(x q) + min * sum(x), as in
 * cpu_kernels_portable.c (the reason and its benchmark are there): two multiply-adds a group instead of a multiply
 * and an add for every weight. */
static inline __attribute__((always_inline)) void rows_times_tile(
    const int BITS, const int HAS_OFFSET, const int GROUP, const int HAS_MIN, const int R, const float *X, long K,
    const int8_t *q, __m128i offset, const float *scale, const float *min, float *Y, long ldy) {
    __m256 a0[4], a1[4];
    for (int i = 0; i < R; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (long kb = 0; kb < K / GROUP; kb++) {
        __m256 g0[4], g1[4]; /* each row's sum of x q over the group */
        for (int i = 0; i < R; i++) g0[i] = g1[i] = _mm256_setzero_ps();
        prefetch_group(q, kb, GROUP, BITS, PREFETCH_BYTES, 0);
        for (long k = kb * GROUP; k < (kb + 1) * GROUP; k += 2) {
            __m256 qc[2][2];
            load_columns(BITS, HAS_OFFSET, q, K, k, offset, qc);
            for (int c = 0; c < 2; c++)
                for (int i = 0; i < R; i++) {
                    const __m256 x = _mm256_broadcast_ss(X + i * K + k + c);
                    g0[i] = _mm256_fmadd_ps(x, qc[c][0], g0[i]);
                    g1[i] = _mm256_fmadd_ps(x, qc[c][1], g1[i]);
                }
        }
        const __m256 s0 = _mm256_loadu_ps(scale + kb * TILE), s1 = _mm256_loadu_ps(scale + kb * TILE + 8);
        for (int i = 0; i < R; i++) {
            a0[i] = _mm256_fmadd_ps(s0, g0[i], a0[i]);
            a1[i] = _mm256_fmadd_ps(s1, g1[i], a1[i]);
            if (HAS_MIN) {
                const __m256 xs = _mm256_set1_ps(sum_floats(X + i * K + kb * GROUP, GROUP));
                a0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(min + kb * TILE), xs, a0[i]);
                a1[i] = _mm256_fmadd_ps(_mm256_loadu_ps(min + kb * TILE + 8), xs, a1[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        _mm256_storeu_ps(Y + i * ldy, a0[i]);
        _mm256_storeu_ps(Y + i * ldy + 8, a1[i]);
    }
}

#include "cpu_qgemm.h" /* qgemm_tile over the loops above, every (bits, offset, group, min) instance, lp_qgemm */

/* exp for 8 floats (Cephes' expf: range reduction by ln 2, degree-5 polynomial), ~1-2 ulp.
 * Inputs are clamped to [-87.3, 88.3]: below, about 1e-38 rather than 0; above, about 2e38. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* 16-bit caches (the LP_KV_* types of cpu_kernels.h) are widened to fp32 as they are loaded; fp16 goes through
 * F16C, which every AVX2 CPU has. */

/* Cache values i .. i + 7 of p, as fp32. KV is a constant after inlining. */
static inline __attribute__((always_inline)) __m256 load_kv8(const int KV, const void *p, long i) {
    if (KV == LP_KV_F32) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (KV == LP_KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); /* bf16: an fp32's top half */
}

/* x into cache values i .. i + 7 of p, rounded to nearest even as torch's .to() rounds, so the cache holds what
 * the torch path writes: fp16 by F16C; bf16 by adding 0x7FFF plus the lowest kept bit, then dropping the low half
 * (a NaN is stored as the quiet NaN 0x7FC0: rounding would carry some NaNs into an infinity). */
static inline __attribute__((always_inline)) void store_kv8(const int KV, void *p, long i, __m256 x) {
    if (KV == LP_KV_F32) {
        _mm256_storeu_ps((float *)p + i, x);
        return;
    }
    __m128i h;
    if (KV == LP_KV_F16) {
        h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        const __m256i u = _mm256_castps_si256(x);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
        h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08)); /* 8 halves, in order */
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
}

/* How many query heads of a KV head one walk over its keys serves, each K and V row widened once for all of them:
 * three heads' accumulators (3 x 4 keys' dot products, or 3 x 4 vectors of V columns) and their operands fill
 * AVX2's 16 registers. Against one head a walk it is faster for one sequence and more so for a batch of them
 * (benchmarks/cpu_kernel_bench.py's paged_decode timings, avx2 column). */
#define HEADS_A_WALK 3

/* scores[g][j] (rows n apart) = scale * q_g . K row of key first + j, for GB heads (q_g at qh + g D): 4 keys at a
 * time, each K row widened once and multiplied into GB x 4 independent chains, each head's 4 sums reduced together. */
static inline __attribute__((always_inline)) void keys_times_heads(const int KV, const int GB, const float *qh,
                                                                   const void *k_cache, const int32_t *table,
                                                                   long first, long n, long kvh, long KVH, long D,
                                                                   float scale, float *scores) {
#define KROW(j) ((((long)table[(j) / 16] * 16 + (j) % 16) * KVH + kvh) * D) /* where token j's K starts */
    long j = 0;
    for (; j + 4 <= n; j += 4) {
        long k[4];
        __m256 acc[3][4];
        for (int t = 0; t < 4; t++) k[t] = KROW(first + j + t);
        for (int g = 0; g < GB; g++)
            for (int t = 0; t < 4; t++) acc[g][t] = _mm256_setzero_ps();
        for (long d = 0; d < D; d += 8) {
            __m256 qd[3];
            for (int g = 0; g < GB; g++) qd[g] = _mm256_loadu_ps(qh + g * D + d);
            for (int t = 0; t < 4; t++) {
                const __m256 key = load_kv8(KV, k_cache, k[t] + d);
                for (int g = 0; g < GB; g++) acc[g][t] = _mm256_fmadd_ps(qd[g], key, acc[g][t]);
            }
        }
        for (int g = 0; g < GB; g++) {
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
            const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)); /* keys 0-3 */
            _mm_storeu_ps(scores + g * n + j, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
    }
    for (; j < n; j++) {
        const long k = KROW(first + j);
        __m256 acc[3];
        for (int g = 0; g < GB; g++) acc[g] = _mm256_setzero_ps();
        for (long d = 0; d < D; d += 8) {
            const __m256 key = load_kv8(KV, k_cache, k + d);
            for (int g = 0; g < GB; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + d), key, acc[g]);
        }
        for (int g = 0; g < GB; g++) scores[g * n + j] = sum8(acc[g]) * scale;
    }
#undef KROW
}

/* o_g[0 : 8*VECS] (rows D apart) = inv[g] * sum over keys first .. first + n - 1 (first a multiple of 16) of p_g[t]
 * * V row t (p_g rows n apart), from column col of each row on, for GB heads: each V row widened once. VECS, GB and
 * KV are constants after inlining, so the accumulators stay in registers. Rows of a block are `stride` values apart. */
static inline __attribute__((always_inline)) void weighted_rows(const int KV, const int GB, const int VECS,
                                                                const float *p, long first, long n,
                                                                const int32_t *table, const void *v, long col,
                                                                long stride, const float *inv, long D, float *o) {
    __m256 a[3][8];
    for (int g = 0; g < GB; g++)
        for (int i = 0; i < VECS; i++) a[g][i] = _mm256_setzero_ps();
    for (long blk = 0; blk * 16 < n; blk++) {
        const long vb = (long)table[first / 16 + blk] * 16 * stride + col;
        const long count = n - blk * 16 < 16 ? n - blk * 16 : 16;
        for (long t = 0; t < count; t++) {
            __m256 w[3];
            for (int g = 0; g < GB; g++) w[g] = _mm256_set1_ps(p[g * n + blk * 16 + t]);
            for (int i = 0; i < VECS; i++) {
                const __m256 value = load_kv8(KV, v, vb + t * stride + 8 * i);
                for (int g = 0; g < GB; g++) a[g][i] = _mm256_fmadd_ps(w[g], value, a[g][i]);
            }
        }
    }
    for (int g = 0; g < GB; g++)
        for (int i = 0; i < VECS; i++) _mm256_storeu_ps(o + g * D + 8 * i, _mm256_mul_ps(a[g][i], _mm256_set1_ps(inv[g])));
}

/* Columns of V one walk takes for GB heads: 64 for one head, 32 for more (their accumulators must fit the 16
 * registers). */
#define COLUMNS_A_WALK(GB) ((GB) == 1 ? 64 : 32)

/* s[0 .. n - 1] (n >= 1) into exp(s - their max) in place; their max and the sum of the exps. */
static inline void exp_scores(float *s, long n, float mx, float *sum) {
    float total = 0.0f;
    long j = 0;
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    total = sum8(acc);
    if (j < n) {
        float tail[8] = {0};
        for (long t = j; t < n; t++) tail[t - j] = s[t] - mx;
        __m256 e = exp8(_mm256_loadu_ps(tail));
        _mm256_storeu_ps(tail, e);
        for (long t = j; t < n; t++) { s[t] = tail[t - j]; total += tail[t - j]; }
    }
    *sum = total;
}

/* The small per-layer steps of a decode batch, each one pass over a few KiB instead of several torch
 * ops (a torch op on a 16 x 576 tensor costs more in dispatch than in arithmetic): a row of each here, the
 * row loop in cpu_rows.h. */

/* sum = x + residual (x alone where residual is NULL); out = sum / sqrt(mean(sum^2) + eps) * weight. D % 8 == 0. */
static inline void add_rms_norm_row(const float *x, const float *residual, const float *weight, long D, float eps,
                                    float *sum, float *out) {
    __m256 sq = _mm256_setzero_ps();
    for (long d = 0; d < D; d += 8) {
        __m256 v = _mm256_loadu_ps(x + d);
        if (residual) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + d));
        _mm256_storeu_ps(sum + d, v);
        sq = _mm256_fmadd_ps(v, v, sq);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(sum8(sq) / (float)D + eps));
    for (long d = 0; d < D; d += 8)
        _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(sum + d), inv), _mm256_loadu_ps(weight + d)));
}

/* out = silu(gate) * up over a row of I (I % 8 == 0). */
static inline void silu_mul_row(const float *gate, const float *up, long I, float *out) {
    for (long i = 0; i < I; i += 8) {
        __m256 x = _mm256_loadu_ps(gate + i);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)); /* exp(-x); large -x saturates, silu -> 0 */
        __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
}

#include "cpu_rows.h" /* lp_add_rms_norm and lp_silu_mul over the rows above; lp_argmax_rows */

/* Token n of lp_rope_write_kv: its q and k heads rotated over their first R dimensions, q into q_out, k and v into
 * slot `slot` of the caches (none where slot is -1). KV is a constant after inlining. */
static inline __attribute__((always_inline)) void rope_write_row(
    const int KV, long n, long slot, const float *qkv, const float *cos, const float *sin, long H, long KVH, long D,
    long R, void *k_cache, void *v_cache, float *q_out) {
    const long half = R / 2, width = (H + 2 * KVH) * D;
    const float *row = qkv + n * width, *c = cos + n * half, *s = sin + n * half;
    for (long h = 0; h < H + KVH; h++) {
        if (h >= H && slot < 0) break;
        const float *x = row + h * D;
        for (long i = 0; i < half; i += 8) {
            __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
            __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
            __m256 lo = _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv));
            __m256 hi = _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv));
            if (h < H) {
                _mm256_storeu_ps(q_out + (n * H + h) * D + i, lo);
                _mm256_storeu_ps(q_out + (n * H + h) * D + half + i, hi);
            } else {
                const long k = (slot * KVH + h - H) * D;
                store_kv8(KV, k_cache, k + i, lo);
                store_kv8(KV, k_cache, k + half + i, hi);
            }
        }
        for (long i = R; i < D; i += 8) /* past the rotary dimensions: as they are */
            if (h < H)
                _mm256_storeu_ps(q_out + (n * H + h) * D + i, _mm256_loadu_ps(x + i));
            else
                store_kv8(KV, k_cache, (slot * KVH + h - H) * D + i, _mm256_loadu_ps(x + i));
    }
    if (slot >= 0)
        for (long i = 0; i < KVH * D; i += 8) store_kv8(KV, v_cache, slot * KVH * D + i, _mm256_loadu_ps(row + (H + KVH) * D + i));
}

/* The steps of a prefill tile (prefill_task in cpu_kv_dispatch.h says what each computes): scores and weights key by
 * key, ROW_LANES = 8 rows to a register, one block of 16 keys a step, the scores 4 keys at a time. */
#define ROW_LANES 8
#define PREFILL_KEYS 16
#define KEY_GROUP 4

/* 2^x for 8 floats, x clamped at -126, as exp2_16 in cpu_kernels_portable.c (Cephes' exp2f polynomial). */
static inline __m256 exp2_8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(x, n);
    __m256 y = _mm256_set1_ps(1.535336188319500e-4f);
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.339887440266574e-3f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(9.618437357674640e-3f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.550332471162809e-2f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.402264791363012e-1f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(6.931472028550421e-1f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline __attribute__((always_inline)) void widen_rows(const int KV, const void *cache, long row0, long stride,
                                                             long n, long D, long width, float *out) {
    for (long j = 0; j < n; j++) /* width == D: D is a multiple of ROW_LANES */
        for (long d = 0; d < D; d += 8)
            _mm256_storeu_ps(out + j * width + d, load_kv8(KV, cache, row0 + j * stride + d));
}

/* s[j][v0 * 8 ..] for the KEY_GROUP keys from k (rows k_stride apart) and VECS vectors of rows from v0 * 8 on: 12
 * accumulators, 3 vectors of q and a broadcast key value fill the 16 registers. (One vector of rows and 8 keys at a
 * time, as the portable file does, ran slower here.) */
static inline __attribute__((always_inline)) void keys_times_row_vectors(const int VECS, const float *k, long k_stride,
                                                                         const float *qt, long rows, long v0, long D,
                                                                         float *s) {
    __m256 a[KEY_GROUP][3];
    for (int j = 0; j < KEY_GROUP; j++)
        for (int c = 0; c < VECS; c++) a[j][c] = _mm256_setzero_ps();
    for (long d = 0; d < D; d++) {
        __m256 q[3];
        for (int c = 0; c < VECS; c++) q[c] = _mm256_loadu_ps(qt + d * rows + (v0 + c) * ROW_LANES);
        for (int j = 0; j < KEY_GROUP; j++) {
            const __m256 kd = _mm256_broadcast_ss(k + j * k_stride + d);
            for (int c = 0; c < VECS; c++) a[j][c] = _mm256_fmadd_ps(kd, q[c], a[j][c]);
        }
    }
    for (int j = 0; j < KEY_GROUP; j++)
        for (int c = 0; c < VECS; c++) _mm256_storeu_ps(s + j * rows + (v0 + c) * ROW_LANES, a[j][c]);
}

static inline __attribute__((always_inline)) void keys_times_rows(const float *const k[], long k_stride, long n,
                                                                  const float *qt, long rows, long D, float *s) {
    for (long j0 = 0; j0 < n; j0 += KEY_GROUP) {
        const float *kj = k[j0 / 16] + j0 % 16 * k_stride;
        float *sj = s + j0 * rows;
        long v0 = 0;
        for (; v0 + 3 <= rows / ROW_LANES; v0 += 3) keys_times_row_vectors(3, kj, k_stride, qt, rows, v0, D, sj);
        switch (rows / ROW_LANES - v0) {
            case 2: keys_times_row_vectors(2, kj, k_stride, qt, rows, v0, D, sj); break;
            case 1: keys_times_row_vectors(1, kj, k_stride, qt, rows, v0, D, sj); break;
        }
    }
}

/* All-ones in the lanes of the rows key j lies past (j > last: the row's position less the step's first key). */
static inline __m256 past(long j, __m256i last) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)j), last));
}

static inline __attribute__((always_inline)) void softmax_rows(float *s, long rows, const int32_t *pos, long k0,
                                                               float *m, float *l, float *alpha) {
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    for (long v = 0; v < rows; v += ROW_LANES) {
        const __m256i first_key = _mm256_set1_epi32((int)k0);
        const __m256i last = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(pos + v)), first_key);
        const int masked = k0 + PREFILL_KEYS - 1 > pos[v]; /* pos[v], the vector's first row, is its least */
        const __m256 old = _mm256_loadu_ps(m + v);
        __m256 top = old;
        for (long j = 0; j < PREFILL_KEYS; j++) {
            __m256 x = _mm256_loadu_ps(s + j * rows + v);
            if (masked) x = _mm256_blendv_ps(x, minus_inf, past(j, last));
            top = _mm256_max_ps(x, top);
        }
        const __m256 rescale = exp2_8(_mm256_sub_ps(old, top));
        __m256 total = _mm256_setzero_ps();
        for (long j = 0; j < PREFILL_KEYS; j++) {
            __m256 e = exp2_8(_mm256_sub_ps(_mm256_loadu_ps(s + j * rows + v), top));
            if (masked) e = _mm256_andnot_ps(past(j, last), e);
            _mm256_storeu_ps(s + j * rows + v, e);
            total = _mm256_add_ps(total, e);
        }
        _mm256_storeu_ps(m + v, top);
        _mm256_storeu_ps(alpha + v, rescale);
        _mm256_storeu_ps(l + v, _mm256_fmadd_ps(_mm256_loadu_ps(l + v), rescale, total));
    }
}

/* ROWS rows from r0 (<= 4) by VECS vectors of columns from d0 (<= 3): 12 accumulators, the VECS vectors of each V
 * row and a broadcast weight fill the 16 registers. Key j's V row is at v[j / 16] + j % 16 * v_stride. */
static inline __attribute__((always_inline)) void rows_times_values(const int ROWS, const int VECS, const float *p,
                                                                    long rows, long r0, const float *const v[],
                                                                    long v_stride, long n, long d0, long D,
                                                                    const float *alpha, float *acc) {
    __m256 a[4][3];
    for (int i = 0; i < ROWS; i++) {
        const __m256 rescale = _mm256_set1_ps(alpha[r0 + i]);
        for (int c = 0; c < VECS; c++) a[i][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + (r0 + i) * D + d0 + 8 * c), rescale);
    }
    for (long j = 0; j < n; j++) {
        const float *vj = v[j / 16] + j % 16 * v_stride + d0;
        __m256 x[3];
        for (int c = 0; c < VECS; c++) x[c] = _mm256_loadu_ps(vj + 8 * c);
        for (int i = 0; i < ROWS; i++) {
            const __m256 w = _mm256_broadcast_ss(p + j * rows + r0 + i);
            for (int c = 0; c < VECS; c++) a[i][c] = _mm256_fmadd_ps(w, x[c], a[i][c]);
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int c = 0; c < VECS; c++) _mm256_storeu_ps(acc + (r0 + i) * D + d0 + 8 * c, a[i][c]);
}

static inline __attribute__((always_inline)) void rows_times_value_columns(const int ROWS, const float *p, long rows,
                                                                           long r0, const float *const v[],
                                                                           long v_stride, long n, long D,
                                                                           const float *alpha, float *acc) {
    for (long d0 = 0; d0 < D; d0 += 24) switch ((D - d0 < 24 ? D - d0 : 24) / 8) {
            case 3: rows_times_values(ROWS, 3, p, rows, r0, v, v_stride, n, d0, D, alpha, acc); break;
            case 2: rows_times_values(ROWS, 2, p, rows, r0, v, v_stride, n, d0, D, alpha, acc); break;
            case 1: rows_times_values(ROWS, 1, p, rows, r0, v, v_stride, n, d0, D, alpha, acc); break;
        }
}

static inline __attribute__((always_inline)) void accumulate_values(const float *p, long rows, long R,
                                                                    const float *const v[], long v_stride, long n,
                                                                    long D, const float *alpha, float *acc) {
    long r = 0;
    for (; r + 4 <= R; r += 4) rows_times_value_columns(4, p, rows, r, v, v_stride, n, D, alpha, acc);
    switch (R - r) {
        case 3: rows_times_value_columns(3, p, rows, r, v, v_stride, n, D, alpha, acc); break;
        case 2: rows_times_value_columns(2, p, rows, r, v, v_stride, n, D, alpha, acc); break;
        case 1: rows_times_value_columns(1, p, rows, r, v, v_stride, n, D, alpha, acc); break;
    }
}

#include "cpu_kv_dispatch.h" /* lp_paged_decode, lp_paged_prefill and lp_rope_write_kv, over the steps above */
