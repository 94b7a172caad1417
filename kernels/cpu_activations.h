/* Activations rounded to integers, for the integer kernels (lp_qgemm_int8 in cpu_qgemm_int8.c, lp_qgemm_int16 in
 * cpu_qgemm_int16.c), and whether this CPU runs their VNNI kernels (cpu_activations.c defines both). Internal to
 * the library: kernels/cpu.py binds none of it.
 *
 * Each run ("group") of G values of a row of X becomes int8 or int16 with one fp32 scale, amax / 127 or
 * amax / 32767, each value rounded to nearest even; a group's dot product with a weight's small integers is then
 * exact integer arithmetic:
 *   sum_k w_k x_k ~= w_scale * x_scale * (sum_k u_k xq_k - offset * sum_k xq_k) + w_min * sum_k x_k
 * (u the stored value, q + offset; the last term in fp32 from X itself), which is what each group keeps.
 */
#ifndef LP_CPU_ACTIVATIONS_H
#define LP_CPU_ACTIVATIONS_H

#include <stdint.h>

/* X's rows in groups of G: xq [M, K], and per (row, group) its scale, the sum of its fp32 values (for the min term)
 * and the sum of its integers (for the offset), in one allocation that lp_free_rows releases. */
typedef struct {
    union {
        int8_t *xq8;   /* rounded to 8 bits */
        int16_t *xq16; /* rounded to 16 bits */
    };
    float *scale, *sum;
    int32_t *qsum;
} lp_rounded_rows;

/* X [M, K] fp32 rounded to `bits` (8 or 16) in groups of G (dividing K) into r: LP_OK or LP_OUT_OF_MEMORY. */
int lp_round_rows(const float *X, long M, long K, long G, int bits, lp_rounded_rows *r);
void lp_free_rows(lp_rounded_rows *r);

/* Whether the CPU has AVX-512 VNNI (with VL and BW), which the integer kernels' fast paths are compiled for. */
int lp_has_vnni(void);

#if defined(__x86_64__)
#include <immintrin.h>

/* acc + each lane's two int16 products of v and the pair at p (broadcast to every lane), summed: one vpdpwssd, its
 * pair read straight from memory, for the int16 matmul and the int16 prefill. Written out because GCC 12 copied
 * every accumulator twice around its builtin and spilled the other operand to the stack each step (6 rows: 12
 * register moves and a store and a load per 6 vpdpwssd). */
static inline __attribute__((always_inline, target("avx512f,avx512vl,avx512bw,avx512vnni"))) __m512i
add_pair_products(__m512i acc, __m512i v, const int16_t *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*(const int32_t *)p));
    return acc;
}
#endif

#endif
