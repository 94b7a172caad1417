/* The shared pass of cascade attention on AMX tiles (cpu_cascade_amx.c says how and why), internal to the library
 * but for lp_amx, which cpu_kernels.h exports. */
#ifndef LP_CPU_AMX_H
#define LP_CPU_AMX_H

#include <stdint.h>

/* Whether lp_amx_shared_rows runs here for a cache of kv_dtype and heads of D values: the CPU has AMX-BF16, Linux
 * granted this process its tile state, lp_amx has not switched it off, the cache is 16-bit and D a multiple of 32. */
int lp_amx_shared_runs(int kv_dtype, long D);

/* A shared-pass tile as cpu_kv_dispatch.h's rows_task computes it with stats (unnormalised rows into dst's rows
 * dst_first + i, their max in natural units and sum of weights into stats), every key k_begin .. k_end - 1 visible
 * (k_begin and k_end multiples of 16). LP_OK or LP_OUT_OF_MEMORY; only where lp_amx_shared_runs says so. */
int lp_amx_shared_rows(int kv_dtype, const float *q, const int32_t *tok, long n_tok, long kvh, const void *k_cache,
                       const void *v_cache, const int32_t *table, long k_begin, long k_end, long H, long KVH, long D,
                       float scale, float *dst, long dst_first, float *stats);

#endif
