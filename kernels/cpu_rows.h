/* The small per-layer steps' scaffolding every path shares: the argument checks and the row loop, rows going to
 * OpenMP threads only when there are many (a parallel region costs more than a short row). Included by each path's
 * source after its add_rms_norm_row and silu_mul_row. */

#ifndef LP_CPU_ROWS_H
#define LP_CPU_ROWS_H

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

#endif
