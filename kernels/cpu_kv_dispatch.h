/* lp_paged_decode, lp_paged_prefill and lp_rope_write_kv, the same for every path: cpu_kernels_avx2.c and
 * cpu_kernels_portable.c each define the steps below, each inlined for KV a constant LP_KV_* type, then include this
 * file once:
 *   HEADS_A_WALK: how many query heads of a KV head one walk over its keys serves (each K and V row widened once);
 *   keys_times_heads(KV, GB, qh, k_cache, table, first, n, kvh, KVH, D, scale, scores): scores[g][j] (rows n apart)
 *     = scale * q_g . K row of key first + j for GB <= HEADS_A_WALK heads, q_g at qh + g D;
 *   exp_scores(s, n, max, &sum): s[0 .. n - 1] into exp(s - max) in place (max: scores_max's), the exps' sum;
 *   weighted_rows(KV, GB, VECS, p, first, n, table, v_cache, col, stride, inv, D, o): o_g[0 : 8 VECS] (rows D
 *     apart) = inv[g] * sum over keys first .. first + n - 1 of p_g[t] * V row t (p_g rows n apart), from column col
 *     of each row on, VECS <= 8, and COLUMNS_A_WALK(GB), how many columns one such walk may take for GB heads;
 *   rope_write_row(KV, n, slot, qkv, cos, sin, H, KVH, D, R, k_cache, v_cache, q_out), one token's;
 *   the steps of a prefill tile (see prefill_task below). */

#include <omp.h>

#include "cpu_cascade.h"

/* How a decode call's work is cut into tasks: each sequence's context into parts (combined after), and a part's KV
 * heads into runs, a task each. A task asks for its heads' slice of each of its keys' rows (prefetch_rows): with
 * every KV head, whole blocks in address order, where one task per KV head (as this was) asked for 256 bytes of
 * every 2 KiB and its step's attention took longer. Parts: enough for four tasks a thread, of at least 64 keys and
 * at most DECODE_SPAN, and no more keys than DECODE_PREFETCH bytes of K and V rows of every KV head hold: a task
 * asks for all its rows before it reads them, and rows past what the core's L2 keeps are evicted before they are
 * read (a 512-key part of 8 KV heads of 128 16-bit values is 2 MiB). Where parts are fewer than two a thread, the
 * heads are split into runs so that every thread has work. A context of one part is computed as it always was. */
#define DECODE_SPAN 512
#define DECODE_PREFETCH (256 * 1024) /* half the smallest L2 of the x86-64 cores we run on (512 KiB, Zen 2 and 3) */

/* Keys a part of a context of ctx keys, B sequences a call: key_bytes are one key's K and V rows of every KV head. */
static inline long decode_span(long ctx, long B, long threads, long key_bytes) {
    const long wanted = (4 * threads + B - 1) / B; /* parts a sequence for 4 tasks a thread */
    const long fits = DECODE_PREFETCH / key_bytes, most = fits < DECODE_SPAN ? fits / 16 * 16 : DECODE_SPAN;
    long span = (ctx + wanted - 1) / wanted;
    span = (span + 15) / 16 * 16; /* whole blocks: weighted_rows walks a part's blocks from its first */
    span = span > most ? most : span;
    return span < 64 ? 64 : span;
}

static inline long decode_parts(long ctx, long span) { return ctx > span ? (ctx + span - 1) / span : 1; }

/* KV heads a task takes: all of them where there are parts enough for two tasks a thread */
static inline long decode_heads(long parts, long KVH, long threads) {
    if (parts >= 2 * threads) return KVH;
    const long runs = (2 * threads + parts - 1) / parts;
    return (KVH + runs - 1) / runs;
}

/* weighted_rows for GB heads (a constant) over the next columns, width of them left, as many as one walk takes (its
 * VECS picked so). The columns the walk took. */
static inline __attribute__((always_inline)) long weighted_rows_walk(const int KV, const int GB, long width,
                                                                     const float *p, long first, long n,
                                                                     const int32_t *table, const void *v, long col,
                                                                     long stride, const float *inv, long D, float *o) {
    const long taken = width < COLUMNS_A_WALK(GB) ? width : COLUMNS_A_WALK(GB);
    switch (taken / 8) {
        case 8: weighted_rows(KV, GB, 8, p, first, n, table, v, col, stride, inv, D, o); break;
        case 7: weighted_rows(KV, GB, 7, p, first, n, table, v, col, stride, inv, D, o); break;
        case 6: weighted_rows(KV, GB, 6, p, first, n, table, v, col, stride, inv, D, o); break;
        case 5: weighted_rows(KV, GB, 5, p, first, n, table, v, col, stride, inv, D, o); break;
        case 4: weighted_rows(KV, GB, 4, p, first, n, table, v, col, stride, inv, D, o); break;
        case 3: weighted_rows(KV, GB, 3, p, first, n, table, v, col, stride, inv, D, o); break;
        case 2: weighted_rows(KV, GB, 2, p, first, n, table, v, col, stride, inv, D, o); break;
        case 1: weighted_rows(KV, GB, 1, p, first, n, table, v, col, stride, inv, D, o); break;
    }
    return taken;
}

/* The largest of s[0 .. n - 1] (n >= 1), as one walk `mx = s[j] > mx ? s[j] : mx` from s[0] gives it (a NaN only
 * where s[0] is one), in 8 independent chains: one chain of compares waits out each compare's latency. */
static inline float scores_max(const float *s, long n) {
    float m[8];
    for (int c = 0; c < 8; c++) m[c] = s[0];
    long j = 1;
    for (; j + 8 <= n; j += 8)
        for (int c = 0; c < 8; c++) m[c] = s[j + c] > m[c] ? s[j + c] : m[c];
    for (; j < n; j++) m[0] = s[j] > m[0] ? s[j] : m[0];
    float mx = m[0];
    for (int c = 1; c < 8; c++) mx = m[c] > mx ? m[c] : mx;
    return mx;
}

static __thread float *scores = NULL; /* [G, keys] per OpenMP thread */
static __thread long scores_floats = 0;

/* Sequence b's G = H / KVH query heads of KV head kvh over its keys first .. end - 1, through its block table row
 * (checked by decode_part), into o_rows [G][D]: normalised where stats is NULL, else unnormalised with each head's
 * max score and sum of weights in stats [G][2]. LP_OK, or LP_OUT_OF_MEMORY with nothing written. The heads go
 * HEADS_A_WALK at a time through the keys, for the scores and again for the values. */
static inline __attribute__((always_inline)) int decode_task(const int KV, long b, long kvh, long first, long end,
                                                             const float *q, const void *k_cache, const void *v_cache,
                                                             const int32_t *table, long H, long KVH, long D,
                                                             float scale, float *o_rows, float *stats) {
    const long G = H / KVH, n = end - first;
    if (scores_floats < G * n) {
        free(scores);
        scores = malloc(G * n * sizeof(float));
        scores_floats = scores ? G * n : 0;
        if (!scores) return LP_OUT_OF_MEMORY;
    }
    const float *qh = q + (b * H + kvh * G) * D;
    for (long g = 0; g < G; g += HEADS_A_WALK) {
        const float *qg = qh + g * D;
        float *s = scores + g * n;
        switch (G - g < HEADS_A_WALK ? G - g : HEADS_A_WALK) {
            case 3: keys_times_heads(KV, 3, qg, k_cache, table, first, n, kvh, KVH, D, scale, s); break;
            case 2: keys_times_heads(KV, 2, qg, k_cache, table, first, n, kvh, KVH, D, scale, s); break;
            case 1: keys_times_heads(KV, 1, qg, k_cache, table, first, n, kvh, KVH, D, scale, s); break;
        }
    }
    float inv[G]; /* each head's 1 / sum of weights, or 1 for a part of the keys: its sum goes with it, unapplied */
    for (long g = 0; g < G; g++) {
        const float max = scores_max(scores + g * n, n);
        float sum;
        exp_scores(scores + g * n, n, max, &sum);
        inv[g] = stats ? 1.0f : 1.0f / sum;
        if (stats) stats[2 * g] = max, stats[2 * g + 1] = sum;
    }
    const long stride = KVH * D;
    for (long g = 0; g < G; g += HEADS_A_WALK)
        for (long d0 = 0; d0 < D;) {
            const float *p = scores + g * n;
            float *o = o_rows + g * D + d0;
            const long col = kvh * D + d0, width = D - d0;
            switch (G - g < HEADS_A_WALK ? G - g : HEADS_A_WALK) {
                case 3: d0 += weighted_rows_walk(KV, 3, width, p, first, n, table, v_cache, col, stride, inv + g, D, o); break;
                case 2: d0 += weighted_rows_walk(KV, 2, width, p, first, n, table, v_cache, col, stride, inv + g, D, o); break;
                case 1: d0 += weighted_rows_walk(KV, 1, width, p, first, n, table, v_cache, col, stride, inv + g, D, o); break;
            }
        }
    return LP_OK;
}

/* Asks for the K and V rows of keys first .. end - 1 of KV heads kvh0 .. kvh1 - 1 (each D values of size bytes)
 * to be brought into this core's L2, in address order. A decode step's KV comes from memory (the layer's weights,
 * streamed in between, push it out of every cache), its rows 16 at a time from blocks anywhere in the pool: without
 * this a part waited out one miss after another. */
static inline void prefetch_rows(const void *k_cache, const void *v_cache, long size, const int32_t *table, long first,
                                 long end, long kvh0, long kvh1, long KVH, long D) {
    for (long j = first; j < end; j++) {
        const long row = (((long)table[j / 16] * 16 + j % 16) * KVH + kvh0) * D * size;
        for (long byte = 0; byte < (kvh1 - kvh0) * D * size; byte += 64) {
            prefetch_l2((const char *)k_cache + row + byte);
            prefetch_l2((const char *)v_cache + row + byte);
        }
    }
}

/* A task: sequence b's keys first .. end - 1, KV heads kvh0 .. kvh1 - 1, into the rows of o_rows [H][D] (and stats
 * [H][2]) of their query heads. */
static inline __attribute__((always_inline)) int decode_part(const int KV, long b, long kvh0, long kvh1, long first,
                                                             long end, const float *q, const void *k_cache,
                                                             const void *v_cache, const int32_t *block_tables,
                                                             const int32_t *context_lens, long H, long KVH, long D,
                                                             long max_blocks, long num_blocks, float scale,
                                                             float *o_rows, float *stats) {
    const int32_t *table = block_tables + b * max_blocks;
    if (!context_fits(table, context_lens[b], max_blocks, num_blocks)) return LP_BAD_INDEX;
    prefetch_rows(k_cache, v_cache, KV == LP_KV_F32 ? 4 : 2, table, first, end, kvh0, kvh1, KVH, D);
    const long G = H / KVH;
    for (long kvh = kvh0; kvh < kvh1; kvh++) {
        float *o = o_rows + kvh * G * D, *st = stats ? stats + kvh * G * 2 : NULL;
        int s;
        if (KV == LP_KV_BF16)
            s = decode_task(LP_KV_BF16, b, kvh, first, end, q, k_cache, v_cache, table, H, KVH, D, scale, o, st);
        else if (KV == LP_KV_F16)
            s = decode_task(LP_KV_F16, b, kvh, first, end, q, k_cache, v_cache, table, H, KVH, D, scale, o, st);
        else
            s = decode_task(LP_KV_F32, b, kvh, first, end, q, k_cache, v_cache, table, H, KVH, D, scale, o, st);
        if (s != LP_OK) return s;
    }
    return LP_OK;
}

/* RoPE (halves layout) on the first R dimensions of the q and k heads of qkv [N, (H + 2 KVH) * D] (the rest
 * pass through: partial rotary), then k and v into their cache slots (slot -1: skipped; caches
 * [num_slots / 16, 16, KVH, D] of kv_dtype, an LP_KV_* type) and the rotated q into q_out [N, H, D]; cos and sin
 * hold [N, R / 2]. Products and sums are rounded one by one, as torch's elementwise ops do, and the cache's
 * rounding is torch's, so the result equals the torch path bit for bit. D % 16 == 0, R % 16 == 0, R <= D. A slot
 * outside the cache is not written and reported as LP_BAD_INDEX. */
int lp_rope_write_kv(const float *qkv, const float *cos, const float *sin, const int64_t *slots, int64_t N, int64_t H,
                     int64_t KVH, int64_t D, int64_t R, int64_t num_slots, void *k_cache, void *v_cache,
                     int kv_dtype, float *q_out) {
    if (N < 0 || H < 0 || KVH < 0 || D <= 0 || D % 16 || R <= 0 || R % 16 || R > D || kv_dtype < LP_KV_F32 ||
        kv_dtype > LP_KV_F16)
        return LP_BAD_ARGUMENT;
    int status = LP_OK;
#pragma omp parallel for if (N >= 64)
    for (long n = 0; n < N; n++) {
        long slot = slots[n];
        if (slot < -1 || slot >= num_slots) {
#pragma omp atomic write
            status = LP_BAD_INDEX;
            slot = -1; /* q is still rotated; nothing is written outside the cache */
        }
        if (kv_dtype == LP_KV_BF16)
            rope_write_row(LP_KV_BF16, n, slot, qkv, cos, sin, H, KVH, D, R, k_cache, v_cache, q_out);
        else if (kv_dtype == LP_KV_F16)
            rope_write_row(LP_KV_F16, n, slot, qkv, cos, sin, H, KVH, D, R, k_cache, v_cache, q_out);
        else
            rope_write_row(LP_KV_F32, n, slot, qkv, cos, sin, H, KVH, D, R, k_cache, v_cache, q_out);
    }
    return status;
}

/* Chunked prefill: flash attention straight over the block table. One task is one tile of PREFILL_TILE query
 * positions of one sequence and the G = H / KVH query heads of one KV head (R = G x positions rows, row r being
 * position r / G, head r % G: a position's G heads lie side by side in q). The tile's q, times scale and log2 e
 * (the softmax takes powers of 2), is laid out transposed once, qt [D][rows] (rows: R rounded up to ROW_LANES, the
 * padding rows zeros), so that scores and weights lie key by key, s [PREFILL_KEYS][rows], ROW_LANES rows to a
 * vector. The task walks the sequence's keys up to the tile's last position, PREFILL_KEYS a step (each file defines
 * it: 16, one block, or 32, two); each block's K and V rows are widened to fp32 (kb, vb [PREFILL_KEYS][width]; an
 * fp32 cache's are read in place), once for all R rows, and folded into the rows' accumulators with an online
 * softmax in fp32. The prefix is thus read once per tile and never gathered. The steps are each file's:
 *   widen_rows(KV, cache, row0, stride, n, D, width, out): out[j][d] = the cache's row j (from row0, stride apart)
 *     for j < n, d < D, and 0 for D <= d < width (the rows of out width apart);
 *   keys_times_rows(k, k_stride, n, qt, rows, D, s): s[j][r] = q_r . K_j for every row and at least the keys j < n
 *     (later ones are left as they were), key j's row at k[j / 16] + j % 16 * k_stride;
 *   softmax_rows(s, rows, pos, k0, m, l, alpha): the scores of keys k0 .. k0 + PREFILL_KEYS - 1 into weights in
 *     place, 0 for keys past a row's position pos[r] (keys past the step's n lie past every row's), each row's
 *     running max m and sum l updated and alpha, its rescaling of what it accumulated so far;
 *   accumulate_values(p, rows, R, v, v_stride, n, D, alpha, acc): acc[r] = alpha[r] acc[r] + sum over j < n of
 *     p[j][r] V_j, key j's V row at v[j / 16] + j % 16 * v_stride.
 * Keys by rows puts the softmax's max and sum down the keys, lane by lane. Rows by keys (each row's scores one or two
 * vectors, as this kernel had them before) took a reduction across vectors for each row's max and sum, which made
 * the softmax a large share of a long chunk's time (timed by leaving it out). Keys by rows with exp2 (q scaled by
 * log2 e, exp2's polynomial cheaper than exp's) cuts that share on both the avx512 and the avx2 path, leaving the
 * two products running at about the CPU's fp32 FMA peak (benchmarks/cpu_kernel_bench.py times the default model's
 * heads on a 512-token chunk after 3,584 cached tokens). Tiles of 32 positions ran no faster than 16 and leave half
 * the tasks to share among the threads. */
#define PREFILL_TILE 16

static __thread float *prefill_scratch = NULL; /* per OpenMP thread: acc, s, qt, m, l, alpha, pos, kb, vb */
static __thread long prefill_scratch_floats = 0;

/* A tile of n_tok (<= max_tok) query tokens and the G = H / KVH query heads of KV head kvh: token i is q's row tok[i],
 * at position tpos[i] (non-decreasing: it sees the keys up to it), over keys k_begin .. k_end - 1 (k_begin a multiple
 * of 16) through its block table row. With stats NULL each row's output goes normalised to dst's row tok[i] (q's
 * layout); else unnormalised to dst's row dst_first + i, its max score (natural units) and sum of weights to the same
 * row of stats [][H][2]. The steps are this file's includer's (see above). */
static inline __attribute__((always_inline)) int rows_task(const int KV, const float *q, const int32_t *tok,
                                                           const int32_t *tpos, long n_tok, long max_tok, long kvh,
                                                           const void *k_cache, const void *v_cache,
                                                           const int32_t *table, long k_begin, long k_end, long H,
                                                           long KVH, long D, float scale, float *dst, long dst_first,
                                                           float *stats) {
    const long G = H / KVH, R = G * n_tok;
    const long rows = (R + ROW_LANES - 1) / ROW_LANES * ROW_LANES; /* this tile's; most: a whole tile's */
    const long most = (G * max_tok + ROW_LANES - 1) / ROW_LANES * ROW_LANES;
    /* acc's rows and the widened K/V rows: D rounded up to whole vectors (AVX-512's 16 lanes, a D of 8 more) */
    const long width = (D + ROW_LANES - 1) / ROW_LANES * ROW_LANES;
    const long floats = most * (width + D + PREFILL_KEYS + 4) + 2 * PREFILL_KEYS * width;
    if (prefill_scratch_floats < floats) {
        free(prefill_scratch);
        prefill_scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        prefill_scratch_floats = prefill_scratch ? floats : 0;
        if (!prefill_scratch) return LP_OUT_OF_MEMORY;
    }
    float *acc = prefill_scratch, *s = acc + most * width, *qt = s + most * PREFILL_KEYS, *m = qt + most * D;
    float *l = m + most, *alpha = l + most, *kb = alpha + most + most, *vb = kb + PREFILL_KEYS * width;
    int32_t *pos = (int32_t *)(alpha + most);
    const float scale_log2 = scale * 1.44269504088896341f;
    for (long r = 0; r < rows; r++) {
        const long row = r < R ? r : R - 1; /* a padding row takes the last row's position; its q is zeros */
        m[r] = -INFINITY, l[r] = 0.0f, pos[r] = tpos[row / G];
        const float *qr = q + ((long)tok[row / G] * H + kvh * G + row % G) * D;
        for (long d = 0; d < D; d++) qt[d * rows + r] = r < R ? qr[d] * scale_log2 : 0.0f;
    }
    for (long i = 0; i < R * width; i++) acc[i] = 0.0f;
    const long stride = KVH * D;
    const int in_place = KV == LP_KV_F32 && width == D; /* an fp32 cache's rows are read where they lie */
    const long kv_stride = in_place ? stride : width;
    for (long k0 = k_begin; k0 < k_end; k0 += PREFILL_KEYS) {
        const long n = k_end - k0 < PREFILL_KEYS ? k_end - k0 : PREFILL_KEYS;
        const float *k[PREFILL_KEYS / 16], *v[PREFILL_KEYS / 16];
        for (long j0 = 0; j0 < n; j0 += 16) { /* the step's blocks */
            const long nb = n - j0 < 16 ? n - j0 : 16, row0 = (long)table[(k0 + j0) / 16] * 16 * stride + kvh * D;
            if (in_place) {
                k[j0 / 16] = (const float *)k_cache + row0, v[j0 / 16] = (const float *)v_cache + row0;
            } else {
                widen_rows(KV, k_cache, row0, stride, nb, D, width, kb + j0 * width), k[j0 / 16] = kb + j0 * width;
                widen_rows(KV, v_cache, row0, stride, nb, D, width, vb + j0 * width), v[j0 / 16] = vb + j0 * width;
            }
        }
        keys_times_rows(k, kv_stride, n, qt, rows, D, s);
        softmax_rows(s, rows, pos, k0, m, l, alpha);
        accumulate_values(s, rows, R, v, kv_stride, n, width, alpha, acc);
    }
    store_tile(R, G, kvh, H, D, acc, width, m, l, tok, dst, dst_first, stats);
    return LP_OK;
}

/* Tile `tile` of PREFILL_TILE positions of sequence b's chunk over its keys up to each position: normalised into out;
 * a member of a cascade group (w not NULL, w->shared[b] > 0) over its own keys only, unnormalised into own/own_stats
 * (q's rows), for the merge with its group's shared pass. */
static inline __attribute__((always_inline)) int prefill_task(
    const int KV, long b, long kvh, long tile, const float *q, const void *k_cache, const void *v_cache,
    const int32_t *block_tables, const int32_t *cu_seqlens_q, const int32_t *context_lens, long num_q, long H,
    long KVH, long D, long max_blocks, long num_blocks, float scale, float *out, const Cascade *w, float *own,
    float *own_stats) {
    if (!chunk_fits(cu_seqlens_q, context_lens, b, num_q)) return LP_BAD_INDEX;
    const long q_start = cu_seqlens_q[b], q_len = cu_seqlens_q[b + 1] - q_start, ctx = context_lens[b];
    const long i0 = tile * PREFILL_TILE;
    if (i0 >= q_len) return LP_OK; /* this sequence's chunk has fewer tiles */
    const int32_t *table = block_tables + b * max_blocks;
    if (!context_fits(table, ctx, max_blocks, num_blocks)) return LP_BAD_INDEX;
    const long positions = q_len - i0 < PREFILL_TILE ? q_len - i0 : PREFILL_TILE;
    const long first_pos = ctx - q_len + i0, end = first_pos + positions; /* keys 0 .. end - 1 */
    int32_t tok[PREFILL_TILE], tpos[PREFILL_TILE];
    for (long i = 0; i < positions; i++) tok[i] = (int32_t)(q_start + i0 + i), tpos[i] = (int32_t)(first_pos + i);
    const long shared = w ? w->shared[b] : 0;
    return rows_task(KV, q, tok, tpos, positions, PREFILL_TILE, kvh, k_cache, v_cache, table, shared, end, H, KVH, D,
                     scale, shared ? own : out, q_start + i0, shared ? own_stats : NULL);
}

/* Shared-pass task t (of w->tasks x KVH): a tile of a group's tokens, all G heads of KV head t % KVH, over a chunk of
 * the group's shared keys, unmasked, unnormalised into spart/sstats (see cpu_cascade.h); on AMX tiles where `amx`
 * (lp_amx_runs, asked once a call: its first answer tries the tiles in a child process). */
static inline __attribute__((always_inline)) int shared_task(const int KV, int amx, long t, const Cascade *w,
                                                             const lp_cascade *c, const float *q, const void *k_cache,
                                                             const void *v_cache, long H, long KVH, long D,
                                                             float scale, float *spart, float *sstats) {
    if (amx) return shared_task_amx(KV, t, w, c, q, k_cache, v_cache, H, KVH, D, scale, spart, sstats);
    SharedTile st;
    shared_tile(w, c, t, KVH, &st);
    const int32_t *table = w->table[st.g];
    if (KV == LP_KV_BF16)
        return rows_task(LP_KV_BF16, q, st.tok, st.tpos, st.n, CASCADE_TOKENS, st.kvh, k_cache, v_cache, table, st.k0,
                         st.k1, H, KVH, D, scale, spart, st.first, sstats);
    if (KV == LP_KV_F16)
        return rows_task(LP_KV_F16, q, st.tok, st.tpos, st.n, CASCADE_TOKENS, st.kvh, k_cache, v_cache, table, st.k0,
                         st.k1, H, KVH, D, scale, spart, st.first, sstats);
    return rows_task(LP_KV_F32, q, st.tok, st.tpos, st.n, CASCADE_TOKENS, st.kvh, k_cache, v_cache, table, st.k0,
                     st.k1, H, KVH, D, scale, spart, st.first, sstats);
}

/* Varlen chunk attention over the paged cache (as kernels/torch_attention.py's paged_prefill): q [num_q, H, D] fp32, the
 * rows of sequence b being cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, caches [num_blocks, 16, KVH, D] of kv_dtype,
 * out [num_q, H, D] fp32. context_lens[b] counts the sequence's keys including its chunk, whose K/V are already in
 * the cache: query i sits at position context_lens[b] - q_len + i and sees every key up to its own. Sequences of one
 * query (decode rows) mix freely with chunks. D is a multiple of 8. cu_seqlens_q must run from 0 to num_q (else
 * nothing is computed); a sequence whose rows or context do not fit is skipped (its output left unwritten); both
 * are reported as LP_BAD_INDEX. Tasks (tile, sequence, KV head) go to threads dynamically, the last tiles first:
 * they see the most keys, so a long chunk's work ends evenly over the threads. With a cascade plan (see
 * cpu_cascade.h) each group's shared pass comes first, its members' tiles take their own keys, and every member's
 * rows are merged after. */
int lp_paged_prefill(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                     const int32_t *block_tables, const int32_t *cu_seqlens_q, const int32_t *context_lens,
                     int64_t num_q, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                     int64_t num_blocks, float scale, const lp_cascade *cascade, float *out) {
    if (B < 0 || num_q < 0 || KVH <= 0 || H % KVH || D <= 0 || D % 8 || kv_dtype < LP_KV_F32 || kv_dtype > LP_KV_F16)
        return LP_BAD_ARGUMENT;
    if (cu_seqlens_q[0] != 0 || cu_seqlens_q[B] != num_q) return LP_BAD_INDEX; /* some rows would go unwritten */
    const long tiles = most_tiles(cu_seqlens_q, context_lens, B, num_q, PREFILL_TILE);
    Cascade w = {0};
    const int cas = cascade && cascade->num_groups > 0;
    float *own = NULL, *spart = NULL;
    if (cas) {
        const int st = cascade_plan(cascade, block_tables, cu_seqlens_q, context_lens, num_q, B, KVH, max_blocks,
                                    num_blocks, omp_get_max_threads(), &w);
        if (st != LP_OK) return st;
        own = malloc(num_q * H * (D + 2) * sizeof(float) + 1);
        spart = malloc(w.parts * H * (D + 2) * sizeof(float) + 1);
        if (!own || !spart) {
            free(own), free(spart), cascade_free(&w);
            return LP_OUT_OF_MEMORY;
        }
    }
    float *own_stats = own ? own + num_q * H * D : NULL, *sstats = spart ? spart + w.parts * H * D : NULL;
    const long shared_tasks = cas ? w.tasks * KVH : 0;
    const int amx = cas && lp_amx_runs(kv_dtype, D);
    int status = LP_OK;
#pragma omp parallel for schedule(dynamic)
    for (long task = 0; task < shared_tasks + tiles * B * KVH; task++) {
        int s;
        if (task < shared_tasks) {
            s = shared_task(kv_dtype, amx, task, &w, cascade, q, k_cache, v_cache, H, KVH, D, scale, spart, sstats);
        } else {
            const long t = task - shared_tasks;
            const long tile = tiles - 1 - t / (B * KVH), b = t / KVH % B, kvh = t % KVH;
            const Cascade *plan = cas ? &w : NULL;
            if (kv_dtype == LP_KV_BF16)
                s = prefill_task(LP_KV_BF16, b, kvh, tile, q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                 context_lens, num_q, H, KVH, D, max_blocks, num_blocks, scale, out, plan, own,
                                 own_stats);
            else if (kv_dtype == LP_KV_F16)
                s = prefill_task(LP_KV_F16, b, kvh, tile, q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                 context_lens, num_q, H, KVH, D, max_blocks, num_blocks, scale, out, plan, own,
                                 own_stats);
            else
                s = prefill_task(LP_KV_F32, b, kvh, tile, q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                 context_lens, num_q, H, KVH, D, max_blocks, num_blocks, scale, out, plan, own,
                                 own_stats);
        }
        if (s != LP_OK) {
#pragma omp atomic write
            status = s;
        }
    }
    if (cas) {
        if (status == LP_OK)
            cascade_merge_rows(&w, cascade, cu_seqlens_q, B, own, own_stats, spart, sstats, H, D, out);
        free(own), free(spart), cascade_free(&w);
    }
    return status;
}

/* One query per sequence over its paged context: q [B, H, D] fp32, caches [num_blocks, 16, KVH, D] of kv_dtype
 * (an LP_KV_* type), out [B, H, D] fp32. One task per (part of a sequence's context, KV head) takes that head's
 * G = H / KVH query heads, so each K and V row is read once for all of them; a context split into parts (see
 * DECODE_SPAN) is combined after, each part's output rescaled by exp(its max - the overall max). D is a multiple
 * of 8. A sequence whose context does not fit its table or the cache is skipped (its output left unwritten) and
 * reported as LP_BAD_INDEX. Each cache type is its own inlined instance, picked per task (a branch per task costs
 * nothing beside the task). With a cascade plan (cpu_cascade.h), each group's shared keys are the shared pass's
 * (every member's G heads a row of one tile, the prefill's steps), a member's parts cover its keys after them, and
 * both are combined the same way. */
int lp_paged_decode(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                    const int32_t *block_tables, const int32_t *context_lens, int64_t B, int64_t H, int64_t KVH,
                    int64_t D, int64_t max_blocks, int64_t num_blocks, float scale, const lp_cascade *cascade,
                    float *out) {
    if (B < 0 || KVH <= 0 || H % KVH || D <= 0 || D % 8 || kv_dtype < LP_KV_F32 || kv_dtype > LP_KV_F16)
        return LP_BAD_ARGUMENT;
    const long threads = omp_get_max_threads();
    Cascade w = {0};
    const int cas = cascade && cascade->num_groups > 0;
    if (cas) {
        const int st = cascade_plan(cascade, block_tables, NULL, context_lens, B, B, KVH, max_blocks, num_blocks,
                                    threads, &w);
        if (st != LP_OK) return st;
    }
    /* sequence b's parts are first_part[b] .. first_part[b + 1] - 1, of span[b] keys each (its last, fewer), over its
     * keys from own_first[b] (after its group's shared keys; else 0) */
    long *first_part = malloc((B + 1) * sizeof(long)), *span = malloc((B ? B : 1) * sizeof(long));
    if (!first_part || !span) {
        free(first_part), free(span);
        if (cas) cascade_free(&w);
        return LP_OUT_OF_MEMORY;
    }
    first_part[0] = 0;
    for (long b = 0; b < B; b++) {
        const long own = context_lens[b] - (cas ? w.shared[b] : 0);
        span[b] = decode_span(own, B, threads, 2 * KVH * D * (kv_dtype == LP_KV_F32 ? 4 : 2));
        first_part[b + 1] = first_part[b] + decode_parts(own, span[b]);
    }
    const long parts = first_part[B], shared_tasks = cas ? w.tasks * KVH : 0;
    const long heads = decode_heads(parts, KVH, threads), runs = (KVH + heads - 1) / heads;
    const int amx = cas && lp_amx_runs(kv_dtype, D);
    long *part_seq = malloc(parts * sizeof(long)); /* each part's sequence */
    /* split sequences' and members' rows, stats; then the shared pass's */
    const long partial_rows = (parts > B || cas ? parts : 0) + (cas ? w.parts : 0);
    float *partial = partial_rows ? malloc(partial_rows * H * (D + 2) * sizeof(float)) : NULL;
    char *failed = calloc(B ? B : 1, 1); /* sequences a part of which was not computed: not combined */
    if (!part_seq || (partial_rows && !partial) || !failed) {
        free(first_part), free(span), free(part_seq), free(partial), free(failed);
        if (cas) cascade_free(&w);
        return LP_OUT_OF_MEMORY;
    }
    for (long b = 0; b < B; b++)
        for (long p = first_part[b]; p < first_part[b + 1]; p++) part_seq[p] = b;
    const long own_rows = partial_rows - (cas ? w.parts : 0);
    float *partial_stats = partial ? partial + partial_rows * H * D : NULL;
    float *spart = cas ? partial + own_rows * H * D : NULL, *sstats = cas ? partial_stats + own_rows * H * 2 : NULL;
    int status = LP_OK, shared_failed = 0;
#pragma omp parallel for schedule(dynamic)
    for (long task = 0; task < shared_tasks + parts * runs; task++) {
        if (task < shared_tasks) {
            const int s =
                shared_task(kv_dtype, amx, task, &w, cascade, q, k_cache, v_cache, H, KVH, D, scale, spart, sstats);
            if (s != LP_OK) {
#pragma omp atomic write
                shared_failed = 1;
#pragma omp atomic write
                status = s;
            }
            continue;
        }
        const long p = (task - shared_tasks) / runs, b = part_seq[p], kvh0 = (task - shared_tasks) % runs * heads;
        const long kvh1 = kvh0 + heads < KVH ? kvh0 + heads : KVH;
        const long ctx = context_lens[b], own_first = cas ? w.shared[b] : 0;
        const long first = own_first + (p - first_part[b]) * span[b];
        const long end = first + span[b] < ctx ? first + span[b] : ctx;
        const int split = first_part[b + 1] - first_part[b] > 1 || own_first > 0;
        float *o_rows = split ? partial + p * H * D : out + b * H * D;
        float *stats = split ? partial_stats + p * H * 2 : NULL;
        const int s = decode_part(kv_dtype, b, kvh0, kvh1, first, end, q, k_cache, v_cache, block_tables, context_lens,
                                  H, KVH, D, max_blocks, num_blocks, scale, o_rows, stats);
        if (s != LP_OK) {
#pragma omp atomic write
            failed[b] = 1;
#pragma omp atomic write
            status = s;
        }
    }
    for (long b = 0; b < B; b++) { /* each split sequence's parts and each member's, combined */
        const long p = first_part[b], n = first_part[b + 1] - p, member = cas && w.shared[b] > 0;
        if ((n == 1 && !member) || failed[b] || (member && shared_failed)) continue;
        if (member) {
            cascade_merge_row(&w, cascade, b, b, partial + p * H * D, partial_stats + p * H * 2, n, spart, sstats, H,
                              D, out + b * H * D);
            continue;
        }
        for (long h = 0; h < H; h++) {
            const float *rows[n], *stats[n];
            for (long i = 0; i < n; i++)
                rows[i] = partial + ((p + i) * H + h) * D, stats[i] = partial_stats + ((p + i) * H + h) * 2;
            merge_parts(n, rows, stats, D, out + (b * H + h) * D);
        }
    }
    free(first_part), free(span), free(part_seq), free(partial), free(failed);
    if (cas) cascade_free(&w);
    return status;
}
