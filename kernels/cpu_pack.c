/* lp_pack_q, lp_unpack_gguf and lp_dequantize_gguf, plain C: every path's library (AVX2, AVX-512, portable) is built
 * with them, since the tile layout lp_pack_q writes (described in cpu_qgemm.h) is what all their qgemm kernels read,
 * and unpacking a file's blocks is a load's work (and a step's few embedding rows), not a hot loop's. */
#include <stdint.h>

#include "cpu_kernels.h"
#include "cpu_scales.h" /* half_to_float */

/* Row j's value in column k of tile t, plus offset; rows past N (padding up to a whole tile) hold 0 + offset. */
static inline int value(const int8_t *q, int64_t N, int64_t K, long t, long k, int j, int offset) {
    return (t * TILE + j < N ? q[(t * TILE + j) * K + k] : 0) + offset;
}

/* q [N, K] int8, row-major (a GGUF tensor's rows, unpacked) -> out: the tiles of the layout in cpu_qgemm.h, 2 * bits
 * bytes per tile column. One pass, in place of a dozen torch ops over the whole weight, which made packing a large
 * share of a model's load (benchmarks/gguf_load.py times a start). 4 and 5 bits need an even K (columns go in
 * pairs), 6 bits a multiple of 8. */
int lp_pack_q(const int8_t *q, int64_t N, int64_t K, int bits, int offset, uint8_t *out) {
    if (!packed_bits(bits) || N < 0 || K < 0 || (bits != 8 && K % 2) || (bits == 6 && K % 8)) return LP_BAD_ARGUMENT;
    const long tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < tiles; t++) {
        uint8_t *o = out + t * K * 2 * bits;
        for (long k = 0; k < K; k++) {
            if (bits == 8) {
                for (int j = 0; j < TILE; j++) o[k * TILE + j] = (uint8_t)value(q, N, K, t, k, j, offset);
                continue;
            }
            if (k % 2 == 0)
                for (int j = 0; j < TILE; j++)
                    o[k * TILE / 2 + j] = (uint8_t)((value(q, N, K, t, k, j, offset) & 15) |
                                                    (value(q, N, K, t, k + 1, j, offset) & 15) << 4);
            if (bits == 5) {
                unsigned word = 0;
                for (int j = 0; j < TILE; j++) word |= (unsigned)((value(q, N, K, t, k, j, offset) >> 4) & 1) << j;
                o[K * TILE / 2 + 2 * k] = (uint8_t)word;
                o[K * TILE / 2 + 2 * k + 1] = (uint8_t)(word >> 8);
            }
            if (bits == 6 && k % 8 == 0)
                for (int j = 0; j < TILE; j++) {
                    unsigned word = 0;
                    for (int c = 0; c < 8; c++)
                        word |= (unsigned)((value(q, N, K, t, k + c, j, offset) >> 4) & 3) << 2 * c;
                    uint8_t *at = o + K * TILE / 2 + (k / 8 * TILE + j) * 2;
                    at[0] = (uint8_t)word, at[1] = (uint8_t)(word >> 8);
                }
        }
    }
    return LP_OK;
}

/* GGUF block types lp_unpack_gguf reads, numbered as the GGUF format numbers them (ggml_type). */
enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q5_0 = 6, GGUF_Q5_1 = 7, GGUF_Q8_0 = 8, GGUF_Q4_K = 12, GGUF_Q5_K = 13,
       GGUF_Q6_K = 14 };

static inline uint16_t half_bits(const uint8_t *half) { return (uint16_t)(half[0] | half[1] << 8); }

/* Q4_K/Q5_K's twelve bytes of 6-bit sub-block scales and mins (ggml's get_scale_min_k4). */
static void k_scales(const uint8_t *s, int8_t *sc, int8_t *mn) {
    for (int i = 0; i < 4; i++) {
        sc[i] = (int8_t)(s[i] & 63);
        mn[i] = (int8_t)(s[4 + i] & 63);
        sc[4 + i] = (int8_t)((s[8 + i] & 15) | ((s[i] >> 2) & 0x30));
        mn[4 + i] = (int8_t)((s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30));
    }
}

/* The sizes of a GGUF block of ``type``: its bytes, its weights and its scale multipliers (0: a type not read here). */
static int block_sizes(int type, int *size, int *weights, int *subs) {
    switch (type) {
    case GGUF_Q4_0: *size = 18, *weights = 32, *subs = 1; return 1;
    case GGUF_Q4_1: *size = 20, *weights = 32, *subs = 1; return 1;
    case GGUF_Q5_0: *size = 22, *weights = 32, *subs = 1; return 1;
    case GGUF_Q5_1: *size = 24, *weights = 32, *subs = 1; return 1;
    case GGUF_Q8_0: *size = 34, *weights = 32, *subs = 1; return 1;
    case GGUF_Q4_K: *size = 144, *weights = 256, *subs = 8; return 1;
    case GGUF_Q5_K: *size = 176, *weights = 256, *subs = 8; return 1;
    case GGUF_Q6_K: *size = 210, *weights = 256, *subs = 16; return 1;
    default: return 0;
    }
}

/* One block x of ``type`` (size bytes) -> its weights' integers w, fp16 unit and min_unit, multipliers m and mm. */
static void unpack_block(int type, const uint8_t *x, int size, int8_t *w, uint16_t *unit, int8_t *m,
                         uint16_t *min_unit, int8_t *mm) {
    if (type == GGUF_Q4_K || type == GGUF_Q5_K) {
        /* dmin negated: its sign bit flipped, as numpy's negation of a float16 gives it (-0 included) */
        *unit = half_bits(x), *min_unit = half_bits(x + 2) ^ 0x8000;
        k_scales(x + 4, m, mm);
        const uint8_t *nib = x + size - 128, *high = x + 16; /* Q5_K: bit r of high[j] is run r's weight j */
        for (int run = 0; run < 8; run++)
            for (int j = 0; j < 32; j++) {
                int v = (nib[run / 2 * 32 + j] >> (run % 2 * 4)) & 15;
                if (type == GGUF_Q5_K) v |= ((high[j] >> run) & 1) << 4;
                w[run * 32 + j] = (int8_t)v;
            }
    } else if (type == GGUF_Q6_K) {
        const uint8_t *low = x, *high = x + 128;
        *unit = half_bits(x + 208), *min_unit = 0;
        for (int s = 0; s < 16; s++) m[s] = (int8_t)x[192 + s], mm[s] = 0;
        for (int half = 0; half < 2; half++)
            for (int r = 0; r < 128; r++) { /* 128 weights a half: 4 runs of 32, ggml's dequantize_row_q6_K */
                int nibble = (low[half * 64 + r % 64] >> (r / 64 * 4)) & 15;
                int crumb = (high[half * 32 + r % 32] >> (r / 32 * 2)) & 3;
                w[half * 128 + r] = (int8_t)((nibble | crumb << 4) - 32);
            }
    } else {
        const int with_min = type == GGUF_Q4_1 || type == GGUF_Q5_1;
        *unit = half_bits(x), *min_unit = with_min ? half_bits(x + 2) : 0;
        m[0] = 1, mm[0] = (int8_t)with_min;
        const uint8_t *body = x + (with_min ? 4 : 2);
        if (type == GGUF_Q8_0) {
            for (int j = 0; j < 32; j++) w[j] = (int8_t)body[j];
        } else if (type == GGUF_Q4_0 || type == GGUF_Q4_1) {
            const int centre = type == GGUF_Q4_0 ? 8 : 0;
            for (int j = 0; j < 32; j++) w[j] = (int8_t)(((body[j % 16] >> (j / 16 * 4)) & 15) - centre);
        } else { /* Q5_0, Q5_1: 32 high bits as a little-endian word, then the nibbles */
            const uint32_t bits = body[0] | body[1] << 8 | body[2] << 16 | (uint32_t)body[3] << 24;
            const int centre = type == GGUF_Q5_0 ? 16 : 0;
            for (int j = 0; j < 32; j++)
                w[j] = (int8_t)((((body[4 + j % 16] >> (j / 16 * 4)) & 15) | ((bits >> j) & 1) << 4) - centre);
        }
    }
}

/* ``blocks`` consecutive GGUF blocks of ``type`` -> their weights' integers and scale factors, as
 * models/gguf_weights.py's numpy ``unpack`` gives them (the reference, and the path where this library is absent):
 * q [blocks * W] (W = 256 for a K type, 32 otherwise), one fp16 unit and min_unit per block, and S multipliers
 * per block in mult and min_mult (8 for Q4_K/Q5_K, 16 for Q6_K, 1 otherwise). A min is stored negated where the
 * type subtracts it (K types' dmin), so every weight is unit * mult * q + min_unit * min_mult. One pass over the
 * file's bytes, in place of numpy's dozen passes over each tensor that made unpacking most of a model's load. */
int lp_unpack_gguf(int type, const uint8_t *raw, int64_t blocks, int8_t *q, uint16_t *unit, int8_t *mult,
                   uint16_t *min_unit, int8_t *min_mult) {
    int size, weights, subs;
    if (!block_sizes(type, &size, &weights, &subs) || blocks < 0) return LP_BAD_ARGUMENT;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        unpack_block(type, raw + b * size, size, q + b * weights, unit + b, mult + b * subs, min_unit + b,
                     min_mult + b * subs);
    return LP_OK;
}

/* ``blocks`` consecutive GGUF blocks of ``type`` -> their weights in float32, out [blocks * W]: BlockQuantized's
 * dequantize of lp_unpack_gguf's factors to the bit (scale = unit * mult and min = min_unit * min_mult, each a
 * float32 product; a weight is scale * q, rounded, plus min). For a step's token embeddings: a few rows in one call,
 * where the same in torch was a dozen small ops, each slower than this whole pass. */
int lp_dequantize_gguf(int type, const uint8_t *raw, int64_t blocks, float *out) {
    int size, weights, subs;
    if (!block_sizes(type, &size, &weights, &subs) || blocks < 0) return LP_BAD_ARGUMENT;
    for (int64_t b = 0; b < blocks; b++) {
        int8_t w[256], m[16], mm[16];
        uint16_t unit, min_unit;
        unpack_block(type, raw + b * size, size, w, &unit, m, &min_unit, mm);
        const float u = half_to_float(unit), mu = half_to_float(min_unit);
        float scale[16], minimum[16];
        for (int s = 0; s < subs; s++) scale[s] = u * (float)m[s], minimum[s] = mu * (float)mm[s];
        for (int i = 0; i < weights; i++) {
            const int s = i / (weights / subs);
            /* volatile: the product rounded before the sum, as torch computes it, whatever the build's contraction */
            volatile float product = scale[s] * (float)w[i];
            out[b * weights + i] = product + minimum[s];
        }
    }
    return LP_OK;
}
