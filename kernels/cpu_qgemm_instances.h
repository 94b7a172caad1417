/* The qgemm instances and lp_qgemm's dispatch to them, the same for every path: cpu_kernels.c and
 * cpu_kernels_portable.c each define QGEMM_FN(BITS, HAS_OFFSET, GROUP, HAS_MIN), the function
 * qgemm_BITS_HAS_OFFSET_GROUP_HAS_MIN(X, M, K, q, offset, scale, min, N_padded, Y) of one combination, then
 * include this file once. */
#define QGEMM_FNS(BITS, HAS_OFFSET) \
    QGEMM_FN(BITS, HAS_OFFSET, 16, 0) QGEMM_FN(BITS, HAS_OFFSET, 16, 1) QGEMM_FN(BITS, HAS_OFFSET, 32, 0) QGEMM_FN(BITS, HAS_OFFSET, 32, 1)
QGEMM_FNS(4, 0)
QGEMM_FNS(4, 1)
QGEMM_FNS(5, 0)
QGEMM_FNS(5, 1)
QGEMM_FNS(8, 0) /* 8-bit values are stored as they are: never an offset */

/* X: [M, K] contiguous; N_padded a multiple of 16; Y: [M, N_padded] contiguous; bits (8, 4 or 5), offset, group
 * (32 or 16, dividing K) and min (or NULL): see the layout in cpu_kernels.c. Each (bits, offset or not, group, min
 * or not) is its own instance, so the inner loops keep constant bounds and no dead work. */
#define QGEMM_CALL(BITS, HAS_OFFSET, GROUP, HAS_MIN) \
    qgemm_##BITS##_##HAS_OFFSET##_##GROUP##_##HAS_MIN(X, M, K, q, offset, scale, min, N_padded, Y)
#define QGEMM_BY_MIN(BITS, HAS_OFFSET, GROUP) \
    (min ? QGEMM_CALL(BITS, HAS_OFFSET, GROUP, 1) : QGEMM_CALL(BITS, HAS_OFFSET, GROUP, 0))
#define QGEMM_BY_GROUP(BITS, HAS_OFFSET) \
    (group == 16 ? QGEMM_BY_MIN(BITS, HAS_OFFSET, 16) : QGEMM_BY_MIN(BITS, HAS_OFFSET, 32))
int lp_qgemm(const float *X, int64_t M, int64_t K, const int8_t *q, const float *scale, const float *min,
             int64_t N_padded, int bits, int offset, int group, float *Y) {
    if ((bits != 4 && bits != 5 && bits != 8) || (group != 16 && group != 32) || K % group || N_padded % TILE ||
        M < 0 || K <= 0)
        return LP_BAD_ARGUMENT;
    if (bits == 4) return offset ? QGEMM_BY_GROUP(4, 1) : QGEMM_BY_GROUP(4, 0);
    if (bits == 5) return offset ? QGEMM_BY_GROUP(5, 1) : QGEMM_BY_GROUP(5, 0);
    return QGEMM_BY_GROUP(8, 0);
}
