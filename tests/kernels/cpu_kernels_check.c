/* A self-contained check of the native CPU kernels against plain double-precision loops, for a build where the
 * Python tests cannot run: test_cpu_isa.py compiles it with the portable source for aarch64 and runs it under
 * qemu-aarch64, and natively with each path this CPU runs (so a wrong expected value here fails there too).
 * 16-bit caches are checked against the compiler's own conversions (_Float16, GCC 12+: hardware on AArch64) and a
 * rounding written out in doubles for bf16. Prints one line per failed case and exits 1 if any failed. Inputs come
 * from a fixed LCG: the same on every run. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_scales.h" /* half_to_float */

static unsigned long long lcg_state = 12345;
static unsigned next_u32(void) {
    lcg_state = lcg_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (unsigned)(lcg_state >> 33);
}
static float uniform(void) { return (float)(next_u32() % 100000) / 50000.0f - 1.0f; } /* [-1, 1) */

static int failures = 0;

static float float_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static uint32_t bits_of_float(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The magnitude an fp32 bit pattern (sign clear) stands for, in a double; exponent 255 as 2^128 and up. */
static double magnitude_of(uint32_t u) {
    const int e = (int)(u >> 23);
    const uint32_t m = u & 0x7FFFFFu;
    return e ? ldexp((double)(0x800000u | m), e - 150) : ldexp((double)m, -149);
}

/* 16-bit cache values as references: bits of x rounded to nearest even, and bits widened, for LP_KV_BF16 or F16.
 * bf16 takes the nearer of the bf16 magnitudes around |x| (their difference exact in doubles), ties to the even. */
static uint16_t ref_narrow(int kv_dtype, float x) {
    if (kv_dtype == LP_KV_F16) {
        const _Float16 h = (_Float16)x;
        uint16_t b;
        memcpy(&b, &h, sizeof b);
        return b;
    }
    const uint32_t u = bits_of_float(x), below = u & 0x7FFF0000u, above = below + 0x10000u;
    if (isnan(x)) return 0x7FC0;
    if (isinf(x)) return (uint16_t)(u >> 16);
    const double ax = fabs((double)x), down = ax - magnitude_of(below), up = magnitude_of(above) - ax;
    const uint32_t rounded = up < down || (up == down && (below >> 16 & 1)) ? above : below;
    return (uint16_t)((u >> 16 & 0x8000u) | rounded >> 16);
}
static float ref_widen(int kv_dtype, uint16_t b) {
    if (kv_dtype == LP_KV_BF16) return float_of_bits((uint32_t)b << 16);
    _Float16 h;
    memcpy(&h, &b, sizeof h);
    return (float)h;
}

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

/* qgemm of M rows against N x K weights q in [low, high), and per group a scale and (if with_min) a min, each an
 * fp16 unit times an int8 (lp_scales, one unit a group); pack_q packs them. */
static void check_qgemm(int low, int high, int with_min, int group, long M) {
    const long N = 40, K = 128, tiles = (N + TILE - 1) / TILE, groups = K / group;
    const int shift = low < 0 ? -low : 0, bits = high + shift <= 16 ? 4 : high + shift <= 32 ? 5 : 8;
    const int offset = bits == 8 ? 0 : shift; /* as kernels/cpu.py pack_blocks: 8 bits are stored as they are */
    int8_t *q = malloc(N * K);
    uint8_t *packed = calloc(tiles * K * 2 * bits, 1);
    float *s = calloc(N * groups, sizeof(float)), *m = calloc(N * groups, sizeof(float));
    uint16_t *unit = calloc(tiles * groups * TILE, 2), *min_unit = calloc(tiles * groups * TILE, 2);
    int8_t *mult = calloc(tiles * groups * TILE, 1), *min_mult = calloc(tiles * groups * TILE, 1);
    float *x = malloc(M * K * sizeof(float)), *y = malloc(M * tiles * TILE * sizeof(float));
    double *ref = calloc(M * N, sizeof(double));
    float *got = malloc(M * N * sizeof(float));
    for (long i = 0; i < N * K; i++) q[i] = (int8_t)(low + (int)(next_u32() % (unsigned)(high - low)));
    for (long n = 0; n < N; n++)
        for (long g = 0; g < groups; g++) {
            const long at = (n / TILE * groups + g) * TILE + n % TILE;
            unit[at] = (uint16_t)(8 << 10 | next_u32() % 1024); /* 2^-7 .. 2^-6 */
            mult[at] = (int8_t)(1 + next_u32() % 8);
            if (with_min) {
                min_unit[at] = (uint16_t)(0x8000 | 6 << 10 | next_u32() % 1024); /* -2^-9 .. -2^-8 */
                min_mult[at] = (int8_t)(next_u32() % 16);
            }
            s[n * groups + g] = half_to_float(unit[at]) * (float)mult[at];
            m[n * groups + g] = half_to_float(min_unit[at]) * (float)min_mult[at];
        }
    const lp_scales scales = {unit, mult, with_min ? min_unit : NULL, with_min ? min_mult : NULL, 1};
    for (long i = 0; i < M * K; i++) x[i] = uniform();
    for (long r = 0; r < M; r++)
        for (long n = 0; n < N; n++)
            for (long k = 0; k < K; k++) {
                const float w = s[n * groups + k / group] * (float)q[n * K + k]; /* rounded, then + min, rounded */
                ref[r * N + n] += (double)x[r * K + k] * (double)(w + m[n * groups + k / group]);
            }
    int status = lp_pack_q(q, N, K, bits, offset, packed);
    status |= lp_qgemm(x, M, K, (const int8_t *)packed, &scales, tiles * TILE, bits, offset, group, y);
    for (long r = 0; r < M; r++)
        for (long n = 0; n < N; n++) got[r * N + n] = y[r * tiles * TILE + n];
    if (status != LP_OK) printf("FAIL qgemm status %d\n", status), failures++;
    expect_close("qgemm (bits, rows)", bits, (int)M, got, ref, M * N, 1e-5);
    /* The same packed weights with x rounded to int16 a group (cpu_qgemm_int16.c: the VNNI kernel where the CPU has
     * it, else plain C): within 2e-4 of the largest output (measured: under 5e-5). */
    status = lp_qgemm_int16(x, M, K, (const int8_t *)packed, &scales, tiles * TILE, bits, offset, group, y);
    for (long r = 0; r < M; r++)
        for (long n = 0; n < N; n++) got[r * N + n] = y[r * tiles * TILE + n];
    if (status != LP_OK) printf("FAIL qgemm_int16 status %d\n", status), failures++;
    expect_close("qgemm_int16 (bits, rows)", bits, (int)M, got, ref, M * N, 2e-4);
    /* The same product with x rounded to int8 a group (cpu_qgemm_int8.c: the VNNI kernel where the CPU has it, else
     * plain C), packed in quads of 4 or else 8 bits: within 2% of the largest output (measured: under 1%). */
    const int quad_bits = high + shift <= 16 ? 4 : 8;
    uint8_t *quads = calloc(tiles * K * 2 * quad_bits, 1);
    status = lp_pack_quads(q, N, K, quad_bits, shift, quads);
    status |= lp_qgemm_int8(x, M, K, (const int8_t *)quads, &scales, tiles * TILE, quad_bits, shift, group, y);
    for (long r = 0; r < M; r++)
        for (long n = 0; n < N; n++) got[r * N + n] = y[r * tiles * TILE + n];
    if (status != LP_OK) printf("FAIL qgemm_int8 status %d\n", status), failures++;
    expect_close("qgemm_int8 (bits, rows)", quad_bits, (int)M, got, ref, M * N, 2e-2);
    free(quads);
    free(q), free(packed), free(s), free(m), free(unit), free(mult), free(min_unit), free(min_mult);
    free(x), free(y), free(ref), free(got);
}

/* n random K and V values; for a 16-bit cache, stored rounded in k16 and v16, and k, v made the values they hold. */
static void random_cache(int kv_dtype, float *k, float *v, uint16_t *k16, uint16_t *v16, long n) {
    for (long i = 0; i < n; i++) {
        k[i] = uniform(), v[i] = uniform();
        if (kv_dtype == LP_KV_F32) continue;
        k16[i] = ref_narrow(kv_dtype, k[i]), v16[i] = ref_narrow(kv_dtype, v[i]);
        k[i] = ref_widen(kv_dtype, k16[i]), v[i] = ref_widen(kv_dtype, v16[i]);
    }
}

/* One query row's attention in doubles over the first `keys` (at most 48) tokens of a table's blocks, KV head kvh. */
static void reference_attention(const float *q, int kvh, const int32_t *table, int keys, const float *k, const float *v,
                                int KVH, int D, float scale, double *out) {
    double p[48], mx = -INFINITY, total = 0;
    for (int t = 0; t < keys; t++) {
        const float *kr = k + (((long)table[t / 16] * 16 + t % 16) * KVH + kvh) * D;
        p[t] = 0;
        for (int d = 0; d < D; d++) p[t] += (double)q[d] * kr[d];
        p[t] *= scale;
        mx = fmax(mx, p[t]);
    }
    for (int t = 0; t < keys; t++) total += p[t] = exp(p[t] - mx);
    for (int d = 0; d < D; d++) {
        double o = 0;
        for (int t = 0; t < keys; t++) o += p[t] * v[(((long)table[t / 16] * 16 + t % 16) * KVH + kvh) * D + d];
        out[d] = o / total;
    }
}

/* Paged decode of two sequences over a block pool whose blocks are handed out in reverse; D = 24 is 8 but not 16.
 * A 16-bit cache holds the random values rounded; the reference reads them widened. */
static void check_paged_decode(int kv_dtype) {
    enum { B = 2, KVH = 2, G = 3, H = KVH * G, D = 24, BLOCKS = 6, MAX_BLOCKS = 3, CACHE = BLOCKS * 16 * KVH * D };
    const int32_t lens[B] = {5, 37}, tables[B][MAX_BLOCKS] = {{5, 0, 0}, {4, 3, 2}};
    static float k[CACHE], v[CACHE], q[B * H * D], out[B * H * D];
    static uint16_t k16[CACHE], v16[CACHE];
    static double ref[B * H * D];
    random_cache(kv_dtype, k, v, k16, v16, CACHE);
    for (long i = 0; i < B * H * D; i++) q[i] = uniform();
    const float scale = 1.0f / sqrtf((float)D);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            reference_attention(q + (b * H + h) * D, h / G, tables[b], lens[b], k, v, KVH, D, scale, ref + (b * H + h) * D);
    const void *kc = kv_dtype == LP_KV_F32 ? (const void *)k : k16, *vc = kv_dtype == LP_KV_F32 ? (const void *)v : v16;
    const int status =
        lp_paged_decode(q, kc, vc, kv_dtype, &tables[0][0], lens, B, H, KVH, D, MAX_BLOCKS, BLOCKS, scale, NULL, out);
    if (status != LP_OK) printf("FAIL paged_decode status %d\n", status), failures++;
    expect_close("paged_decode (kv type, D)", kv_dtype, D, out, ref, B * H * D, 1e-5);
}

/* Chunked prefill of three sequences: a 20-token chunk after a 13-token prefix (it starts mid-block and spans two
 * query tiles), a decode row after 30 tokens, and a whole 7-token prompt; D = 24, blocks handed out in reverse. */
static void check_paged_prefill(int kv_dtype) {
    enum { B = 3, KVH = 2, G = 3, H = KVH * G, D = 24, BLOCKS = 6, MAX_BLOCKS = 3, CACHE = BLOCKS * 16 * KVH * D };
    enum { NUM_Q = 28 };
    const int32_t lens[B] = {33, 31, 7}, cu[B + 1] = {0, 20, 21, 28};
    const int32_t tables[B][MAX_BLOCKS] = {{5, 4, 3}, {2, 1, 0}, {0, 5, 5}};
    static float k[CACHE], v[CACHE], q[NUM_Q * H * D], out[NUM_Q * H * D];
    static uint16_t k16[CACHE], v16[CACHE];
    static double ref[NUM_Q * H * D];
    random_cache(kv_dtype, k, v, k16, v16, CACHE);
    for (long i = 0; i < NUM_Q * H * D; i++) q[i] = uniform();
    const float scale = 1.0f / sqrtf((float)D);
    for (int b = 0; b < B; b++)
        for (int row = cu[b]; row < cu[b + 1]; row++)
            for (int h = 0; h < H; h++) {
                const int keys = lens[b] - (cu[b + 1] - cu[b]) + (row - cu[b]) + 1; /* up to its own position */
                reference_attention(q + (row * H + h) * D, h / G, tables[b], keys, k, v, KVH, D, scale,
                                    ref + (row * H + h) * D);
            }
    const void *kc = kv_dtype == LP_KV_F32 ? (const void *)k : k16, *vc = kv_dtype == LP_KV_F32 ? (const void *)v : v16;
    const int status = lp_paged_prefill(q, kc, vc, kv_dtype, &tables[0][0], cu, lens, NUM_Q, B, H, KVH, D, MAX_BLOCKS,
                                        BLOCKS, scale, NULL, out);
    if (status != LP_OK) printf("FAIL paged_prefill status %d\n", status), failures++;
    expect_close("paged_prefill (kv type, D)", kv_dtype, D, out, ref, NUM_Q * H * D, 1e-5);
}

/* Whether got and want are the same 16-bit value, as bits (a NaN: any NaN), for a cache of kv_dtype. */
static int same_value(int kv_dtype, uint16_t got, uint16_t want) {
    return got == want || (isnan(ref_widen(kv_dtype, got)) && isnan(ref_widen(kv_dtype, want)));
}

/* Every conversion a 16-bit cache makes. Stores: lp_rope_write_kv's V (written as it comes) over random fp32 bit
 * patterns, every 16-bit value, the midpoint to the next (a tie) and the fp32 values either side of each. Loads:
 * every 16-bit pattern as the V of a one-token context (q and K zero, so its weight is exactly 1). */
static void check_kv_conversions(int kv_dtype) {
    enum { D = 64, RANDOM = 1 << 16, NEAR = 6 << 16, N = (RANDOM + NEAR) / D, ALL = 1 << 16, SEQS = ALL / D };
    static float x[N * D], qkv[N * 2 * D], cs[N * D / 2], sn[N * D / 2], q[SEQS * D], out[SEQS * D];
    static uint16_t k_cache[N * D], v_cache[N * D], values[SEQS * 16 * D], zeros[SEQS * 16 * D];
    static int64_t slots[N];
    static int32_t tables[SEQS], lens[SEQS];
    for (long i = 0; i < RANDOM; i++) x[i] = float_of_bits(next_u32() << 1 ^ next_u32());
    for (long b = 0; b < (1 << 16); b++) {
        const float value = ref_widen(kv_dtype, (uint16_t)b), next = ref_widen(kv_dtype, (uint16_t)(b + 1));
        const float tie = (float)(((double)value + next) / 2);
        float *at = x + RANDOM + 6 * b;
        at[0] = value, at[1] = nextafterf(value, INFINITY), at[2] = nextafterf(value, -INFINITY);
        at[3] = tie, at[4] = nextafterf(tie, INFINITY), at[5] = nextafterf(tie, -INFINITY);
    }
    for (long n = 0; n < N; n++) { /* token n: K zeros (rotated by cos 1, sin 0: still zeros), then D values as V */
        memcpy(qkv + n * 2 * D + D, x + n * D, D * sizeof(float));
        slots[n] = n;
    }
    for (long i = 0; i < N * D / 2; i++) cs[i] = 1.0f;
    int status = lp_rope_write_kv(qkv, cs, sn, slots, N, 0, 1, D, D, N, k_cache, v_cache, kv_dtype, NULL);
    int wrong = 0;
    for (long i = 0; i < N * D; i++) {
        if (!same_value(kv_dtype, v_cache[i], ref_narrow(kv_dtype, x[i])) && wrong++ < 3)
            printf("FAIL store (kv type %d) of %a (bits %08x): %04x, not %04x\n", kv_dtype, x[i],
                   bits_of_float(x[i]), v_cache[i], ref_narrow(kv_dtype, x[i]));
    }
    for (long i = 0; i < ALL; i++) values[i / D * 16 * D + i % D] = (uint16_t)i; /* token 0 of block i / D */
    for (long b = 0; b < SEQS; b++) tables[b] = (int32_t)b, lens[b] = 1;
    status |= lp_paged_decode(q, zeros, values, kv_dtype, tables, lens, SEQS, 1, 1, D, 1, SEQS, 1.0f, NULL, out);
    for (long i = 0; i < ALL; i++) {
        const float want = ref_widen(kv_dtype, (uint16_t)i);
        if (!(out[i] == want || (isnan(out[i]) && isnan(want))) && wrong++ < 3)
            printf("FAIL load (kv type %d) of %04lx: %a, not %a\n", kv_dtype, i, out[i], want);
    }
    if (status != LP_OK) printf("FAIL kv conversions status %d\n", status), failures++;
    failures += wrong > 0;
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

    status |= lp_rope_write_kv(qkv, cs, sn, slots, M, HEADS, KVH, D, D, 16, k_cache, v_cache, LP_KV_F32, q_out);
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
    const long rows[] = {1, 2, 4, 5, 13};
    for (int r = 0; r < 5; r++)
        for (int group = 16; group <= 32; group += 16)
            for (int i = 0; i < 5; i++) check_qgemm(ranges[r][0], ranges[r][1], ranges[r][2], group, rows[i]);
    for (int kv_dtype = LP_KV_F32; kv_dtype <= LP_KV_F16; kv_dtype++) {
        check_paged_decode(kv_dtype);
        check_paged_prefill(kv_dtype);
    }
    check_kv_conversions(LP_KV_BF16);
    check_kv_conversions(LP_KV_F16);
    check_row_kernels();
    printf(failures ? "%d checks failed\n" : "all kernel checks passed\n", failures);
    return failures != 0;
}
