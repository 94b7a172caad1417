/* lp_pack_q, plain C: every path's library (AVX2, AVX-512, portable) is built with it, since the tile layout it
 * writes (described in cpu_qgemm.h) is what all their qgemm kernels read. */
#include <stdint.h>

#include "cpu_kernels.h"

/* Row j's value in column k of tile t, plus offset; rows past N (padding up to a whole tile) hold 0 + offset. */
static inline int value(const int8_t *q, int64_t N, int64_t K, long t, long k, int j, int offset) {
    return (t * TILE + j < N ? q[(t * TILE + j) * K + k] : 0) + offset;
}

/* q [N, K] int8, row-major (a GGUF tensor's rows, unpacked) -> out: the tiles of the layout in cpu_qgemm.h, 2 * bits
 * bytes per tile column. One pass, in place of a dozen torch ops over the whole weight, which made packing a large
 * share of a model's load (benchmarks/gguf_load.py times a start). 4 and 5 bits need an even K (columns go in
 * pairs). */
int lp_pack_q(const int8_t *q, int64_t N, int64_t K, int bits, int offset, uint8_t *out) {
    if ((bits != 4 && bits != 5 && bits != 8) || N < 0 || K < 0 || (bits != 8 && K % 2)) return LP_BAD_ARGUMENT;
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
        }
    }
    return LP_OK;
}
