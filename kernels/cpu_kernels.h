/* The interface every build of the native CPU kernels exports (kernels/cpu.py binds it): the AVX2 source
 * (cpu_kernels.c), the portable one (cpu_kernels_portable.c, also built with AVX-512 flags through
 * cpu_kernels_avx512.c) and the packer they share (cpu_pack.c). Declared once here, so a definition that drifts
 * from it fails to compile.
 *
 * Every exported kernel returns a status (LP_OK or why it did nothing useful) instead of crashing on a failed
 * allocation or an index past a cache, sizes are int64_t, and lp_abi_version() reports LP_ABI_VERSION, which
 * the loader compares with its own ABI_VERSION before any kernel runs. Change an exported signature or a
 * status, and bump both.
 */
#ifndef LP_CPU_KERNELS_H
#define LP_CPU_KERNELS_H

#include <stdint.h>

#define TILE 16 /* weight rows per packed tile */
#define LP_ABI_VERSION 3

enum {
    LP_OK = 0,
    LP_OUT_OF_MEMORY = 1, /* a scratch buffer could not be allocated; the output is incomplete */
    LP_BAD_INDEX = 2,     /* a block table entry, context length or slot points outside the cache; skipped */
    LP_BAD_ARGUMENT = 3,  /* bits, group or a size outside what the kernel supports; nothing computed */
};

/* KV cache element types, numbered as kernels/cpu.py's KV_DTYPES; every build reads and writes all three. A 16-bit
 * cache halves the pool's memory and the bytes each decode step reads; values are widened to fp32 as they are loaded
 * (exactly, for both types) and every product and sum stays fp32. Stores round to nearest even, as torch's .to()
 * does, and keep a NaN a NaN. */
enum { LP_KV_F32 = 0, LP_KV_BF16 = 1, LP_KV_F16 = 2 };

int lp_abi_version(void);
int lp_qgemm(const float *X, int64_t M, int64_t K, const int8_t *q, const float *scale, const float *min,
             int64_t N_padded, int bits, int offset, int group, float *Y);
int lp_pack_q(const int8_t *q, int64_t N, int64_t K, int bits, int offset, uint8_t *out);
int lp_paged_decode(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                    const int32_t *block_tables, const int32_t *context_lens, int64_t B, int64_t H, int64_t KVH,
                    int64_t D, int64_t max_blocks, int64_t num_blocks, float scale, float *out);
int lp_paged_prefill(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                     const int32_t *block_tables, const int32_t *cu_seqlens_q, const int32_t *context_lens,
                     int64_t num_q, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                     int64_t num_blocks, float scale, float *out);
int lp_add_rms_norm(const float *x, const float *residual, const float *weight, int64_t M, int64_t D, float eps,
                    float *sum, float *out);
int lp_silu_mul(const float *gate_up, int64_t M, int64_t I, float *out);
int lp_rope_write_kv(const float *qkv, const float *cos, const float *sin, const int64_t *slots, int64_t N, int64_t H,
                     int64_t KVH, int64_t D, int64_t num_slots, void *k_cache, void *v_cache, int kv_dtype,
                     float *q_out);

/* Whether a context of ctx tokens (at least one) fits its table row of max_blocks entries, each a block of the cache. */
static inline int context_fits(const int32_t *table, long ctx, long max_blocks, long num_blocks) {
    if (ctx < 1 || ctx > max_blocks * 16) return 0;
    for (long blk = 0; blk * 16 < ctx; blk++)
        if (table[blk] < 0 || table[blk] >= num_blocks) return 0;
    return 1;
}

#endif
