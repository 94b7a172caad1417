/* Shared-prefix ("cascade") attention's bookkeeping, the same for every path and for the int16 prefill: a call's
 * lp_cascade plan checked and laid out as tasks, and the partial results merged by their log-sum-exp. Plain C, no
 * vector code; included by cpu_kv_dispatch.h and cpu_prefill_int16.c.
 *
 * A group's shared pass is tasks of (chunk of the shared keys, tile of CASCADE_TOKENS query tokens, KV head): each
 * takes every one of the tile's tokens' G query heads against the chunk's keys, unmasked (the shared keys lie before
 * every member's first query), so each K and V row of the chunk is read (and widened, or rounded) once for up to
 * CASCADE_TOKENS x G rows instead of once for each sequence's G. A member's own keys (after the shared ones) go as
 * without a plan, into partial results too, and each query row's partials are merged at the end: weights
 * exp(max - the largest max), out = sum w_i o_i / sum w_i l_i, as the split decode always combined its parts. */
#ifndef LP_CPU_CASCADE_H
#define LP_CPU_CASCADE_H

#include <math.h>
#include <stdlib.h>

#include "cpu_amx.h"
#include "cpu_kernels.h"

#define CASCADE_TOKENS 64 /* query tokens a shared-pass task takes: the 64 sequences of a decode step, G heads each */
#define CASCADE_UNIT 32   /* chunks of the shared keys start at multiples of this (the int16 kernel's step) */

typedef struct {
    long groups, tokens;
    long tasks;         /* shared-pass tasks for one KV head, all groups */
    long parts;         /* shared partial results, each a token's H rows */
    long *shared;       /* [B]: the keys sequence b shares with its group (0: in none) */
    long *seq_group;    /* [B]: its group, or -1 */
    long *token_start;  /* [groups + 1]: group g's tokens are token[token_start[g] .. token_start[g + 1] - 1] */
    int32_t *token;     /* [tokens]: q rows, member by member, each member's in order */
    long *local;        /* [num_q]: a member's q row's index among its group's tokens (else -1) */
    long *span, *tiles; /* [groups]: keys a chunk; tiles of CASCADE_TOKENS tokens */
    long *task_start;   /* [groups + 1] */
    long *part_start;   /* [groups]: token i's result over chunk c is part part_start[g] + c x tokens_g + i */
    const int32_t **table; /* [groups]: the first member's block table row (every member's agrees on the shared) */
} Cascade;

static inline void cascade_free(Cascade *w) {
    free(w->shared), free(w->seq_group), free(w->token_start), free(w->token), free(w->local), free(w->span);
    free(w->tiles), free(w->task_start), free(w->part_start), free((void *)w->table);
}

static inline long cascade_tokens(const Cascade *w, long g) { return w->token_start[g + 1] - w->token_start[g]; }

static inline long cascade_chunks(const Cascade *w, long g, const lp_cascade *c) {
    return (c->shared_lens[g] + w->span[g] - 1) / w->span[g];
}

/* The plan c for a call over B sequences (their rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of num_q, or one
 * row each where cu_seqlens_q is NULL), checked against the block tables and laid out in w for `threads` threads.
 * LP_OK; LP_BAD_ARGUMENT for a plan that breaks lp_cascade's rules; LP_OUT_OF_MEMORY. w is freed on failure. */
static inline int cascade_plan(const lp_cascade *c, const int32_t *block_tables, const int32_t *cu_seqlens_q,
                        const int32_t *context_lens, long num_q, long B, long KVH, long max_blocks, long num_blocks,
                        long threads, Cascade *w) {
    const long G = c->num_groups;
    *w = (Cascade){.groups = G};
    w->shared = calloc(B ? B : 1, sizeof(long)), w->seq_group = malloc((B ? B : 1) * sizeof(long));
    w->token_start = malloc((G + 1) * sizeof(long)), w->local = malloc((num_q ? num_q : 1) * sizeof(long));
    w->span = malloc((G ? G : 1) * sizeof(long)), w->tiles = malloc((G ? G : 1) * sizeof(long));
    w->task_start = malloc((G + 1) * sizeof(long)), w->part_start = malloc((G ? G : 1) * sizeof(long));
    w->table = malloc((G ? G : 1) * sizeof(int32_t *));
    if (!w->shared || !w->seq_group || !w->token_start || !w->local || !w->span || !w->tiles || !w->task_start ||
        !w->part_start || !w->table) {
        cascade_free(w);
        return LP_OUT_OF_MEMORY;
    }
    for (long b = 0; b < B; b++) w->seq_group[b] = -1;
    for (long r = 0; r < num_q; r++) w->local[r] = -1;
    int ok = G >= 0 && c->group_starts[0] == 0;
    w->token_start[0] = 0;
    for (long g = 0; ok && g < G; g++) {
        const long first = c->group_starts[g], end = c->group_starts[g + 1], shared = c->shared_lens[g];
        ok = first < end && shared >= 16 && shared % 16 == 0 && shared <= max_blocks * 16;
        if (!ok) break;
        const int32_t *lead = block_tables + (long)c->members[first] * max_blocks;
        for (long blk = 0; ok && blk < shared / 16; blk++) ok = lead[blk] >= 0 && lead[blk] < num_blocks;
        long tokens = w->token_start[g];
        for (long m = first; ok && m < end; m++) {
            const long b = c->members[m];
            ok = b >= 0 && b < B && w->seq_group[b] < 0;
            if (!ok) break;
            const long q0 = cu_seqlens_q ? cu_seqlens_q[b] : b, q1 = cu_seqlens_q ? cu_seqlens_q[b + 1] : b + 1;
            ok = 0 <= q0 && q0 <= q1 && q1 <= num_q && context_lens[b] - (q1 - q0) >= shared;
            const int32_t *table = block_tables + b * max_blocks;
            for (long blk = 0; ok && blk < shared / 16; blk++) ok = table[blk] == lead[blk];
            if (!ok) break;
            w->seq_group[b] = g, w->shared[b] = shared;
            for (long r = q0; r < q1; r++) w->local[r] = tokens++ - w->token_start[g];
        }
        w->token_start[g + 1] = tokens;
        w->table[g] = lead;
    }
    if (!ok) {
        cascade_free(w);
        return LP_BAD_ARGUMENT;
    }
    w->tokens = w->token_start[G];
    w->token = malloc((w->tokens ? w->tokens : 1) * sizeof(int32_t));
    if (!w->token) {
        cascade_free(w);
        return LP_OUT_OF_MEMORY;
    }
    for (long g = 0; g < G; g++)
        for (long m = c->group_starts[g]; m < c->group_starts[g + 1]; m++) {
            const long b = c->members[m], q0 = cu_seqlens_q ? cu_seqlens_q[b] : b;
            const long q1 = cu_seqlens_q ? cu_seqlens_q[b + 1] : b + 1;
            for (long r = q0; r < q1; r++) w->token[w->token_start[g] + w->local[r]] = (int32_t)r;
        }
    /* Chunks of the shared keys: enough tasks for four a thread over all groups' tiles and KV heads, at least 256
     * keys each (a chunk's result costs a merge per token). */
    long all_tiles = 0;
    for (long g = 0; g < G; g++) all_tiles += w->tiles[g] = (cascade_tokens(w, g) + CASCADE_TOKENS - 1) / CASCADE_TOKENS;
    const long wanted = (8 * threads + all_tiles * KVH - 1) / (all_tiles * KVH > 0 ? all_tiles * KVH : 1);
    w->task_start[0] = 0;
    long parts = 0;
    for (long g = 0; g < G; g++) {
        long span = (c->shared_lens[g] + wanted - 1) / wanted;
        span = span < 256 ? 256 : span;
        w->span[g] = (span + CASCADE_UNIT - 1) / CASCADE_UNIT * CASCADE_UNIT;
        w->task_start[g + 1] = w->task_start[g] + cascade_chunks(w, g, c) * w->tiles[g];
        w->part_start[g] = parts;
        parts += cascade_chunks(w, g, c) * cascade_tokens(w, g);
    }
    w->tasks = w->task_start[G], w->parts = parts;
    return LP_OK;
}

/* Shared-pass task t (of w->tasks, one KV head's): its group, chunk and tile. */
static inline void cascade_task(const Cascade *w, long t, long *g, long *chunk, long *tile) {
    long lo = 0, hi = w->groups; /* the last g with task_start[g] <= t */
    while (hi - lo > 1) {
        const long mid = (lo + hi) / 2;
        if (w->task_start[mid] <= t) lo = mid;
        else hi = mid;
    }
    *g = lo, *chunk = (t - w->task_start[lo]) / w->tiles[lo], *tile = (t - w->task_start[lo]) % w->tiles[lo];
}

/* A finished tile's R = G x tokens rows (row r: token r / G, head kvh G + r % G), accumulated in acc (rows acc_stride
 * apart) with the running max m (log2 units, as the tiles' softmax keeps it) and sum of weights l: normalised into
 * dst's rows tok[r / G] (q's layout) where stats is NULL, else unnormalised into dst's rows dst_first + r / G with
 * their max in natural units and their sum in stats [][H][2]. */
static inline void store_tile(long R, long G, long kvh, long H, long D, const float *acc, long acc_stride,
                              const float *m, const float *l, const int32_t *tok, float *dst, long dst_first,
                              float *stats) {
    for (long r = 0; r < R; r++) {
        const float *a = acc + r * acc_stride;
        const long head = kvh * G + r % G;
        if (!stats) {
            const float inv = 1.0f / l[r];
            float *o = dst + ((long)tok[r / G] * H + head) * D;
            for (long d = 0; d < D; d++) o[d] = a[d] * inv;
        } else {
            float *o = dst + ((dst_first + r / G) * H + head) * D, *st = stats + ((dst_first + r / G) * H + head) * 2;
            for (long d = 0; d < D; d++) o[d] = a[d];
            st[0] = m[r] * 0.69314718055994531f, st[1] = l[r];
        }
    }
}

/* What shared-pass task t (of w->tasks x KVH) takes: its group g, KV head, keys k0 .. k1 - 1, its n tokens (from
 * *tok, each at position k1 - 1 in tpos: every shared key visible, none past them) and its first part's row. */
typedef struct {
    long g, kvh, k0, k1, n, first;
    const int32_t *tok;
    int32_t tpos[CASCADE_TOKENS];
} SharedTile;

static inline void shared_tile(const Cascade *w, const lp_cascade *c, long t, long KVH, SharedTile *st) {
    long chunk, tile;
    cascade_task(w, t / KVH, &st->g, &chunk, &tile);
    const long g = st->g, tokens = cascade_tokens(w, g), i0 = tile * CASCADE_TOKENS;
    st->kvh = t % KVH, st->k0 = chunk * w->span[g];
    st->k1 = st->k0 + w->span[g] < c->shared_lens[g] ? st->k0 + w->span[g] : c->shared_lens[g];
    st->n = tokens - i0 < CASCADE_TOKENS ? tokens - i0 : CASCADE_TOKENS;
    for (long i = 0; i < st->n; i++) st->tpos[i] = (int32_t)(st->k1 - 1);
    st->tok = w->token + w->token_start[g] + i0, st->first = w->part_start[g] + chunk * tokens + i0;
}

/* Shared-pass task t (of w->tasks x KVH) on AMX tiles (cpu_amx.h), straight from the 16-bit caches: where
 * lp_amx_runs, both the dispatch's shared pass and the int16 prefill's run this. */
static inline int shared_task_amx(int kv_dtype, long t, const Cascade *w, const lp_cascade *c, const float *q,
                                  const void *k_cache, const void *v_cache, long H, long KVH, long D, float scale,
                                  float *spart, float *sstats) {
    SharedTile st;
    shared_tile(w, c, t, KVH, &st);
    return lp_amx_rows(kv_dtype, q, st.tok, NULL, st.n, st.kvh, k_cache, v_cache, w->table[st.g], st.k0, st.k1, H,
                       KVH, D, scale, spart, st.first, sstats);
}

/* o[0 .. D - 1] = the merge of n partial results: part i's unnormalised rows parts[i], its max score (natural units)
 * stats[i][0] and sum of weights stats[i][1], each weighed by exp(its max - the largest max). */
static inline void merge_parts(long n, const float *const *parts, const float *const *stats, long D, float *o) {
    float top = -INFINITY, total = 0.0f;
    for (long i = 0; i < n; i++) top = fmaxf(top, stats[i][0]);
    for (long d = 0; d < D; d++) o[d] = 0.0f;
    for (long i = 0; i < n; i++) {
        const float weight = expf(stats[i][0] - top);
        total += weight * stats[i][1];
        for (long d = 0; d < D; d++) o[d] += weight * parts[i][d];
    }
    for (long d = 0; d < D; d++) o[d] /= total;
}

/* q row `row` of sequence b (H heads into out_row [H][D]): the merge of its own n_own partial results (rows
 * own + (i H + h) D, stats own_stats + (i H + h) 2) and, for a member, its group's shared chunks' (spart/sstats, a
 * part's H rows the same way). */
static inline void cascade_merge_row(const Cascade *w, const lp_cascade *c, long b, long row, const float *own,
                                     const float *own_stats, long n_own, const float *spart, const float *sstats,
                                     long H, long D, float *out_row) {
    const long g = w->seq_group[b], chunks = g >= 0 ? cascade_chunks(w, g, c) : 0, n = n_own + chunks;
    const float *parts[n], *stats[n];
    for (long h = 0; h < H; h++) {
        for (long i = 0; i < n_own; i++) parts[i] = own + (i * H + h) * D, stats[i] = own_stats + (i * H + h) * 2;
        for (long ch = 0; ch < chunks; ch++) {
            const long p = w->part_start[g] + ch * cascade_tokens(w, g) + w->local[row];
            parts[n_own + ch] = spart + (p * H + h) * D, stats[n_own + ch] = sstats + (p * H + h) * 2;
        }
        merge_parts(n, parts, stats, D, out_row + h * D);
    }
}

/* Every member's rows of a prefill call (rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1) merged into out: its own
 * partial result (own/own_stats, q's rows) with its group's shared chunks'. */
static inline void cascade_merge_rows(const Cascade *w, const lp_cascade *c, const int32_t *cu_seqlens_q, long B,
                               const float *own, const float *own_stats, const float *spart, const float *sstats,
                               long H, long D, float *out) {
    for (long b = 0; b < B; b++)
        for (long r = w->shared[b] ? cu_seqlens_q[b] : cu_seqlens_q[b + 1]; r < cu_seqlens_q[b + 1]; r++)
            cascade_merge_row(w, c, b, r, own + r * H * D, own_stats + r * H * 2, 1, spart, sstats, H, D,
                              out + r * H * D);
}

#endif
