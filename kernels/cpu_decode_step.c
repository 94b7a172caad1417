/* lp_llama_decode, plain C: a Llama decode step's decoder layers in one call from Python, built into every path's
 * library (it only calls that library's own kernels, in the order models/llama.py composes them).
 *
 * Why: a decode step of one chat on the default model (30 layers) is hundreds of kernel calls, and each one through
 * the model's modules costs Python (module dispatch, argument checks, ctypes, output tensors) on top of its
 * arithmetic, a sizeable share of a small model's step (benchmarks/cpu_kernel_bench.py --decode-step times both
 * ways). Here the pointers and sizes of every layer are prepared once (localpaged/models/llama_cpu_decode.py, beside
 * the model it mirrors, builds the lp_llama below when the runner binds the KV cache), and one call runs them all,
 * the CPU counterpart of a CUDA graph. Each step is the very kernel the module path calls, on the same inputs, so
 * the hidden states are bit for bit the same.
 */
#include <stdlib.h>

#include "cpu_kernels.h"

static int project(const lp_projection *w, const float *x, int64_t M, int64_t K, float *y) {
    switch (w->activations) {
        case LP_ACT_INT8: return lp_qgemm_int8(x, M, K, w->q, &w->scales, w->rows, w->bits, w->offset, w->group, y);
        case LP_ACT_INT16: return lp_qgemm_int16(x, M, K, w->q, &w->scales, w->rows, w->bits, w->offset, w->group, y);
        case LP_ACT_F32: return lp_qgemm(x, M, K, w->q, &w->scales, w->rows, w->bits, w->offset, w->group, y);
    }
    return LP_BAD_ARGUMENT;
}

/* What one layer's sizes must be for the buffers below: every projection's rows its output's width. */
static int sizes_agree(const lp_llama *m, const lp_decoder_layer *layer) {
    const int64_t attention = m->num_heads * m->head_dim, qkv = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    return layer->qkv.rows == qkv && layer->o.rows == m->hidden && layer->gate_up.rows == 2 * m->intermediate &&
           layer->down.rows == m->hidden && attention > 0;
}

/* qkv [B, width] += bias [width], row by row: BlockLinear's `out + bias`, one float add an element. */
static void add_bias(float *qkv, const float *bias, int64_t B, int64_t width) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < width; i++) qkv[b * width + i] += bias[i];
}

/* Every head of q and k in qkv [B, (H + 2 KVH) * D] RMS-normalised in place (LlamaAttention.norm_heads), v as it is;
 * scratch holds H * D floats. */
static int norm_heads(const lp_decoder_layer *layer, float *qkv, int64_t B, int64_t H, int64_t KVH, int64_t D,
                      float eps, float *scratch) {
    const int64_t width = (H + 2 * KVH) * D;
    int status = LP_OK;
    for (int64_t b = 0; b < B && status == LP_OK; b++) {
        float *q = qkv + b * width, *k = q + H * D;
        status = lp_add_rms_norm(q, NULL, layer->q_norm, H, D, eps, scratch, q);
        if (status == LP_OK) status = lp_add_rms_norm(k, NULL, layer->k_norm, KVH, D, eps, scratch, k);
    }
    return status;
}

/* x [B, hidden]: the embedded tokens, one per sequence. out [B, hidden]: the final norm of the last layer's
 * residual stream (what LlamaForCausalLM.forward returns). Each sequence's new K and V go to slots[b] (-1: nowhere);
 * it attends over context_lens[b] tokens through its row of block_tables [B, max_blocks], groups of sequences
 * sharing leading blocks as `cascade` (NULL: none) has them, in every layer. cos and sin hold
 * [B, rotary_dim / 2] values. LP_OK, or the first status a kernel returned (the output is then incomplete). */
int lp_llama_decode(const lp_llama *m, const float *x, const float *cos, const float *sin, const int64_t *slots,
                    const int32_t *block_tables, const int32_t *context_lens, int64_t B, int64_t max_blocks,
                    const lp_cascade *cascade, float *out) {
    if (B < 0 || m->num_layers < 1 || m->hidden <= 0 || m->intermediate <= 0 || m->num_kv_heads <= 0 ||
        m->num_heads % m->num_kv_heads)
        return LP_BAD_ARGUMENT;
    for (int64_t i = 0; i < m->num_layers; i++)
        if (!sizes_agree(m, &m->layers[i])) return LP_BAD_ARGUMENT;
    const int64_t D = m->head_dim, H = m->num_heads, KVH = m->num_kv_heads, hidden = m->hidden, I = m->intermediate;
    const int64_t qkv_width = (H + 2 * KVH) * D;
    /* residual, normed, sublayer output, qkv, rotated q, attention, gate_up, activation */
    const int64_t floats = B * (3 * hidden + qkv_width + 2 * H * D + 3 * I);
    float *buffer = malloc((floats > 0 ? floats : 1) * sizeof(float));
    if (!buffer) return LP_OUT_OF_MEMORY;
    float *residual = buffer, *normed = residual + B * hidden, *y = normed + B * hidden, *qkv = y + B * hidden;
    float *q = qkv + B * qkv_width, *attention = q + B * H * D, *gate_up = attention + B * H * D, *act = gate_up + 2 * B * I;
    int status = LP_OK;
    for (int64_t i = 0; i < m->num_layers && status == LP_OK; i++) {
        const lp_decoder_layer *layer = &m->layers[i];
        /* The first layer's residual stream is the embeddings themselves. */
        status = i == 0 ? lp_add_rms_norm(x, NULL, layer->input_norm, B, hidden, m->eps, residual, normed)
                        : lp_add_rms_norm(y, residual, layer->input_norm, B, hidden, m->eps, residual, normed);
        if (status == LP_OK) status = project(&layer->qkv, normed, B, hidden, qkv);
        if (status == LP_OK && layer->qkv_bias) add_bias(qkv, layer->qkv_bias, B, qkv_width);
        /* the attention buffer is free until the attention writes it */
        if (status == LP_OK && layer->q_norm) status = norm_heads(layer, qkv, B, H, KVH, D, m->eps, attention);
        if (status == LP_OK)
            status = lp_rope_write_kv(qkv, cos, sin, slots, B, H, KVH, D, m->rotary_dim, m->num_blocks * 16,
                                      layer->k_cache, layer->v_cache, m->kv_dtype, q);
        if (status == LP_OK)
            status = lp_paged_decode(q, layer->k_cache, layer->v_cache, m->kv_dtype, block_tables, context_lens, B, H,
                                     KVH, D, max_blocks, m->num_blocks, m->scale, cascade, attention);
        if (status == LP_OK) status = project(&layer->o, attention, B, H * D, y);
        if (status == LP_OK)
            status = lp_add_rms_norm(y, residual, layer->post_attention_norm, B, hidden, m->eps, residual, normed);
        if (status == LP_OK) status = project(&layer->gate_up, normed, B, hidden, gate_up);
        if (status == LP_OK) status = lp_silu_mul(gate_up, B, I, act);
        if (status == LP_OK) status = project(&layer->down, act, B, I, y);
    }
    if (status == LP_OK) status = lp_add_rms_norm(y, residual, m->final_norm, B, hidden, m->eps, residual, out);
    free(buffer);
    return status;
}
