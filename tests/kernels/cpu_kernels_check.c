/* A self-contained check of the native CPU kernels against plain double-precision loops, for a build where the
 * Python tests cannot run: test_cpu_portable.py compiles it with the portable source for aarch64 and runs it under
 * qemu-aarch64, and natively with each path this CPU runs (so a wrong expected value here fails there too).
 * Prints one line per failed case and exits 1 if any failed. Inputs come from a fixed LCG: the same on every run. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpu_kernels.h"

static unsigned long long lcg_state = 12345;
static unsigned next_u32(void) {
    lcg_state = lcg_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (unsigned)(lcg_state >> 33);
}
static float uniform(void) { return (float)(next_u32() % 100000) / 50000.0f - 1.0f; } /* [-1, 1) */

static int failures = 0;

static void expect_close(const char *what, int a, int b, const float *out, const double *ref, long n, double tol) {
    double err = 0, top = 1e-30;
    for (long i = 0; i < n; i++) {
        if (!isfinite(out[i])) err = INFINITY;
        err = fmax(err, fabs(out[i] - ref[i]));
        top = fmax(top, fabs(ref[i]));
    }
    if (!(err / top < tol)) {
        printf("FAIL %s (%d, %d): relative error %.3g\n", what, a, b, err / top);
        failures++;
    }
}

/* qgemm of M rows against N x K weights q in [low, high), scale and (if with_min) min per group; pack_q packs them. */
static void check_qgemm(int low, int high, int with_min, int group, long M) {
    const long N = 40, K = 128, tiles = (N + TILE - 1) / TILE, groups = K / group;
    const int shift = low < 0 ? -low : 0, bits = high + shift <= 16 ? 4 : high + shift <= 32 ? 5 : 8;
    const int offset = bits == 8 ? 0 : shift; /* as kernels/cpu.py pack_blocks: 8 bits are stored as they are */
    int8_t *q = malloc(N * K);
    uint8_t *packed = calloc(tiles * K * 2 * bits, 1);
    float *s = calloc(N * groups, sizeof(float)), *m = calloc(N * groups, sizeof(float));
    float *tiled_s = calloc(tiles * groups * TILE, sizeof(float)), *tiled_m = calloc(tiles * groups * TILE, sizeof(float));
    float *x = malloc(M * K * sizeof(float)), *y = malloc(M * tiles * TILE * sizeof(float));
    double *ref = calloc(M * N, sizeof(double));
    float *got = malloc(M * N * sizeof(float));
    for (long i = 0; i < N * K; i++) q[i] = (int8_t)(low + (int)(next_u32() % (unsigned)(high - low)));
    for (long i = 0; i < N * groups; i++) s[i] = (uniform() + 1.0f) * 0.01f, m[i] = with_min ? uniform() * 0.1f : 0.0f;
    for (long i = 0; i < M * K; i++) x[i] = uniform();
    for (long n = 0; n < N; n++)
        for (long g = 0; g < groups; g++) {
            tiled_s[(n / TILE * groups + g) * TILE + n % TILE] = s[n * groups + g];
            tiled_m[(n / TILE * groups + g) * TILE + n % TILE] = m[n * groups + g];
        }
    for (long r = 0; r < M; r++)
        for (long n = 0; n < N; n++)
            for (long k = 0; k < K; k++) {
                const float w = s[n * groups + k / group] * (float)q[n * K + k]; /* rounded, then + min, rounded */
                ref[r * N + n] += (double)x[r * K + k] * (double)(w + m[n * groups + k / group]);
            }
    int status = lp_pack_q(q, N, K, bits, offset, packed);
    status |= lp_qgemm(x, M, K, (const int8_t *)packed, tiled_s, with_min ? tiled_m : NULL, tiles * TILE, bits, offset,
                       group, y);
    for (long r = 0; r < M; r++)
        for (long n = 0; n < N; n++) got[r * N + n] = y[r * tiles * TILE + n];
    if (status != LP_OK) printf("FAIL qgemm status %d\n", status), failures++;
    expect_close("qgemm (bits, rows)", bits, (int)M, got, ref, M * N, 1e-5);
    free(q), free(packed), free(s), free(m), free(tiled_s), free(tiled_m), free(x), free(y), free(ref), free(got);
}

/* Paged decode of two sequences over a block pool whose blocks are handed out in reverse; D = 24 is 8 but not 16. */
static void check_paged_decode(void) {
    enum { B = 2, KVH = 2, G = 3, H = KVH * G, D = 24, BLOCKS = 6, MAX_BLOCKS = 3 };
    const int32_t lens[B] = {5, 37}, tables[B][MAX_BLOCKS] = {{5, 0, 0}, {4, 3, 2}};
    static float k[BLOCKS * 16 * KVH * D], v[BLOCKS * 16 * KVH * D], q[B * H * D], out[B * H * D];
    static double ref[B * H * D];
    for (long i = 0; i < BLOCKS * 16 * KVH * D; i++) k[i] = uniform(), v[i] = uniform();
    for (long i = 0; i < B * H * D; i++) q[i] = uniform();
    const float scale = 1.0f / sqrtf((float)D);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            double p[48], mx = -INFINITY, total = 0;
            for (int t = 0; t < lens[b]; t++) {
                const float *kr = k + (((long)tables[b][t / 16] * 16 + t % 16) * KVH + h / G) * D;
                p[t] = 0;
                for (int d = 0; d < D; d++) p[t] += (double)q[(b * H + h) * D + d] * kr[d];
                p[t] *= scale;
                mx = fmax(mx, p[t]);
            }
            for (int t = 0; t < lens[b]; t++) total += p[t] = exp(p[t] - mx);
            for (int d = 0; d < D; d++) {
                double o = 0;
                for (int t = 0; t < lens[b]; t++)
                    o += p[t] * v[(((long)tables[b][t / 16] * 16 + t % 16) * KVH + h / G) * D + d];
                ref[(b * H + h) * D + d] = o / total;
            }
        }
    const int status = lp_paged_decode(q, k, v, &tables[0][0], lens, B, H, KVH, D, MAX_BLOCKS, BLOCKS, scale, out);
    if (status != LP_OK) printf("FAIL paged_decode status %d\n", status), failures++;
    expect_close("paged_decode", B, D, out, ref, B * H * D, 1e-5);
}

/* add_rms_norm, silu_mul and rope_write_kv on a few rows. */
static void check_row_kernels(void) {
    enum { M = 3, D = 32, HEADS = 2, KVH = 1, WIDTH = (HEADS + 2 * KVH) * D };
    static float x[M * D], res[M * D], w[D], sum[M * D], out[M * D], gate_up[M * 2 * D], qkv[M * WIDTH];
    static float cs[M * D / 2], sn[M * D / 2], k_cache[16 * KVH * D], v_cache[16 * KVH * D], q_out[M * HEADS * D];
    static double ref[M * 2 * D], ref_k[M * KVH * D];
    const int64_t slots[M] = {3, -1, 9};
    for (long i = 0; i < M * D; i++) x[i] = uniform(), res[i] = uniform();
    for (long i = 0; i < D; i++) w[i] = uniform();
    for (long i = 0; i < M * 2 * D; i++) gate_up[i] = uniform() * 40.0f; /* into both tails of silu */
    for (long i = 0; i < M * WIDTH; i++) qkv[i] = uniform();
    for (long i = 0; i < M * D / 2; i++) cs[i] = cosf((float)i), sn[i] = sinf((float)i);

    int status = lp_add_rms_norm(x, res, w, M, D, 1e-5f, sum, out);
    for (int r = 0; r < M; r++) {
        double sq = 0;
        for (int d = 0; d < D; d++) sq += ((double)x[r * D + d] + res[r * D + d]) * ((double)x[r * D + d] + res[r * D + d]);
        for (int d = 0; d < D; d++) ref[r * D + d] = ((double)x[r * D + d] + res[r * D + d]) / sqrt(sq / D + 1e-5) * w[d];
    }
    expect_close("add_rms_norm", M, D, out, ref, M * D, 1e-5);

    status |= lp_silu_mul(gate_up, M, D, out);
    for (int r = 0; r < M; r++)
        for (int i = 0; i < D; i++) {
            const double g = gate_up[r * 2 * D + i];
            ref[r * D + i] = g / (1.0 + exp(-g)) * gate_up[r * 2 * D + D + i];
        }
    expect_close("silu_mul", M, D, out, ref, M * D, 1e-5);

    status |= lp_rope_write_kv(qkv, cs, sn, slots, M, HEADS, KVH, D, 16, k_cache, v_cache, q_out);
    for (int n = 0; n < M; n++)
        for (int h = 0; h < HEADS + KVH; h++)
            for (int i = 0; i < D / 2; i++) {
                const double x1 = qkv[n * WIDTH + h * D + i], x2 = qkv[n * WIDTH + h * D + D / 2 + i];
                const double c = cs[n * D / 2 + i], s = sn[n * D / 2 + i];
                double *dst = h < HEADS ? ref + (n * HEADS + h) * D : ref_k + (n * KVH + h - HEADS) * D;
                dst[i] = x1 * c - x2 * s, dst[D / 2 + i] = x2 * c + x1 * s;
            }
    expect_close("rope_write_kv q", M, D, q_out, ref, M * HEADS * D, 1e-6);
    for (int n = 0; n < M; n++) {
        if (slots[n] < 0) continue;
        expect_close("rope_write_kv k", n, D, k_cache + slots[n] * KVH * D, ref_k + n * KVH * D, KVH * D, 1e-6);
        for (int i = 0; i < KVH * D; i++) ref_k[n * KVH * D + i] = qkv[n * WIDTH + (HEADS + KVH) * D + i];
        expect_close("rope_write_kv v", n, D, v_cache + slots[n] * KVH * D, ref_k + n * KVH * D, KVH * D, 1e-7);
    }
    if (status != LP_OK) printf("FAIL row kernels status %d\n", status), failures++;
}

int main(void) {
    if (lp_abi_version() != LP_ABI_VERSION) printf("FAIL abi version %d\n", lp_abi_version()), failures++;
    const int ranges[][3] = {{0, 16, 1}, {-8, 8, 0}, {0, 32, 1}, {-16, 16, 0}, {-128, 128, 0}}; /* Q4_1 Q4_0 Q5_1 Q5_0 Q8_0 */
    const long rows[] = {1, 2, 5, 13};
    for (int r = 0; r < 5; r++)
        for (int group = 16; group <= 32; group += 16)
            for (int i = 0; i < 4; i++) check_qgemm(ranges[r][0], ranges[r][1], ranges[r][2], group, rows[i]);
    check_paged_decode();
    check_row_kernels();
    printf(failures ? "%d checks failed\n" : "all kernel checks passed\n", failures);
    return failures != 0;
}
