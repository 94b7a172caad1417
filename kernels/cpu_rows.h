/* The small per-layer steps' scaffolding every path shares: the argument checks and the row loop, rows going to
 * OpenMP threads only when there are many (a parallel region costs more than a short row). Included by each path's
 * source after its add_rms_norm_row and silu_mul_row; lp_argmax_rows, plain C that each path's flags vectorise. */

#ifndef LP_CPU_ROWS_H
#define LP_CPU_ROWS_H

#include <math.h>
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

#endif
