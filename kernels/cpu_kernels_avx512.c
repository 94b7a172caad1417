/* The "avx512" path of kernels/cpu_isa.py: the portable kernels (cpu_kernels_portable.c) built with AVX-512 flags,
 * where each 16-float vector is one register, with one change: fp16 KV values are converted by F16C's instructions,
 * which every AVX-512 CPU has. GCC 12 converts _Float16 vectors a lane at a time on x86, and the portable integer
 * conversion made the paged decode of an fp16 cache several times slower than the AVX2 kernels', where F16C brings
 * it close to them (benchmarks/cpu_kernel_bench.py's paged_decode timings over a float16 cache).
 */
#include <immintrin.h>

#define F16_TO_F32(h) ((floats8)_mm256_cvtph_ps((__m128i)(h)))
#define F16_TO_F32_16(h) ((floats16)_mm512_cvtph_ps((__m256i)(h)))
#define F32_TO_F16(x) ((halves8)_mm256_cvtps_ph((__m256)(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))

#include "cpu_kernels_portable.c"
