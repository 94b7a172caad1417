/* The interface every build of the native CPU kernels exports (kernels/cpu.py binds it): the AVX2 source
 * (cpu_kernels_avx2.c), the portable one (cpu_kernels_portable.c, also built with AVX-512 flags through
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
#define LP_ABI_VERSION 17

/* A decode step reads every weight once, from memory, a tile's bytes in order: a qgemm kernel asks for the bytes
 * `near` past the group of a tile it is about to read (the groups that follow, then the next tile's), since the
 * hardware prefetcher alone kept too few lines in flight for a one-row product to reach the memory's bandwidth, and
 * where `far` is not 0 for those `far` past it into L2 as well. PREFETCH_BYTES suits the kernels that spend more
 * instructions a weight; the int16 one-row kernel, with half of them, reads faster with PREFETCH_BYTES_FAST into L1
 * and PREFETCH_BYTES into L2 (each measured against its neighbours in one process). 5 and 6 bits prefetch their
 * nibbles here (their high bits are a stream of their own: the int16 one-row kernel prefetches those too). */
#define PREFETCH_BYTES 4096
#define PREFETCH_BYTES_FAST 1536
static inline __attribute__((always_inline)) void prefetch_group(const void *qt, long g, int group, int bits,
                                                                 long near, long far) {
    const long bytes = (long)group * TILE * (bits == 8 ? 8 : 4) / 8;
    for (long line = 0; line < bytes; line += 64) {
        __builtin_prefetch((const char *)qt + g * bytes + near + line);
        if (far) __builtin_prefetch((const char *)qt + g * bytes + far + line, 0, 2);
    }
}

/* The cache line at p asked for into L2. An asm statement, not __builtin_prefetch: GCC 12 deleted cpu_kv_dispatch.h's
 * prefetch_rows loops, which do nothing else, as having no effect (no prefetch was left in the built library). */
static inline void prefetch_l2(const void *p) {
#if defined(__x86_64__)
    __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)p));
#elif defined(__aarch64__)
    __asm__ volatile("prfm pldl2keep, %0" : : "Q"(*(const char *)p));
#else
    __builtin_prefetch(p, 0, 2);
#endif
}

/* The widths of a packed tile's values (cpu_qgemm.h's layout). */
static inline int packed_bits(int bits) { return (bits >= 4 && bits <= 6) || bits == 8; }

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

/* Shared-prefix ("cascade") attention's plan for one call (NULL: none): groups of sequences whose block tables begin
 * with the same blocks. Group g's members are the sequences members[group_starts[g] .. group_starts[g + 1] - 1], each
 * in one group at most; the first shared_lens[g] keys (whole blocks) of every member lie in the very same blocks and
 * before each member's first query of the call, so no query of the call is masked from them. The kernels attend all
 * the group's query rows to those keys at once (each K and V row read once a call, a 16-bit product kernel's
 * rounding done once) and each member's own keys after them as before, then merge the two by their log-sum-exp.
 * A plan that breaks any of this is refused (LP_BAD_ARGUMENT, nothing computed). engine/cascade.py builds it. */
typedef struct {
    int64_t num_groups;
    const int32_t *group_starts; /* [num_groups + 1], from 0 */
    const int32_t *members;      /* [group_starts[num_groups]]: batch indices */
    const int32_t *shared_lens;  /* [num_groups]: keys, multiples of 16, at least 16 */
} lp_cascade;

/* A packed weight's scales and mins (cpu_scales.h says why this form): for tile t, group g, row j of the tile,
 *   scale = fp16 unit[t][g / unit_groups][j] * mult[t][g][j],  min likewise from min_unit and min_mult
 * (both NULL where every min is 0), each a product exact in fp32. */
typedef struct {
    const uint16_t *unit;     /* fp16 bits [tiles][groups / unit_groups][16] */
    const int8_t *mult;       /* [tiles][groups][16] */
    const uint16_t *min_unit; /* as unit, or NULL */
    const int8_t *min_mult;   /* as mult, or NULL */
    int64_t unit_groups;      /* groups a unit serves: 256 / G for a K-quant, 1 for a legacy type */
} lp_scales;

int lp_abi_version(void);
/* Whether the AMX tiles run here (cpu_cascade_amx.c: cascade attention's shared pass, the int16 prefill, lp_qgemm_amx):
 * want 1 asks for them where the CPU and Linux allow it, 0 switches them off (the float32 tile, the VNNI prefill and
 * lp_qgemm_int16 then run, as on every other CPU), -1 only asks. Not a status: 1 on, 0 off. */
int lp_amx(int want);
int lp_qgemm(const float *X, int64_t M, int64_t K, const int8_t *q, const lp_scales *scales, int64_t N_padded, int bits, int offset, int group, float *Y);
int lp_pack_q(const int8_t *q, int64_t N, int64_t K, int bits, int offset, uint8_t *out);
int lp_qgemm_int8(const float *X, int64_t M, int64_t K, const int8_t *q, const lp_scales *scales, int64_t N_padded, int bits, int offset, int group, float *Y);
int lp_qgemm_int16(const float *X, int64_t M, int64_t K, const int8_t *q, const lp_scales *scales, int64_t N_padded, int bits, int offset, int group, float *Y);
int lp_qgemm_amx(const float *X, int64_t M, int64_t K, const int8_t *q, const lp_scales *scales, int64_t N_padded, int bits, int offset, int group, float *Y);
int lp_pack_quads(const int8_t *q, int64_t N, int64_t K, int bits, int offset, uint8_t *out);
int lp_unpack_gguf(int type, const uint8_t *raw, int64_t blocks, int8_t *q, uint16_t *unit, int8_t *mult,
                   uint16_t *min_unit, int8_t *min_mult);
int lp_dequantize_gguf(int type, const uint8_t *raw, int64_t blocks, float *out);
int lp_paged_decode(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                    const int32_t *block_tables, const int32_t *context_lens, int64_t B, int64_t H, int64_t KVH,
                    int64_t D, int64_t max_blocks, int64_t num_blocks, float scale, const lp_cascade *cascade,
                    float *out);
int lp_paged_prefill(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                     const int32_t *block_tables, const int32_t *cu_seqlens_q, const int32_t *context_lens,
                     int64_t num_q, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                     int64_t num_blocks, float scale, const lp_cascade *cascade, float *out);
int lp_paged_prefill_int16(const float *q, const void *k_cache, const void *v_cache, int kv_dtype,
                           const int32_t *block_tables, const int32_t *cu_seqlens_q, const int32_t *context_lens,
                           int64_t num_q, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                           int64_t num_blocks, float scale, const lp_cascade *cascade, float *out);
int lp_add_rms_norm(const float *x, const float *residual, const float *weight, int64_t M, int64_t D, float eps,
                    float *sum, float *out);
int lp_silu_mul(const float *gate_up, int64_t M, int64_t I, float *out);
/* out[r]: the first index of row r's largest value (or first NaN) of x [M, N]: torch's max(dim=-1).indices. */
int lp_argmax_rows(const float *x, int64_t M, int64_t N, int64_t *out);
/* out[r]: row r's winner of the sampler's exponential race over x [M, N] at scale[r], its uniforms from keys[r]; -1
 * for a row with a NaN or +inf (after scaling), nothing above -inf, or a scale not positive and finite. */
int lp_race_rows(const float *x, int64_t M, int64_t N, const float *scale, const int64_t *keys, int64_t *out);
/* out[r]: row r's winner of the race among the values top_k[r] (0: all) and then top_p[r] keep (sampler.nucleus);
 * -1 as lp_race_rows, -2 where those reach past the values it looks at (cpu_rows.h's nucleus_row says which). */
int lp_nucleus_rows(const float *x, int64_t M, int64_t N, const float *scale, const float *top_p,
                    const int64_t *top_k, const int64_t *keys, int64_t *out);
int lp_rope_write_kv(const float *qkv, const float *cos, const float *sin, const int64_t *slots, int64_t N, int64_t H,
                     int64_t KVH, int64_t D, int64_t R, int64_t num_slots, void *k_cache, void *v_cache,
                     int kv_dtype, float *q_out);

/* How a projection's input rows meet its weights: as they are (lp_qgemm, the exact path), rounded to int16 per run
 * (lp_qgemm_int16, the same packed layout) or to int8 (lp_qgemm_int8, packed by lp_pack_quads). kernels/cpu.py's
 * ACTIVATIONS lists them in this order. */
enum { LP_ACT_F32 = 0, LP_ACT_INT16 = 1, LP_ACT_INT8 = 2 };

/* A Llama model's decoder layers as lp_llama_decode (cpu_decode_step.c) runs them, prepared once by
 * localpaged/models/llama_cpu_decode.py, which declares the same structures field for field. */
typedef struct {
    const int8_t *q;  /* packed tiles as lp_qgemm takes them */
    lp_scales scales; /* their scales and mins */
    int64_t rows; /* output features: whole tiles, no padding row */
    int32_t bits, offset, group;
    int32_t activations; /* LP_ACT_*: the kernel its inputs go through, and so how q was packed */
} lp_projection;

typedef struct {
    const float *input_norm, *post_attention_norm; /* [hidden] each */
    const float *qkv_bias;                         /* [(num_heads + 2 num_kv_heads) head_dim], or NULL (Qwen2 has one) */
    const float *q_norm, *k_norm; /* [head_dim] each, or both NULL: Qwen3's RMS norm of every head of q and k */
    lp_projection qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_blocks, 16, num_kv_heads, head_dim] of kv_dtype */
} lp_decoder_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, rotary_dim, intermediate, num_blocks;
    float eps, scale;
    int32_t kv_dtype;
    const lp_decoder_layer *layers; /* num_layers of them */
    const float *final_norm;        /* [hidden] */
} lp_llama;

int lp_llama_decode(const lp_llama *model, const float *x, const float *cos, const float *sin, const int64_t *slots,
                    const int32_t *block_tables, const int32_t *context_lens, int64_t B, int64_t max_blocks,
                    const lp_cascade *cascade, float *out);

/* Whether a context of ctx tokens (at least one) fits its table row of max_blocks entries, each a block of the cache. */
static inline int context_fits(const int32_t *table, long ctx, long max_blocks, long num_blocks) {
    if (ctx < 1 || ctx > max_blocks * 16) return 0;
    for (long blk = 0; blk * 16 < ctx; blk++)
        if (table[blk] < 0 || table[blk] >= num_blocks) return 0;
    return 1;
}

/* Whether sequence b's rows lie inside q and its chunk inside its context: 0 <= cu[b] <= cu[b + 1] <= num_q and
 * q_len <= context_lens[b]. */
static inline int chunk_fits(const int32_t *cu_seqlens_q, const int32_t *context_lens, long b, long num_q) {
    const long start = cu_seqlens_q[b], end = cu_seqlens_q[b + 1];
    return 0 <= start && start <= end && end <= num_q && end - start <= context_lens[b];
}

/* The most tiles of tile_positions queries any sequence's chunk that fits has: at least 1, so that a prefill kernel
 * makes a task for every sequence and reports one that does not fit. */
static inline long most_tiles(const int32_t *cu_seqlens_q, const int32_t *context_lens, long B, long num_q,
                              long tile_positions) {
    long tiles = 1;
    for (long b = 0; b < B; b++) {
        if (!chunk_fits(cu_seqlens_q, context_lens, b, num_q)) continue;
        const long q_tiles = (cu_seqlens_q[b + 1] - cu_seqlens_q[b] + tile_positions - 1) / tile_positions;
        if (q_tiles > tiles) tiles = q_tiles;
    }
    return tiles;
}

#endif
