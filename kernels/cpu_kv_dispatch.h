/* lp_paged_decode and lp_rope_write_kv, the same for every path: cpu_kernels.c and cpu_kernels_portable.c each
 * define decode_task(KV, b, kvh, q, k_cache, v_cache, block_tables, context_lens, H, KVH, D, max_blocks,
 * num_blocks, scale, out), the work of one (sequence, KV head), and rope_write_row(KV, n, slot, qkv, cos, sin, H,
 * KVH, D, k_cache, v_cache, q_out), one token's, each inlined for KV a constant LP_KV_* type, then include this
 * file once. */

/* One query per sequence over its paged context: q [B, H, D] fp32, caches [num_blocks, 16, KVH, D] of kv_dtype
 * (an LP_KV_* type), out [B, H, D] fp32. One task per (sequence, KV head) takes that head's G = H / KVH query
 * heads, so each K and V row is read once for all of them. D is a multiple of 8. A sequence whose context does
 * not fit its table or the cache is skipped (its output left unwritten) and reported as LP_BAD_INDEX. Each cache
 * type is its own inlined instance, picked per task (a branch per task costs nothing beside the task). */
int lp_paged_decode(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                    const int32_t *block_tables, const int32_t *context_lens, int64_t B, int64_t H, int64_t KVH,
                    int64_t D, int64_t max_blocks, int64_t num_blocks, float scale, float *out) {
    if (B < 0 || KVH <= 0 || H % KVH || D <= 0 || D % 8 || kv_dtype < LP_KV_F32 || kv_dtype > LP_KV_F16)
        return LP_BAD_ARGUMENT;
    int status = LP_OK;
#pragma omp parallel for schedule(dynamic)
    for (long task = 0; task < B * KVH; task++) {
        const long b = task / KVH, kvh = task % KVH;
        int s;
        if (kv_dtype == LP_KV_BF16)
            s = decode_task(LP_KV_BF16, b, kvh, q, k_cache, v_cache, block_tables, context_lens, H, KVH, D,
                            max_blocks, num_blocks, scale, out);
        else if (kv_dtype == LP_KV_F16)
            s = decode_task(LP_KV_F16, b, kvh, q, k_cache, v_cache, block_tables, context_lens, H, KVH, D,
                            max_blocks, num_blocks, scale, out);
        else
            s = decode_task(LP_KV_F32, b, kvh, q, k_cache, v_cache, block_tables, context_lens, H, KVH, D,
                            max_blocks, num_blocks, scale, out);
        if (s != LP_OK) {
#pragma omp atomic write
            status = s;
        }
    }
    return status;
}

/* RoPE (halves layout) on the q and k heads of qkv [N, (H + 2 KVH) * D], then k and v into their cache
 * slots (slot -1: skipped; caches [num_slots / 16, 16, KVH, D] of kv_dtype, an LP_KV_* type) and the rotated
 * q into q_out [N, H, D]. Products and sums are rounded one by one, as torch's elementwise ops do, and the
 * cache's rounding is torch's, so the result equals the torch path bit for bit. D % 16 == 0. A slot outside
 * the cache is not written and reported as LP_BAD_INDEX. */
int lp_rope_write_kv(const float *qkv, const float *cos, const float *sin, const int64_t *slots, int64_t N, int64_t H,
                     int64_t KVH, int64_t D, int64_t num_slots, void *k_cache, void *v_cache, int kv_dtype,
                     float *q_out) {
    if (N < 0 || H < 0 || KVH < 0 || D <= 0 || D % 16 || kv_dtype < LP_KV_F32 || kv_dtype > LP_KV_F16)
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
            rope_write_row(LP_KV_BF16, n, slot, qkv, cos, sin, H, KVH, D, k_cache, v_cache, q_out);
        else if (kv_dtype == LP_KV_F16)
            rope_write_row(LP_KV_F16, n, slot, qkv, cos, sin, H, KVH, D, k_cache, v_cache, q_out);
        else
            rope_write_row(LP_KV_F32, n, slot, qkv, cos, sin, H, KVH, D, k_cache, v_cache, q_out);
    }
    return status;
}
