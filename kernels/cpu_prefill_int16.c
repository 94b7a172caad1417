/* lp_paged_prefill_int16: lp_paged_prefill's chunk attention with its two products on 16-bit integers and bfloat16,
 * where the CPU has AVX-512 VNNI and BF16; elsewhere it is lp_paged_prefill itself. Built into every path's library,
 * compiled for those instruction sets alone and chosen at run time, as lp_qgemm_int16 is. Where the CPU has AMX-BF16
 * too, the same tiles run on AMX instead (cpu_cascade_amx.c's lp_amx_rows, float32's precision), faster still.
 *
 * Why: a long prompt's prefill is bound by attention's two products (they grow with the context, the rest of the
 * model's work a token does not), which the float32 kernel runs at about the CPU's FMA peak, 16 products an
 * instruction. vpdpwssd (int16 pairs into int32) and vdpbf16ps (bfloat16 pairs into float32) make 32.
 *   - Scores: each K row is rounded to int16 within +-K_LIMIT and each row of q (times scale and log2 e) within
 *     +-q_limit (Q_LIMIT, less for heads of over 128 values), each with its fp32 scale, so that a score is one exact
 *     integer dot product inside int32 times the two scales. The rounding is relative to a row's largest value:
 *     under 2^-13 for q and 2^-12 for K, where a float16 cache already rounds every K value to 11 bits.
 *   - Softmax in fp32, as the float32 kernel has it; each row's sum of weights is of the fp32 weights.
 *   - Weighted sum of V: the weights and V rounded to bfloat16 (8 bits, relative to each value itself, so that the
 *     many small weights of a long context keep their share), products and sums in fp32.
 * Each call first rounds every sequence's context, K rows to int16 and V rows to bfloat16 pairs (round_context);
 * then tiles of TILE_POSITIONS positions (all G query heads of a KV head) walk it STEP_KEYS keys a step.
 *
 * benchmarks/cpu_kernel_bench.py times it against the float32 kernel on the default model's heads (a 512-token
 * chunk after 3,584 cached tokens, float16 KV). Tiles of 64 positions: with fewer, a step's rounding is shared by
 * fewer rows; with more, a tile's scores and sums leave L1.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_activations.h"
#include "cpu_cascade.h"
#include "cpu_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define VNNI_BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,avx512bf16")))

#define TILE_POSITIONS 64
#define STEP_KEYS 32   /* two blocks */
#define KEY_GROUP 8    /* scores: keys a pass */
#define VALUE_ROWS 6   /* weighted sum: rows a pass, by up to 4 vectors of columns */
#define Q_LIMIT 8191 /* 128 x 8191 x 2047 < 2^31: heads of up to 128 values take it whole */
#define K_LIMIT 2047.0f

static int has_vnni_bf16(void) { return lp_has_vnni() && __builtin_cpu_supports("avx512bf16"); }

/* 16 values of a cache row as fp32. */
static inline __attribute__((always_inline)) VNNI_BF16 __m512 load_kv16(const int KV, const void *cache, long i) {
    if (KV == LP_KV_F32) return _mm512_loadu_ps((const float *)cache + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + i));
    if (KV == LP_KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 2^x for 16 floats, x clamped at -126 as the float32 kernel's exp2 is: a degree-3 polynomial on x less its nearest
 * integer n (fitted for relative error, at most 7.5e-5: the weights are rounded to bfloat16, 2^-9, next), times 2^n. */
static inline __attribute__((always_inline)) VNNI_BF16 __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(x, n);
    __m512 y = _mm512_set1_ps(0.0551759850778886f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.24261157895101235f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6932602010131848f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.9999280183072933f));
    return _mm512_scalef_ps(y, n);
}

/* a's 16 values in the low halves of 16 pairs and b's in the high halves, both rounded to bfloat16. */
static inline __attribute__((always_inline)) VNNI_BF16 __m512i bf16_pairs(__m512 a, __m512 b) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* Where key `key`'s row of this KV head starts in a cache (rows of a block `stride` values apart). */
static inline long key_row(const int32_t *table, long key, long stride, long kv_offset) {
    return (long)table[key / 16] * 16 * stride + key % 16 * stride + kv_offset;
}

/* One step's keys, rounded: kq [STEP_KEYS][D] int16 and kscale, and V as bfloat16 pairs of keys, vp [STEP_KEYS / 2][D]
 * (pair j2, column d: key 2 j2's value low, 2 j2 + 1's high). Keys n .. STEP_KEYS - 1 are zeros. */
static inline __attribute__((always_inline)) VNNI_BF16 void round_step(const int KV, const void *k_cache,
                                                                     const void *v_cache, const int32_t *table,
                                                                     long k0, long n, long stride, long kv_offset,
                                                                     long D, int16_t *kq, float *kscale, int32_t *vp) {
    for (long j = 0; j < STEP_KEYS; j++) {
        int16_t *out = kq + j * D;
        if (j >= n) {
            memset(out, 0, D * sizeof(int16_t));
            kscale[j] = 0.0f;
            continue;
        }
        const long row = key_row(table, k0 + j, stride, kv_offset);
        __m512 amax = _mm512_setzero_ps();
        for (long d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_kv16(KV, k_cache, row + d)));
        const float top = _mm512_reduce_max_ps(amax);
        const __m512 inv = _mm512_set1_ps(top > 0.0f ? K_LIMIT / top : 0.0f);
        for (long d = 0; d < D; d += 16) {
            const __m512i k = _mm512_cvtps_epi32(_mm512_mul_ps(load_kv16(KV, k_cache, row + d), inv));
            _mm256_storeu_si256((__m256i *)(out + d), _mm512_cvtsepi32_epi16(k));
        }
        kscale[j] = top / K_LIMIT;
    }
    for (long j = 0; j < STEP_KEYS; j += 2) { /* keys j and j + 1 lie in one block */
        const long row = j < n ? key_row(table, k0 + j, stride, kv_offset) : 0;
        for (long d = 0; d < D; d += 16) {
            const __m512 a = j < n ? load_kv16(KV, v_cache, row + d) : _mm512_setzero_ps();
            const __m512 b = j + 1 < n ? load_kv16(KV, v_cache, row + stride + d) : _mm512_setzero_ps();
            _mm512_storeu_si512(vp + j / 2 * D + d, bf16_pairs(a, b));
        }
    }
}

/* s[j][r] for the step's keys (KEY_GROUP at a time, as far as n reaches) and every row, as fp32 log2 units. */
static inline __attribute__((always_inline)) VNNI_BF16 void step_scores(const int32_t *qt, const float *qscale,
                                                                      long rows, const int16_t *kq,
                                                                      const float *kscale, long n, long D, float *s) {
    for (long j0 = 0; j0 < n; j0 += KEY_GROUP)
        for (long r0 = 0; r0 < rows; r0 += 16) {
            __m512i a[KEY_GROUP];
            for (int j = 0; j < KEY_GROUP; j++) a[j] = _mm512_setzero_si512();
            for (long p = 0; p < D / 2; p++) {
                const __m512i q = _mm512_loadu_si512(qt + p * rows + r0);
                for (int j = 0; j < KEY_GROUP; j++) a[j] = add_pair_products(a[j], q, kq + (j0 + j) * D + 2 * p);
            }
            const __m512 qs = _mm512_loadu_ps(qscale + r0);
            for (int j = 0; j < KEY_GROUP; j++) {
                const __m512 scales = _mm512_mul_ps(qs, _mm512_set1_ps(kscale[j0 + j]));
                _mm512_storeu_ps(s + (j0 + j) * rows + r0, _mm512_mul_ps(_mm512_cvtepi32_ps(a[j]), scales));
            }
        }
}

/* The lanes of the rows that key j of the step lies past (j > last: a row's position less the step's first key). */
static inline __attribute__((always_inline)) VNNI_BF16 __mmask16 past(long j, __m512i last) {
    return _mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int)j), last);
}

/* The step's scores into weights (0 past a row's position), each row's running max m and sum l updated and alpha,
 * its rescaling; the weights as bfloat16 pairs of keys, pp [STEP_KEYS / 2][rows]. */
static inline __attribute__((always_inline)) VNNI_BF16 void step_softmax(const float *s, long rows, const int32_t *pos,
                                                                       long k0, float *m, float *l, float *alpha,
                                                                       int32_t *pp) {
    for (long v = 0; v < rows; v += 16) {
        const __m512i last = _mm512_sub_epi32(_mm512_loadu_si512(pos + v), _mm512_set1_epi32((int)k0));
        const int masked = k0 + STEP_KEYS - 1 > pos[v]; /* pos[v], the vector's first row, is its least */
        const __m512 old = _mm512_loadu_ps(m + v);
        __m512 top = old;
        for (long j = 0; j < STEP_KEYS; j++) {
            const __m512 x = _mm512_loadu_ps(s + j * rows + v);
            top = masked ? _mm512_mask_max_ps(top, ~past(j, last), x, top) : _mm512_max_ps(x, top);
        }
        const __m512 rescale = exp2_16(_mm512_sub_ps(old, top));
        __m512 total = _mm512_setzero_ps();
        for (long j = 0; j < STEP_KEYS; j += 2) {
            __m512 e0 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + j * rows + v), top));
            __m512 e1 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + (j + 1) * rows + v), top));
            if (masked) {
                e0 = _mm512_maskz_mov_ps(~past(j, last), e0);
                e1 = _mm512_maskz_mov_ps(~past(j + 1, last), e1);
            }
            total = _mm512_add_ps(total, _mm512_add_ps(e0, e1));
            _mm512_storeu_si512(pp + j / 2 * rows + v, bf16_pairs(e0, e1));
        }
        _mm512_storeu_ps(m + v, top);
        _mm512_storeu_ps(alpha + v, rescale);
        _mm512_storeu_ps(l + v, _mm512_fmadd_ps(_mm512_loadu_ps(l + v), rescale, total));
    }
}

/* acc[r] = alpha[r] acc[r] + sum over the step's key pairs of weights times V, ROWS rows from r0 by VECS vectors of
 * columns from d0. */
static inline __attribute__((always_inline)) VNNI_BF16 void step_values(const int ROWS, const int VECS,
                                                                      const int32_t *pp, long rows, long r0,
                                                                      const int32_t *vp, long pairs, long d0, long D,
                                                                      const float *alpha, float *acc) {
    __m512 a[VALUE_ROWS][4];
    for (int i = 0; i < ROWS; i++)
        for (int c = 0; c < VECS; c++)
            a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + i) * D + d0 + 16 * c), _mm512_set1_ps(alpha[r0 + i]));
    for (long j2 = 0; j2 < pairs; j2++) {
        __m512bh x[4];
        for (int c = 0; c < VECS; c++) x[c] = (__m512bh)_mm512_loadu_si512(vp + j2 * D + d0 + 16 * c);
        for (int i = 0; i < ROWS; i++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32(pp[j2 * rows + r0 + i]);
            for (int c = 0; c < VECS; c++) a[i][c] = _mm512_dpbf16_ps(a[i][c], w, x[c]);
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int c = 0; c < VECS; c++) _mm512_storeu_ps(acc + (r0 + i) * D + d0 + 16 * c, a[i][c]);
}

static inline __attribute__((always_inline)) VNNI_BF16 void step_value_columns(const int ROWS, const int32_t *pp,
                                                                             long rows, long r0, const int32_t *vp,
                                                                             long pairs, long D, const float *alpha,
                                                                             float *acc) {
    for (long d0 = 0; d0 < D; d0 += 64) switch ((D - d0 < 64 ? D - d0 : 64) / 16) {
            case 4: step_values(ROWS, 4, pp, rows, r0, vp, pairs, d0, D, alpha, acc); break;
            case 3: step_values(ROWS, 3, pp, rows, r0, vp, pairs, d0, D, alpha, acc); break;
            case 2: step_values(ROWS, 2, pp, rows, r0, vp, pairs, d0, D, alpha, acc); break;
            case 1: step_values(ROWS, 1, pp, rows, r0, vp, pairs, d0, D, alpha, acc); break;
        }
}

/* Every sequence's context rounded once a call, as round_step has it: each range of keys begin[e] .. end[e] - 1 of a
 * block table (entry e < B: sequence b's keys, after its cascade group's shared ones where it has one; entry B + g:
 * group g's shared keys, rounded once for all its members) is rows first_key[e] + kvh * padded(e) + (key - begin[e])
 * of kq [][D], kscale [] and, by pairs of keys, vp [][D]; each range padded to whole steps. Each tile reads them:
 * rounding a step for each tile instead rounds every key once per tile, a sizeable share of a long chunk's time. */
typedef struct {
    long entries;
    long *first_key, *begin, *end;
    const int32_t **table;
    int16_t *kq;
    float *kscale;
    int32_t *vp;
} RoundedContext;

static inline long padded_range(const RoundedContext *rc, long e) {
    return (rc->end[e] - rc->begin[e] + STEP_KEYS - 1) / STEP_KEYS * STEP_KEYS;
}

static void free_rounded(RoundedContext *rc) {
    free(rc->first_key), free(rc->begin), free(rc->end), free((void *)rc->table), free(rc->kq), free(rc->kscale);
    free(rc->vp);
}

/* The ranges of keys a call reads (a sequence without rows: none), checked; w NULL without a cascade plan. */
static int context_ranges(const int32_t *block_tables, const int32_t *cu_seqlens_q, const int32_t *context_lens,
                          long num_q, long B, long KVH, long max_blocks, long num_blocks, const Cascade *w,
                          const lp_cascade *c, RoundedContext *rc) {
    const long entries = B + (w ? w->groups : 0);
    *rc = (RoundedContext){entries, malloc((entries + 1) * sizeof(long)), malloc((entries + 1) * sizeof(long)),
                           malloc((entries + 1) * sizeof(long)), malloc((entries + 1) * sizeof(int32_t *)),
                           NULL, NULL, NULL};
    if (!rc->first_key || !rc->begin || !rc->end || !rc->table) return LP_OUT_OF_MEMORY;
    for (long b = 0; b < B; b++) {
        if (!chunk_fits(cu_seqlens_q, context_lens, b, num_q)) return LP_BAD_INDEX;
        const int rows = cu_seqlens_q[b + 1] > cu_seqlens_q[b]; /* no rows: nothing reads its keys */
        rc->table[b] = block_tables + b * max_blocks;
        if (rows && !context_fits(rc->table[b], context_lens[b], max_blocks, num_blocks)) return LP_BAD_INDEX;
        rc->begin[b] = rows && w ? w->shared[b] : 0, rc->end[b] = rows ? context_lens[b] : 0;
    }
    for (long g = 0; w && g < w->groups; g++)
        rc->table[B + g] = w->table[g], rc->begin[B + g] = 0, rc->end[B + g] = c->shared_lens[g];
    rc->first_key[0] = 0;
    for (long e = 0; e < entries; e++) rc->first_key[e + 1] = rc->first_key[e] + KVH * padded_range(rc, e);
    return LP_OK;
}

static inline __attribute__((always_inline)) VNNI_BF16 int round_context(const int KV, const void *k_cache,
                                                                       const void *v_cache, long KVH, long D,
                                                                       RoundedContext *rc) {
    const long keys = rc->first_key[rc->entries];
    rc->kq = aligned_alloc(64, (keys * D * sizeof(int16_t) + 63) / 64 * 64 + 64);
    rc->kscale = malloc(keys * sizeof(float) + 64);
    rc->vp = aligned_alloc(64, (keys / 2 * D * sizeof(int32_t) + 63) / 64 * 64 + 64);
    if (!rc->kq || !rc->kscale || !rc->vp) return LP_OUT_OF_MEMORY;
#pragma omp parallel for schedule(static)
    for (long step = 0; step < keys / STEP_KEYS; step++) {
        const long key = step * STEP_KEYS;
        long e = 0, hi = rc->entries; /* the range whose keys hold `key`: the last e with first_key[e] <= key */
        while (hi - e > 1) {
            const long mid = (e + hi) / 2;
            if (rc->first_key[mid] <= key) e = mid;
            else hi = mid;
        }
        const long padded = padded_range(rc, e), at = key - rc->first_key[e];
        const long kvh = at / padded, k0 = rc->begin[e] + at % padded, left = rc->end[e] - k0;
        const long n = left < STEP_KEYS ? left : STEP_KEYS;
        round_step(KV, k_cache, v_cache, rc->table[e], k0, n, KVH * D, kvh * D, D, rc->kq + key * D, rc->kscale + key,
                   rc->vp + key / 2 * D);
    }
    return LP_OK;
}

static __thread char *scratch = NULL; /* per OpenMP thread */
static __thread long scratch_bytes = 0;

/* rows_task of cpu_kv_dispatch.h on the rounded keys of range e: n_tok (<= max_tok) tokens tok[i] at positions
 * tpos[i], KV head kvh, keys k_begin .. k_end - 1 of the range (k_begin - begin[e] a multiple of STEP_KEYS); normalised
 * into dst's rows tok[i] where stats is NULL, else unnormalised into rows dst_first + i with their stats. */
static inline __attribute__((always_inline)) VNNI_BF16 int rows_task16(const float *q, const int32_t *tok,
                                                                     const int32_t *tpos, long n_tok, long max_tok,
                                                                     long kvh, const RoundedContext *rc, long e,
                                                                     long k_begin, long k_end, long H, long KVH,
                                                                     long D, float scale, float *dst, long dst_first,
                                                                     float *stats) {
    const long G = H / KVH, R = G * n_tok;
    const long rows = (R + 15) / 16 * 16, most = (G * max_tok + 15) / 16 * 16;
    /* qt [D / 2][most] pairs, s [STEP_KEYS][most], pp [STEP_KEYS / 2][most], acc [most][D], qscale, m, l, alpha, pos
     * [most]: 4-byte units */
    const long units = most * (D / 2 + STEP_KEYS + STEP_KEYS / 2 + D + 5);
    if (scratch_bytes < units * 4) {
        free(scratch);
        scratch = aligned_alloc(64, (units * 4 + 63) / 64 * 64);
        scratch_bytes = scratch ? units * 4 : 0;
        if (!scratch) return LP_OUT_OF_MEMORY;
    }
    int32_t *qt = (int32_t *)scratch, *pp = qt + D / 2 * most + STEP_KEYS * most;
    float *s = (float *)(qt + D / 2 * most), *acc = (float *)(pp + STEP_KEYS / 2 * most), *qscale = acc + most * D;
    float *m = qscale + most, *l = m + most, *alpha = l + most;
    int32_t *pos = (int32_t *)(alpha + most);
    const long first_key = rc->first_key[e] + kvh * padded_range(rc, e) - rc->begin[e];
    const float scale_log2 = scale * 1.44269504088896341f;
    const long most_q = 2147483647L / (D * (long)K_LIMIT); /* D products of q_limit x K_LIMIT fit int32 */
    const float q_limit = (float)(most_q < Q_LIMIT ? most_q : Q_LIMIT);
    for (long r = 0; r < rows; r++) {
        const long row = r < R ? r : R - 1;
        m[r] = -INFINITY, l[r] = 0.0f, pos[r] = tpos[row / G];
        const float *qr = q + ((long)tok[row / G] * H + kvh * G + row % G) * D;
        float top = 0.0f;
        for (long d = 0; d < D; d++) top = fmaxf(top, fabsf(qr[d] * scale_log2));
        const float inv = r < R && top > 0.0f ? q_limit / top : 0.0f;
        for (long p = 0; p < D / 2; p++) {
            const int32_t lo = (int32_t)nearbyintf(qr[2 * p] * scale_log2 * inv);
            const int32_t hi = (int32_t)nearbyintf(qr[2 * p + 1] * scale_log2 * inv);
            qt[p * rows + r] = (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)(uint16_t)hi << 16);
        }
        qscale[r] = top / q_limit;
    }
    memset(acc, 0, R * D * sizeof(float));
    for (long k0 = k_begin; k0 < k_end; k0 += STEP_KEYS) {
        const long n = k_end - k0 < STEP_KEYS ? k_end - k0 : STEP_KEYS, key = first_key + k0;
        step_scores(qt, qscale, rows, rc->kq + key * D, rc->kscale + key, n, D, s);
        step_softmax(s, rows, pos, k0, m, l, alpha, pp);
        const long pairs = (n + 1) / 2;
        const int32_t *vp = rc->vp + key / 2 * D;
        long r = 0;
        for (; r + VALUE_ROWS <= R; r += VALUE_ROWS)
            step_value_columns(VALUE_ROWS, pp, rows, r, vp, pairs, D, alpha, acc);
        for (; r < R; r++) step_value_columns(1, pp, rows, r, vp, pairs, D, alpha, acc);
    }
    store_tile(R, G, kvh, H, D, acc, D, m, l, tok, dst, dst_first, stats);
    return LP_OK;
}

/* Tile `tile` of sequence b's chunk (its own keys where it is in a cascade group, into own/own_stats): on its rounded
 * keys, or where `amx` on AMX tiles straight from the caches (cpu_amx.h), which need no rounding. */
static inline __attribute__((always_inline)) VNNI_BF16 int prefill_task16(
    int amx, int kv_dtype, const void *k_cache, const void *v_cache, long b, long kvh, long tile, const float *q,
    const RoundedContext *rc, const int32_t *cu_seqlens_q, const int32_t *context_lens, long H, long KVH, long D,
    float scale, float *out, const Cascade *w, float *own, float *own_stats) {
    const long q_start = cu_seqlens_q[b], q_len = cu_seqlens_q[b + 1] - q_start, ctx = context_lens[b];
    const long i0 = tile * TILE_POSITIONS;
    if (i0 >= q_len) return LP_OK;
    const long positions = q_len - i0 < TILE_POSITIONS ? q_len - i0 : TILE_POSITIONS;
    const long first_pos = ctx - q_len + i0;
    int32_t tok[TILE_POSITIONS], tpos[TILE_POSITIONS];
    for (long i = 0; i < positions; i++) tok[i] = (int32_t)(q_start + i0 + i), tpos[i] = (int32_t)(first_pos + i);
    const int member = w && w->shared[b];
    if (amx)
        return lp_amx_rows(kv_dtype, q, tok, tpos, positions, kvh, k_cache, v_cache, rc->table[b], rc->begin[b],
                           first_pos + positions, H, KVH, D, scale, member ? own : out, q_start + i0,
                           member ? own_stats : NULL);
    return rows_task16(q, tok, tpos, positions, TILE_POSITIONS, kvh, rc, b, rc->begin[b], first_pos + positions, H,
                       KVH, D, scale, member ? own : out, q_start + i0, member ? own_stats : NULL);
}

/* Shared-pass task t of a cascade plan on group g's rounded shared keys (entry B + g), as cpu_kv_dispatch.h's
 * shared_task. */
static inline __attribute__((always_inline)) VNNI_BF16 int shared_task16(long t, long B, const Cascade *w,
                                                                       const lp_cascade *c, const float *q,
                                                                       const RoundedContext *rc, long H, long KVH,
                                                                       long D, float scale, float *spart,
                                                                       float *sstats) {
    SharedTile st;
    shared_tile(w, c, t, KVH, &st);
    return rows_task16(q, st.tok, st.tpos, st.n, CASCADE_TOKENS, st.kvh, rc, B + st.g, st.k0, st.k1, H, KVH, D, scale,
                       spart, st.first, sstats);
}

static VNNI_BF16 int prefill_int16(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                                   const int32_t *block_tables, const int32_t *cu_seqlens_q,
                                   const int32_t *context_lens, long num_q, long B, long H, long KVH, long D,
                                   long max_blocks, long num_blocks, float scale, const lp_cascade *cascade,
                                   float *out) {
    Cascade w = {0};
    const int cas = cascade && cascade->num_groups > 0;
    if (cas) {
        const int st = cascade_plan(cascade, block_tables, cu_seqlens_q, context_lens, num_q, B, KVH, max_blocks,
                                    num_blocks, omp_get_max_threads(), &w);
        if (st != LP_OK) return st;
    }
    /* Where AMX tiles run, every tile runs on them (about float32, and the rest needs no rounding): a row's result
     * then hangs neither on how its prompt was chunked nor on its cascade group, as it would with the int16 tile
     * on some keys and the AMX one on others. */
    const int amx = lp_amx_runs(kv_dtype, D);
    RoundedContext rc;
    int status = context_ranges(block_tables, cu_seqlens_q, context_lens, num_q, B, KVH, max_blocks, num_blocks,
                                cas ? &w : NULL, cascade, &rc);
    if (status == LP_OK && !amx) {
        if (kv_dtype == LP_KV_BF16) status = round_context(LP_KV_BF16, k_cache, v_cache, KVH, D, &rc);
        else if (kv_dtype == LP_KV_F16) status = round_context(LP_KV_F16, k_cache, v_cache, KVH, D, &rc);
        else status = round_context(LP_KV_F32, k_cache, v_cache, KVH, D, &rc);
    }
    float *own = NULL, *spart = NULL;
    if (status == LP_OK && cas) {
        own = malloc(num_q * H * (D + 2) * sizeof(float) + 1);
        spart = malloc(w.parts * H * (D + 2) * sizeof(float) + 1);
        if (!own || !spart) status = LP_OUT_OF_MEMORY;
    }
    if (status != LP_OK) {
        free_rounded(&rc), free(own), free(spart);
        if (cas) cascade_free(&w);
        return status;
    }
    float *own_stats = own ? own + num_q * H * D : NULL, *sstats = spart ? spart + w.parts * H * D : NULL;
    const long tiles = most_tiles(cu_seqlens_q, context_lens, B, num_q, TILE_POSITIONS);
    const long shared_tasks = cas ? w.tasks * KVH : 0;
#pragma omp parallel for schedule(dynamic)
    for (long task = 0; task < shared_tasks + tiles * B * KVH; task++) {
        int st;
        if (task < shared_tasks && amx) {
            st = shared_task_amx(kv_dtype, task, &w, cascade, q, k_cache, v_cache, H, KVH, D, scale, spart, sstats);
        } else if (task < shared_tasks) {
            st = shared_task16(task, B, &w, cascade, q, &rc, H, KVH, D, scale, spart, sstats);
        } else {
            const long t = task - shared_tasks, tile = tiles - 1 - t / (B * KVH), b = t / KVH % B, kvh = t % KVH;
            st = prefill_task16(amx, kv_dtype, k_cache, v_cache, b, kvh, tile, q, &rc, cu_seqlens_q, context_lens, H,
                                KVH, D, scale, out, cas ? &w : NULL, own, own_stats);
        }
        if (st != LP_OK) {
#pragma omp atomic write
            status = st;
        }
    }
    if (cas && status == LP_OK)
        cascade_merge_rows(&w, cascade, cu_seqlens_q, B, own, own_stats, spart, sstats, H, D, out);
    free_rounded(&rc), free(own), free(spart);
    if (cas) cascade_free(&w);
    return status;
}
#endif

/* lp_paged_prefill's arguments and contract; its own kernel where the CPU lacks VNNI or BF16, or D is not a multiple
 * of 16; on AMX tiles, in about float32, where lp_amx_runs (a CPU with AMX-BF16, a 16-bit cache, D a
 * multiple of 32): faster still, and its rows' results do not hang on their chunks or groups. */
int lp_paged_prefill_int16(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                           const int32_t *block_tables, const int32_t *cu_seqlens_q, const int32_t *context_lens,
                           int64_t num_q, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                           int64_t num_blocks, float scale, const lp_cascade *cascade, float *out) {
#if defined(__x86_64__)
    if (has_vnni_bf16() && B >= 0 && num_q >= 0 && KVH > 0 && H % KVH == 0 && D > 0 && D % 16 == 0 &&
        kv_dtype >= LP_KV_F32 && kv_dtype <= LP_KV_F16) {
        if (cu_seqlens_q[0] != 0 || cu_seqlens_q[B] != num_q) return LP_BAD_INDEX;
        return prefill_int16(q, k_cache, v_cache, kv_dtype, block_tables, cu_seqlens_q, context_lens, num_q, B, H,
                             KVH, D, max_blocks, num_blocks, scale, cascade, out);
    }
#endif
    return lp_paged_prefill(q, k_cache, v_cache, kv_dtype, block_tables, cu_seqlens_q, context_lens, num_q, B, H, KVH,
                            D, max_blocks, num_blocks, scale, cascade, out);
}
