/* The small per-layer steps' scaffolding every path shares: the argument checks and the row loop, rows going to
 * OpenMP threads only when there are many (a parallel region costs more than a short row). Included by each path's
 * source after its add_rms_norm_row and silu_mul_row; lp_argmax_rows, lp_race_rows and lp_nucleus_rows, plain C that
 * each path's flags vectorise. */

#ifndef LP_CPU_ROWS_H
#define LP_CPU_ROWS_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

int lp_add_rms_norm(const float *x, const float *residual, const float *weight, int64_t M, int64_t D, float eps,
                    float *sum, float *out) {
    if (M < 0 || D <= 0 || D % 8) return LP_BAD_ARGUMENT;
#pragma omp parallel for if (M >= 64)
    for (long r = 0; r < M; r++)
        add_rms_norm_row(x + r * D, residual ? residual + r * D : NULL, weight, D, eps, sum + r * D, out + r * D);
    return LP_OK;
}

int lp_silu_mul(const float *gate_up, int64_t M, int64_t I, float *out) {
    if (M < 0 || I <= 0 || I % 8) return LP_BAD_ARGUMENT;
#pragma omp parallel for if (M >= 64)
    for (long r = 0; r < M; r++) silu_mul_row(gate_up + r * 2 * I, gate_up + r * 2 * I + I, I, out + r * I);
    return LP_OK;
}

/* The first index of a row's largest value, or of its first NaN: what torch's max(dim=-1).indices gives (the sampler's
 * greedy pick). One pass in vectors of ARGMAX_LANES columns (GCC's vector extensions, so each path's flags choose the
 * instructions): each lane keeps the largest value it has seen and where it first saw it (a NaN never replaces it),
 * and where it first saw a NaN; the lanes and the last columns are then combined, the lower index winning a tie. A
 * step's logits come fresh from the head's threads; torch's indexed reduction over them took several times longer. */
#define ARGMAX_LANES 16
typedef float argmax_floats __attribute__((vector_size(4 * ARGMAX_LANES)));
typedef int32_t argmax_ints __attribute__((vector_size(4 * ARGMAX_LANES)));

static int64_t argmax_row(const float *x, long n) {
    const long whole = n / ARGMAX_LANES * ARGMAX_LANES;
    argmax_floats lane = (argmax_floats){0} - INFINITY;
    argmax_ints at = (argmax_ints){0} - 1, nan_at = (argmax_ints){0} - 1; /* -1: not seen */
    for (long i = 0; i < whole; i += ARGMAX_LANES) {
        argmax_floats v;
        memcpy(&v, x + i, sizeof v);
        const argmax_ints greater = v > lane, first_nan = (v != v) & (nan_at < 0);
        lane = (argmax_floats)((greater & (argmax_ints)v) | (~greater & (argmax_ints)lane));
        at = (greater & (int32_t)i) | (~greater & at);
        nan_at = (first_nan & (int32_t)i) | (~first_nan & nan_at);
    }
    float best = -INFINITY;
    long best_at = -1, first_nan = -1;
    for (int k = 0; k < ARGMAX_LANES; k++) {
        if (nan_at[k] >= 0 && (first_nan < 0 || nan_at[k] + k < first_nan)) first_nan = nan_at[k] + k;
        if (at[k] >= 0 && (lane[k] > best || (lane[k] == best && at[k] + k < best_at))) best = lane[k], best_at = at[k] + k;
    }
    for (long i = whole; i < n; i++) {
        if (x[i] != x[i] && first_nan < 0) first_nan = i;
        if (x[i] > best) best = x[i], best_at = i;
    }
    if (first_nan >= 0) return first_nan;
    return best_at >= 0 ? best_at : 0; /* nothing above -inf: every value is -inf */
}

int lp_argmax_rows(const float *x, int64_t M, int64_t N, int64_t *out) {
    if (M < 0 || N <= 0 || N > INT32_MAX) return LP_BAD_ARGUMENT;
#pragma omp parallel for if (M > 1) /* a row is a vocabulary long: two already pay for the threads */
    for (long r = 0; r < M; r++) out[r] = argmax_row(x + r * N, N);
    return LP_OK;
}

/* The sampler's draw (sampler.draw_rows, through lp_nucleus_rows): row r's winner is the index i with the largest x[r][i] scale[r] - ln(E_i), E_i
 * = -ln(U_i) exponential, the uniforms U_i made from keys[r] and i. That is torch.multinomial's race (the largest
 * p_i / E_i) in logs, the Gumbel-max form, so a row of logits needs no softmax first; a row's tokens depend on its
 * own key and values alone, whatever else is in the call. The uniforms: SplitMix64's output (Steele, Lea and Flood;
 * Java's SplittableRandom) at counter key + c GAMMA, a counter-based stream that gives any index's bits without the
 * ones before it, its 64 bits two values' 32 (value 2 j the low half of counter j + 1, 2 j + 1 the high). */
/* The build's own vector width: GCC splits a wider one's compares and conversions lane by lane. */
#if defined(__AVX512F__)
#define RACE_LANES 16
#elif defined(__AVX2__)
#define RACE_LANES 8
#else
#define RACE_LANES 4
#endif
typedef float race_floats __attribute__((vector_size(4 * RACE_LANES)));
typedef int32_t race_ints __attribute__((vector_size(4 * RACE_LANES)));
typedef uint32_t race_u32 __attribute__((vector_size(4 * RACE_LANES)));
typedef uint64_t race_u64 __attribute__((vector_size(4 * RACE_LANES))); /* a lane's bits serve two values */

static inline __attribute__((always_inline)) race_floats race_select(race_ints mask, race_floats a, race_floats b) {
    return (race_floats)((mask & (race_ints)a) | (~mask & (race_ints)b));
}

/* ln(v) of each lane, a positive normal float: Cephes' logf, a polynomial on the mantissa in [sqrt(1/2), sqrt(2))
 * less 1. */
static inline __attribute__((always_inline)) race_floats race_log(race_floats v) {
    const race_ints bits = (race_ints)v;
    const race_floats mantissa = (race_floats)((bits & 0x007FFFFF) | 0x3F000000); /* v = mantissa 2^e, in [1/2, 1) */
    const race_ints low = mantissa < 0.70710678f; /* then ln(v) = ln(2 mantissa) + (e - 1) ln 2 */
    const race_floats e = __builtin_convertvector((bits >> 23) - 126, race_floats) -
                            (race_floats)(low & (race_ints)((race_floats){0} + 1.0f));
    const race_floats m = mantissa - 1.0f + (race_floats)(low & (race_ints)mantissa), z = m * m;
    race_floats y = 7.0376836292e-2f * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z - 2.12194440e-4f * e - 0.5f * z;
    return m + y + 0.693359375f * e;
}

/* -ln(E) for the exponentials E = -ln(U) of the uniforms U = 1 - w that 32 random bits make. A small w (a small E:
 * the race's winners) keeps all 32 bits, w = (bits + 1/2) 2^-32, and E = -log1p(-w) is its series (to w^4 / 4: the
 * rest under 2^-26 of it below 2^-8); a larger one keeps the top 24, w = (bits / 2^8 + 1) 2^-24 (at most 1 - 2^-24,
 * so U >= 2^-24), which makes U = 1 - w exact and E = -ln(U) as close as ln's rounding. Only int32s under 2^24 are
 * converted: exact, and a signed conversion, which every instruction set has (AVX2 has no unsigned one). */
static inline __attribute__((always_inline)) race_floats race_gumbel(race_u32 bits) {
    const race_ints small = (race_ints)(bits >> 24) == 0; /* w < 2^-8 */
    const race_floats w = __builtin_convertvector((race_ints)(bits & 0xFFFFFF), race_floats) * 0x1p-32f + 0x1p-33f;
    race_ints top = (race_ints)(bits >> 8) + 1;
    top -= top >> 24; /* 2^24 -> 2^24 - 1 */
    const race_floats u = 1.0f - __builtin_convertvector(top, race_floats) * 0x1p-24f;
    const race_floats series = w + w * w * (0.5f + w * (1.0f / 3.0f + w * 0.25f));
    return -race_log(race_select(small, series, -race_log(u)));
}

#define RACE_GAMMA 0x9E3779B97F4A7C15ull
/* -ln(E) lies between -RACE_LEAST and RACE_MOST: E >= 2^-33 (a w of 2^-33), and E <= -ln(2^-24) = 16.7 */
#define RACE_MOST 24.0f
#define RACE_LEAST 3.0f
#define RACE_GROUP 4 /* blocks of RACE_LANES values one skip test covers */

/* The RACE_LANES values of x from i on (-inf past n). */
static inline __attribute__((always_inline)) race_floats race_values(const float *x, long i, long n) {
    race_floats v;
    if (i + RACE_LANES <= n) memcpy(&v, x + i, sizeof v);
    else
        for (int k = 0; k < RACE_LANES; k++) v[k] = i + k < n ? x[i + k] : -INFINITY;
    return v;
}

/* A row's lanes under way: each lane's best score so far and the block it was in (-1: none). */
typedef struct {
    race_floats best;
    race_ints at;
} RaceLanes;

/* The block of values from i on (i a multiple of RACE_LANES), scored into s's lanes. */
static inline __attribute__((always_inline)) void race_block(const float *x, long i, long n, float scale, uint64_t key,
                                                             RaceLanes *s) {
    race_u64 z;
    for (int k = 0; k < RACE_LANES / 2; k++) z[k] = (uint64_t)(i / 2 + k + 1);
    z = key + z * RACE_GAMMA;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const race_floats score = race_values(x, i, n) * scale + race_gumbel((race_u32)z);
    const race_ints greater = score > s->best;
    s->best = race_select(greater, score, s->best);
    s->at = (greater & (int32_t)i) | (~greater & s->at);
}

/* The largest of a row's values, or NAN where it has a NaN. */
static float race_largest(const float *x, long n) {
    race_floats top = (race_floats){0} - INFINITY;
    race_ints nan = (race_ints){0};
    for (long i = 0; i < n; i += RACE_LANES) {
        const race_floats v = race_values(x, i, n);
        nan |= v != v;
        top = race_select(v > top, v, top);
    }
    float largest = -INFINITY;
    for (int k = 0; k < RACE_LANES; k++) {
        if (nan[k]) return NAN;
        largest = top[k] > largest ? top[k] : largest;
    }
    return largest;
}

/* A row's largest value times scale: NAN where the row has no distribution (a NaN, a +inf after scaling, no value
 * above -inf, or a scale not positive and finite: a temperature of 0, NaN or inf). */
static float race_top(const float *x, long n, float scale) {
    if (!(scale > 0.0f && scale < INFINITY)) return NAN;
    const float largest = race_largest(x, n);
    return largest != largest || largest == -INFINITY || !(largest * scale < INFINITY) ? NAN : largest * scale;
}

/* A row's winner in two passes. The first finds its largest value m: the winner's score is at least m scale -
 * RACE_LEAST, which no value below m scale - RACE_LEAST - RACE_MOST can reach, so the second scores only the groups
 * of blocks that hold a value above that (of a peaked row, few); a value's uniform comes from its index alone, so
 * skipping a block changes no other's, and the winner is the one scoring every value finds. -1 for a NaN, a +inf
 * after scaling, no value above -inf, or a scale not positive and finite. */
static int64_t race_row(const float *x, long n, float scale, uint64_t key) {
    const float top = race_top(x, n, scale);
    if (top != top) return -1;
    const float floor = top - RACE_LEAST - RACE_MOST;
    RaceLanes s = {(race_floats){0} - INFINITY, (race_ints){0} - 1};
    for (long i = 0; i < n; i += RACE_GROUP * RACE_LANES) {
        race_floats most = race_values(x, i, n);
        for (int b = 1; b < RACE_GROUP; b++) {
            const race_floats v = race_values(x, i + b * RACE_LANES, n);
            most = race_select(v > most, v, most);
        }
        const race_ints near = most * scale >= floor;
        int32_t any = 0;
        for (int k = 0; k < RACE_LANES; k++) any |= near[k];
        for (int b = 0; any && b < RACE_GROUP && i + b * RACE_LANES < n; b++)
            race_block(x, i + b * RACE_LANES, n, scale, key, &s);
    }
    float best = -INFINITY;
    long best_at = -1;
    for (int k = 0; k < RACE_LANES; k++) {
        const long at = s.at[k] + k;
        if (s.at[k] >= 0 && (s.best[k] > best || (s.best[k] == best && at < best_at))) best = s.best[k], best_at = at;
    }
    return best_at;
}

int lp_race_rows(const float *x, int64_t M, int64_t N, const float *scale, const int64_t *keys, int64_t *out) {
    if (M < 0 || N <= 0 || N > INT32_MAX) return LP_BAD_ARGUMENT;
#pragma omp parallel for if (M > 1)
    for (long r = 0; r < M; r++) out[r] = race_row(x + r * N, N, scale[r], (uint64_t)keys[r]);
    return LP_OK;
}

/* exp(x) of each lane, x <= 0: 2^(x log2 e) as exp2's polynomial (Cephes' exp2f) on the exponent less its nearest
 * integer, times 2^n through the exponent bits; x is clamped at -87 (e^-87 ~ 1.6e-38 stands for 0). */
static inline __attribute__((always_inline)) race_floats race_exp(race_floats x) {
    x = x * 1.44269504088896341f;
    x = race_select(x < -126.0f, (race_floats){0} - 126.0f, x);
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding and taking it off rounds to the nearest integer */
    const race_floats n = (x + shifter) - shifter, f = x - n;
    race_floats y = 1.535336188319500e-4f * f + 1.339887440266574e-3f;
    y = y * f + 9.618437357674640e-3f;
    y = y * f + 5.550332471162809e-2f;
    y = y * f + 2.402264791363012e-1f;
    y = y * f + 6.931472028550421e-1f;
    y = y * f + 1.0f;
    return y * (race_floats)((__builtin_convertvector(n, race_ints) + 127) << 23);
}


/* The sampler's top-k and top-p draw (sampler.draw_rows): of row r's values x scale[r], the top_k[r] largest (0: all),
 * of those the likeliest that top_p keeps (in descending order, while the weight before a value is at most top_p of
 * theirs: the smallest set reaching it), and among them the race's winner (the largest x scale - ln(E), the uniforms
 * from keys[r] and the token's index as lp_race_rows makes them, one value at a time). The weights are exp(x scale
 * less the largest's); the order is taken among candidates near the largest (nucleus_row), at most NUCLEUS_MOST. */
#define NUCLEUS_RANGE 24.0f
#define NUCLEUS_MOST 2048
#define NUCLEUS_ZERO 128.0f /* exp(-104) is 0 in float32 */

typedef struct {
    float value, weight; /* x scale less the largest's, and its exp */
    int32_t at;
} NucleusCandidate;

static int nucleus_order(const void *a, const void *b) { /* descending value, then ascending index */
    const NucleusCandidate *p = a, *q = b;
    return p->value > q->value ? -1 : p->value < q->value ? 1 : (p->at > q->at) - (p->at < q->at);
}

/* c's first k in nucleus_order moved to its front (in any order): Hoare's selection, the order being total. */
static void nucleus_select(NucleusCandidate *c, long count, long k) {
    long lo = 0, hi = count - 1;
    while (lo < hi) {
        const NucleusCandidate pivot = c[lo + (hi - lo) / 2];
        long i = lo, j = hi;
        while (i <= j) {
            while (nucleus_order(&c[i], &pivot) < 0) i++;
            while (nucleus_order(&c[j], &pivot) > 0) j--;
            if (i <= j) {
                const NucleusCandidate t = c[i];
                c[i++] = c[j], c[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

/* -ln(E) of value `at`'s uniform in key's stream: race_gumbel's, one value (scalar, libm's logs). */
static float nucleus_gumbel(uint64_t key, int32_t at) {
    uint64_t z = key + ((uint64_t)at / 2 + 1) * RACE_GAMMA;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const uint32_t bits = at % 2 ? (uint32_t)(z >> 32) : (uint32_t)z;
    if (bits >> 24 == 0) {
        const float w = (float)(bits & 0xFFFFFF) * 0x1p-32f + 0x1p-33f;
        return -logf(w + w * w * (0.5f + w * (1.0f / 3.0f + w * 0.25f)));
    }
    uint32_t top = (bits >> 8) + 1;
    top -= top >> 24;
    return -logf(-logf(1.0f - (float)top * 0x1p-24f));
}

/* The sum of a row's weights, exp(x scale - shift). */
static float nucleus_total(const float *x, long n, float scale, float shift) {
    race_floats total = (race_floats){0};
    for (long i = 0; i < n; i += RACE_LANES) total += race_exp(race_values(x, i, n) * scale - shift);
    float sum = 0.0f;
    for (int k = 0; k < RACE_LANES; k++) sum += total[k];
    return sum;
}

/* The values of x scale - shift at least -range into c, with their weights; -1 past NUCLEUS_MOST. */
static long nucleus_collect(const float *x, long n, float scale, float shift, float range, NucleusCandidate *c) {
    long count = 0;
    for (long i = 0; i < n; i += RACE_GROUP * RACE_LANES) { /* a group's values tested at once, as race_row's */
        race_floats value[RACE_GROUP], most = (race_floats){0} - INFINITY;
        for (int b = 0; b < RACE_GROUP; b++) {
            value[b] = race_values(x, i + b * RACE_LANES, n) * scale - shift;
            most = race_select(value[b] > most, value[b], most);
        }
        const race_ints near = most >= -range;
        int32_t any = 0;
        for (int k = 0; k < RACE_LANES; k++) any |= near[k];
        for (int b = 0; any && b < RACE_GROUP; b++) {
            const race_floats weight = race_exp(value[b]);
            for (int k = 0; k < RACE_LANES; k++)
                if (value[b][k] >= -range) {
                    if (count == NUCLEUS_MOST) return -1;
                    c[count++] = (NucleusCandidate){value[b][k], weight[k], (int32_t)(i + b * RACE_LANES + k)};
                }
        }
    }
    return count;
}

/* Candidates for a row's k largest (k > 0): the values within some range of the largest, at least k of them and at
 * most NUCLEUS_MOST, the range doubled from NUCLEUS_RANGE while too few and bisected where doubling overshoots; or
 * fewer than k where the range reaches NUCLEUS_ZERO (the rest weigh 0, as in a float32 softmax: never drawn).
 * Their number, or -1 where no range gives one in that window. */
static long nucleus_top_k(const float *x, long n, float scale, float shift, long k, NucleusCandidate *c) {
    float low = 0.0f, high = INFINITY, range = NUCLEUS_RANGE;
    for (int tries = 0; tries < 40; tries++) {
        const long count = nucleus_collect(x, n, scale, shift, range, c);
        if (count >= k || count == n || (count >= 0 && range >= NUCLEUS_ZERO)) return count;
        if (count >= 0) low = range; /* too few */
        else high = range;           /* too many */
        range = high == INFINITY ? 2 * range : (low + high) / 2;
    }
    return -1;
}

/* Row r's token: -1 where it has no distribution (as lp_race_rows), -2 where its nucleus reaches past the
 * candidates (the caller then looks further). The candidates: with top-k, at least its k largest (nucleus_top_k);
 * else the values within NUCLEUS_RANGE of the largest, or within half that, a quarter, ... where more than
 * NUCLEUS_MOST are, and a nucleus that the fewer reach is decided. c holds NUCLEUS_MOST candidates. */
static int64_t nucleus_row(const float *x, long n, float scale, float top_p, long top_k, uint64_t key,
                           NucleusCandidate *c) {
    if (!(top_p > 0.0f && top_p <= 1.0f) || top_k < 0) return -1;
    if (top_k >= n) top_k = 0;
    if (top_p == 1.0f && !top_k) return race_row(x, n, scale, key); /* every value kept */
    const float shift = race_top(x, n, scale);
    if (shift != shift) return -1;
    long count = -1;
    if (top_k) count = top_k <= NUCLEUS_MOST ? nucleus_top_k(x, n, scale, shift, top_k, c) : -1;
    else
        for (float range = NUCLEUS_RANGE; count < 0 && range >= 1.0f; range /= 2)
            count = nucleus_collect(x, n, scale, shift, range, c);
    if (count < 0) return -2;
    if (top_k && count > top_k) nucleus_select(c, count, top_k), count = top_k; /* only the k sorted */
    qsort(c, count, sizeof *c, nucleus_order);
    long kept = count;
    float total = 0.0f;
    if (top_k)
        for (long j = 0; j < kept; j++) total += c[j].weight; /* top-p's share is of the k's weight */
    else
        total = nucleus_total(x, n, scale, shift);
    if (top_p < 1.0f) {
        const float reach = top_p * total;
        float before = 0.0f;
        long j = 0;
        while (j < kept && before <= reach) before += c[j++].weight;
        if (before <= reach && !top_k && count < n) return -2; /* every candidate kept, short of top_p, others left */
        kept = j;
    }
    long best = 0;
    float best_score = -INFINITY;
    for (long j = 0; j < kept; j++) {
        const float score = c[j].value + nucleus_gumbel(key, c[j].at);
        if (score > best_score || (score == best_score && c[j].at < c[best].at)) best_score = score, best = j;
    }
    return c[best].at;
}

int lp_nucleus_rows(const float *x, int64_t M, int64_t N, const float *scale, const float *top_p,
                    const int64_t *top_k, const int64_t *keys, int64_t *out) {
    if (M < 0 || N <= 0 || N > INT32_MAX) return LP_BAD_ARGUMENT;
    int status = LP_OK;
#pragma omp parallel if (M > 1)
    {
        NucleusCandidate *c = malloc(NUCLEUS_MOST * sizeof *c);
        if (!c) {
#pragma omp atomic write
            status = LP_OUT_OF_MEMORY;
        }
#pragma omp for
        for (long r = 0; r < M; r++)
            if (c) out[r] = nucleus_row(x + r * N, N, scale[r], top_p[r], top_k[r], (uint64_t)keys[r], c);
        free(c);
    }
    return status;
}

#endif
