/* Attention tiles on AMX (cpu_cascade_amx.c says how and why): cascade attention's shared pass and the int16
 * prefill. Internal to the library but for lp_amx, which cpu_kernels.h exports. */
#ifndef LP_CPU_AMX_H
#define LP_CPU_AMX_H

#include <stddef.h>
#include <stdint.h>

#include "cpu_activations.h"
#include "cpu_kernels.h"

/* Whether lp_amx_rows runs here for a cache of kv_dtype and heads of D values: the CPU has AMX-BF16, Linux granted
 * this process its tile state, lp_amx has not switched it off, the cache is 16-bit and D a multiple of 32. */
int lp_amx_runs(int kv_dtype, long D);

/* Configures this thread's eight tiles as 16 rows of 64 bytes (16 x 32 bfloat16 or 16 x 16 float32). */
void lp_amx_configure(void);

/* This thread's buffer `slot` of at least `bytes` (64-byte aligned), kept for its next calls, or NULL where no memory
 * is left: the tiles' operands are laid out per call, up to tens of MiB for a prompt, and memory fresh from the system
 * costs a page fault each 4 KiB every call. One slot per use, so that one call's buffers never overlap. */
enum { LP_AMX_CASCADE, LP_AMX_ROWS, LP_AMX_PANEL, LP_AMX_BUFFERS };
void *lp_amx_buffer(int slot, size_t bytes);

/* Whether AMX-INT8 runs here as well (lp_amx's conditions and the CPU's amx-int8): lp_qgemm_int16's batches. */
int lp_amx_int8(void);

/* Configures this thread's tile i as rows[i] rows of colsb[i] bytes, for the eight tiles. */
void lp_amx_configure_tiles(const uint8_t rows[8], const uint16_t colsb[8]);

/* lp_qgemm_int16's product of the rounded rows x [M, K] on AMX-INT8 tiles, the same bits as its VNNI kernel
 * (cpu_qgemm_int16_amx.c): LP_OK or LP_OUT_OF_MEMORY; only where lp_amx_int8 says so. */
int lp_qgemm_int16_amx(const lp_rounded_rows *x, long M, long K, const int8_t *q, const lp_scales *scales,
                       long N_padded, int bits, int offset, int group, float *Y);

/* rows_task of cpu_kv_dispatch.h on AMX tiles: n_tok tokens tok[i] (q's rows), all G query heads of KV head kvh,
 * over keys k_begin (a multiple of 16) .. k_end - 1 of the block table row `table`, token i seeing those up to
 * tpos[i] (NULL: all, as a shared pass's); normalised into dst's rows tok[i] where stats is NULL, else unnormalised
 * into rows dst_first + i with their max (natural units) and sum of weights in stats, as store_tile has them. LP_OK
 * or LP_OUT_OF_MEMORY; only where lp_amx_runs says so. */
int lp_amx_rows(int kv_dtype, const float *q, const int32_t *tok, const int32_t *tpos, long n_tok, long kvh,
                const void *k_cache, const void *v_cache, const int32_t *table, long k_begin, long k_end, long H,
                long KVH, long D, float scale, float *dst, long dst_first, float *stats);

#endif
