/* The shared pass of shared-prefix ("cascade") attention on AMX tiles, where the CPU has AMX-BF16 and Linux lets this
 * process use it; elsewhere (and for a float32 cache or heads not a multiple of 32) the path's own float32 tile runs.
 * Built into every path's library, compiled for those instruction sets alone and chosen at run time, as
 * lp_qgemm_int16 is. cpu_amx.h declares it; cpu_cascade.h's shared_task_amx (the dispatch's shared pass and the
 * int16 prefill's) and the int16 prefill's own tiles call it.
 *
 * Why: the shared pass multiplies all of a group's query rows (up to 64 tokens x G heads) by the same keys, a matrix
 * product whose multiply-adds, not its bytes, bound it: on float32 FMAs 64 users on an 8,000-token prompt spent most
 * of a decode step there. One AMX dot-product instruction does 16 x 16 x 32 bfloat16 multiply-adds.
 *
 * Exactness: bfloat16 keeps 8 bits, so operands are split into bfloat16 terms and multiplied term by term. A float16
 * cache value is exactly hi + lo (its 11 bits fit in 16; a bfloat16 one is its own hi), a float32 q row or weight
 * exactly hi + mid + lo (8 bits each, cut by masks); a product takes every pair of terms but the two last terms'
 * (under 2^-24 of it): five products for a float16 cache, three for a bfloat16 one. Sums are float32, as the tile
 * instructions keep them, so the pass agrees with the float32 tile to the order of its sums (tests/kernels/
 * test_cpu_cascade.py holds both to 1e-5 of a float64 reference). Two terms each (a first version) was faster but
 * 2^-17 off, outside that bound: a faster path must not move greedy tokens more than the float32 one does.
 *
 * A task's keys go SUB_KEYS at a time: each step's K rows are laid out once as AMX's B operand (pairs of values
 * along the head, transposed to key columns) and its V rows as pairs of keys, then every 16-row tile of the task's
 * query rows takes them: scores (16 x 16 a tile op), a softmax over the step's scores in float32 (two passes, its
 * max then the weights, the running max and sum carried from step to step as the float32 tile carries them), and the
 * weighted sum of V added into the row tile's accumulator. The row tiles go as a pipeline (step_tiles), so that one
 * tile's softmax, on the vector units, runs while the tile unit multiplies for its neighbours.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_cascade.h"
#include "cpu_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <errno.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512bf16,amx-tile,amx-bf16")))
#define INLINE_AMX static inline __attribute__((always_inline)) AMX

#define SUB_KEYS 256 /* keys a step: its K and V layouts (64 KiB each for heads of 64) and scores stay in L2 */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static pthread_once_t checked = PTHREAD_ONCE_INIT;
static int available = 0; /* the CPU has it, Linux granted this process its tile state, and a tile op ran */
static int wanted = 1;    /* lp_amx(0) switches it off, lp_amx(1) back on */

/* Whether a tile op runs: tried in a child process, since on some virtual machines the CPU reports AMX and Linux
 * grants it, yet the first tile instruction raises SIGILL (llama.cpp's AMX kernels died so on them), which would
 * end this process. The child runs nothing but the tile ops and _exit. */
static AMX int tiles_run(void) {
    const pid_t child = fork();
    if (child == 0) {
        lp_amx_configure();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_dpbf16ps(0, 1, 2);
        _tile_release();
        _exit(0);
    }
    if (child < 0) return 0;
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) return 0;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

static void check_amx(void) {
    __builtin_cpu_init();
    available = __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") &&
                __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") &&
                syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 && tiles_run();
}

int lp_amx(int want) {
    pthread_once(&checked, check_amx);
    if (want >= 0) __atomic_store_n(&wanted, want ? 1 : 0, __ATOMIC_RELAXED);
    return available && __atomic_load_n(&wanted, __ATOMIC_RELAXED);
}

int lp_amx_runs(int kv_dtype, long D) { return kv_dtype != LP_KV_F32 && D % 32 == 0 && lp_amx(-1); }

int lp_amx_int8(void) { return lp_amx(-1) && __builtin_cpu_supports("amx-int8"); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

AMX void lp_amx_configure_tiles(const uint8_t rows[8], const uint16_t colsb[8]) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = colsb[i], c.rows[i] = rows[i];
    /* GCC does not count ldtilecfg as reading c: without this it dropped the stores above */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

void *lp_amx_buffer(int slot, size_t bytes) {
    static __thread void *buffer[LP_AMX_BUFFERS];
    static __thread size_t held[LP_AMX_BUFFERS];
    if (held[slot] < bytes) {
        free(buffer[slot]);
        buffer[slot] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        held[slot] = buffer[slot] ? bytes : 0;
    }
    return buffer[slot];
}

AMX void lp_amx_configure(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    lp_amx_configure_tiles(rows, colsb);
}

/* 16 values of a cache row as float32. */
INLINE_AMX __m512 load_kv16(const int KV, const void *cache, long i) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + i));
    if (KV == LP_KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Word e of the result: the upper half of value e of a, b in order (a's 16, then b's) */
INLINE_AMX __m512i upper_halves(void) {
    return _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19,
                            17, 15, 13, 11, 9, 7, 5, 3, 1);
}

/* 32 float32 values (a, then b) as three bfloat16 terms, in order, exactly: hi the upper half of each float32 (its
 * top 8 significant bits), mid the upper half of what is left (the next 8), lo the rest (at most 8 bits, so its
 * upper half is all of it). Masks and subtractions, no rounding: hi + mid + lo is the value itself. */
INLINE_AMX void split3(__m512 a, __m512 b, __m512i *hi, __m512i *mid, __m512i *lo) {
    const __m512i mask = _mm512_set1_epi32((int)0xFFFF0000), order = upper_halves();
    *hi = _mm512_permutex2var_epi16(_mm512_castps_si512(a), order, _mm512_castps_si512(b));
    a = _mm512_sub_ps(a, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), mask)));
    b = _mm512_sub_ps(b, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), mask)));
    *mid = _mm512_permutex2var_epi16(_mm512_castps_si512(a), order, _mm512_castps_si512(b));
    a = _mm512_sub_ps(a, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), mask)));
    b = _mm512_sub_ps(b, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), mask)));
    *lo = _mm512_permutex2var_epi16(_mm512_castps_si512(a), order, _mm512_castps_si512(b));
}

/* 32 values of a 16-bit cache (a, then b, widened to float32) as bfloat16, exactly: hi the upper half of each
 * float32, lo the rest (at most 3 bits of a float16 value, so its upper half is all of it; 0 for a bfloat16 one).
 * `order` picks the words: upper_halves for the values in order, paired_halves for a's and b's interleaved. */
INLINE_AMX void split_exact(__m512 a, __m512 b, __m512i order, __m512i *hi, __m512i *lo) {
    const __m512i mask = _mm512_set1_epi32((int)0xFFFF0000), ai = _mm512_castps_si512(a), bi = _mm512_castps_si512(b);
    *hi = _mm512_permutex2var_epi16(ai, order, bi);
    const __m512 a_rest = _mm512_sub_ps(a, _mm512_castsi512_ps(_mm512_and_si512(ai, mask)));
    const __m512 b_rest = _mm512_sub_ps(b, _mm512_castsi512_ps(_mm512_and_si512(bi, mask)));
    *lo = _mm512_permutex2var_epi16(_mm512_castps_si512(a_rest), order, _mm512_castps_si512(b_rest));
}

/* ... and interleaved: a's value i at word 2 i, b's at 2 i + 1 */
INLINE_AMX __m512i paired_halves(void) {
    return _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17, 47, 15, 45, 13, 43, 11, 41,
                            9, 39, 7, 37, 5, 35, 3, 33, 1);
}

/* r[i] (16 rows of 16 32-bit values) transposed in place: r[i][j] becomes r[j][i]. */
INLINE_AMX void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) { /* r[i + k], 128-bit lane L: column 4 L + k of rows i .. i + 3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i a01 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44);
        const __m512i a23 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
        const __m512i b01 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
        const __m512i b23 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
        t[k] = _mm512_shuffle_i32x4(a01, b01, 0x88), t[4 + k] = _mm512_shuffle_i32x4(a01, b01, 0xDD);
        t[8 + k] = _mm512_shuffle_i32x4(a23, b23, 0x88), t[12 + k] = _mm512_shuffle_i32x4(a23, b23, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* 2^x for x <= 0 (a score less the running max): a degree-5 polynomial on x less its nearest integer n (fitted for
 * relative error, at most 2.4e-7; the float32 tile's exp2 1.7e-7), times 2^n, which scalef takes to 0 however small. */
INLINE_AMX __m512 exp2_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(x, n);
    __m512 y = _mm512_set1_ps(1.327647129073739e-3f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.675541892647743e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.550713092088699e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.402212023735046e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931469440460205e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0000001192092896f));
    return _mm512_scalef_ps(y, n);
}

/* A thread's scratch for amx_rows (lp_amx_buffer's LP_AMX_CASCADE), in order: two row tiles' scores (s [2][16]
 * [SUB_KEYS]) and weights' three terms (p [2][3][16][SUB_KEYS]: step_tiles' halves), the task's q rows' (qs [tiles]
 * [3][16][D]), its accumulators (acc [tiles][16][D], m, l [tiles][16]), a step's K (kt [2][D / 32][SUB_KEYS / 16][16]
 * [16] pairs: hi, lo) and V (vv [2][SUB_KEYS / 32][D / 16][16][32]). */

/* A step's K rows k0 .. k0 + n - 1 as B operands, whole blocks (the rest of the last is masked out of the scores):
 * tile (c, kb) holds, row p, key kb 16 + j's values 32 c + 2 p and + 1 (a pair) in column j. */
INLINE_AMX void lay_out_keys(const int KV, const void *k_cache, const int32_t *table, long k0, long n, long kvh,
                             long stride, long D, uint32_t *kt) {
    const long tile = 256, per_hl = D / 32 * (SUB_KEYS / 16) * tile;
    for (long kb = 0; kb < (n + 15) / 16; kb++) {
        const long row0 = (long)table[(k0 + kb * 16) / 16] * 16 * stride + kvh * D; /* k0 is a multiple of 16 */
        for (long c = 0; c < D / 32; c++) {
            __m512i hi[16], lo[16];
            for (int j = 0; j < 16; j++) {
                const long at = row0 + j * stride + c * 32;
                const __m512 a = load_kv16(KV, k_cache, at), b = load_kv16(KV, k_cache, at + 16);
                split_exact(a, b, upper_halves(), &hi[j], &lo[j]);
            }
            transpose16(hi);
            uint32_t *dst = kt + (c * (SUB_KEYS / 16) + kb) * tile;
            for (int p = 0; p < 16; p++) _mm512_store_si512(dst + p * 16, hi[p]);
            if (KV == LP_KV_F16) {
                transpose16(lo);
                for (int p = 0; p < 16; p++) _mm512_store_si512(dst + per_hl + p * 16, lo[p]);
            }
        }
    }
}

/* A step's V rows as B operands: tile (kp, j) holds, row i, keys 32 kp + 2 i and + 1 as a pair in each of the 16
 * columns 16 j .. 16 j + 15; keys n .. (n rounded up to 32) - 1 are zeros (a masked weight is 0, and 0 times a slot
 * past the context, which may hold anything, must stay 0). */
INLINE_AMX void lay_out_values(const int KV, const void *v_cache, const int32_t *table, long k0, long n, long kvh,
                               long stride, long D, uint16_t *vv) {
    const long tile = 512, per_hl = SUB_KEYS / 32 * (D / 16) * tile;
    for (long key = 0; key < (n + 31) / 32 * 32; key += 2) {
        const long kp = key / 32, i = key % 32 / 2;
        const long r0 = key < n ? (long)table[(k0 + key) / 16] * 16 * stride + (k0 + key) % 16 * stride + kvh * D : -1;
        for (long j = 0; j < D / 16; j++) { /* key is even and k0 a multiple of 16: key + 1 is in key's block */
            const __m512 a = key < n ? load_kv16(KV, v_cache, r0 + j * 16) : _mm512_setzero_ps();
            const __m512 b = key + 1 < n ? load_kv16(KV, v_cache, r0 + stride + j * 16) : _mm512_setzero_ps();
            uint16_t *dst = vv + (kp * (D / 16) + j) * tile + i * 32;
            __m512i hi, lo;
            split_exact(a, b, paired_halves(), &hi, &lo);
            _mm512_store_si512(dst, hi);
            if (KV == LP_KV_F16) _mm512_store_si512(dst + per_hl, lo);
        }
    }
}

/* Accumulator tile J += the three terms of tiles 3, 4 and 5 (q's or the weights') times the B operand at b, its hi
 * (tile 6) and, of a float16 cache, its lo at b + per_hl (tile 7): every product but the two last terms' (under 2^-24
 * of it), so a sum is as near its exact value as float32's own rounding leaves it. After each half, the softmax
 * slices due by then (pace: c is the round's Softmax). */
#define TERM_PRODUCTS(J, b)                                                                                            \
    do {                                                                                                               \
        _tile_loadd(6, (b), 64);                                                                                       \
        _tile_dpbf16ps(J, 3, 6);                                                                                       \
        _tile_dpbf16ps(J, 4, 6);                                                                                       \
        _tile_dpbf16ps(J, 5, 6);                                                                                       \
        pace(c);                                                                                                       \
        if (KV == LP_KV_F16) {                                                                                         \
            _tile_loadd(7, (b) + per_hl, 64);                                                                          \
            _tile_dpbf16ps(J, 3, 7);                                                                                   \
            _tile_dpbf16ps(J, 4, 7);                                                                                   \
        }                                                                                                              \
        pace(c);                                                                                                       \
    } while (0)

/* Tiles 3, 4 and 5: the three terms (hi, mid, lo: [3][16][W] 16-bit values, x the hi term's first) of 32 columns. */
#define LOAD_TERMS(x, W)                                                                                               \
    do {                                                                                                               \
        _tile_loadd(3, (x), (W) * 2);                                                                                  \
        _tile_loadd(4, (x) + 16 * (W), (W) * 2);                                                                       \
        _tile_loadd(5, (x) + 32 * (W), (W) * 2);                                                                       \
    } while (0)

/* Accumulator tiles 0 .. k - 1 (k <= 3) stored as 16 float32 rows at x, x + 16 and x + 32, `stride` bytes apart. */
#define STORE_ACCUMULATORS(x, k, stride)                                                                               \
    do {                                                                                                               \
        _tile_stored(0, (x), (stride));                                                                                \
        if ((k) > 1) _tile_stored(1, (x) + 16, (stride));                                                              \
        if ((k) > 2) _tile_stored(2, (x) + 32, (stride));                                                              \
    } while (0)

/* Score tile J of a group of three (keys kb + J's 16), over chunk ch of the head. */
#define SCORE_TILE(J) TERM_PRODUCTS(J, kt + (ch * (SUB_KEYS / 16) + kb + (J)) * 256)

/* Accumulator tile J (columns 16 (col + J) ..): the weights times the V pairs of the 32 keys kp. */
#define PV_COLUMN(J) TERM_PRODUCTS(J, vv + (kp * (D / 16) + col + (J)) * 512)

/* The next step's K and V rows of the task's KV head, asked for into L2 a few lines at a time between this step's
 * products (pace): laid out as they came, a step waited on memory row by row (its KV comes from memory, the layer's
 * weights pushing it out of every cache), where its products take longer than reading its rows. */
typedef struct {
    const char *k, *v;    /* the caches, and the first byte of the KV head's values in a row */
    const int32_t *table;
    long key, end;        /* the next key to ask for; the end of the next step's keys */
    long line, lines;     /* the next line of its row, of the row's lines */
    long stride, at_pace; /* bytes from one row to the next; lines asked for at each pace point */
} Ahead;

/* Up to count lines of the next step's K rows and as many of its V rows. */
INLINE_AMX void ask_ahead(Ahead *a, long count) {
    for (; count > 0 && a->key < a->end; count--) {
        const long at = ((long)a->table[a->key / 16] * 16 + a->key % 16) * a->stride + a->line * 64;
        prefetch_l2(a->k + at);
        prefetch_l2(a->v + at);
        if (++a->line == a->lines) a->line = 0, a->key++;
    }
}

/* A row tile's softmax step under way: its rows taken one slice at a time (a row's max, or 32 of its weights), so
 * that the vector work can go between the tile unit's products (see step_tiles). */
typedef struct {
    const float *s;     /* the row tile's scores [16][SUB_KEYS], log2 units */
    const long *seen;   /* [16] each row's keys of the step (at most n; the keys after are masked) */
    uint16_t *p;        /* its weights' three terms [3][16][SUB_KEYS] */
    float *m, *l, *acc; /* its rows' running max and sum [16], accumulators [16][D] */
    long n, D;
    long row, key;      /* the row under way (16: all done) and its next weight (-1: its max not yet taken) */
    long slices, done;  /* slices in all and done so far */
    long paces, paced;  /* the round's pace points (two a TERM_PRODUCTS) and those passed so far */
    float mx;
    __m512 total;
    Ahead *ahead;
} Softmax;

/* The next slice of c's softmax: a row's max over its visible scores, or 32 of its weights (2^(score - max), zeros
 * for masked keys, up to n rounded up to 32) split in three into p; after a row's last, its running max and sum
 * updated and its accumulator row rescaled. A row that sees no key of the step is left as it was (its weights 0). */
INLINE_AMX void softmax_slice(Softmax *c) {
    const long i = c->row, padded = (c->n + 31) / 32 * 32, visible = c->seen[i];
    const float *si = c->s + i * SUB_KEYS;
    uint16_t *p = c->p;
    if (c->key < 0 && visible <= 0) {
        for (long j = 0; j < padded; j += 32)
            for (int t = 0; t < 3; t++) _mm512_storeu_si512(p + (16 * t + i) * SUB_KEYS + j, _mm512_setzero_si512());
        c->row++;
        return;
    }
    if (c->key < 0) {
        __m512 top = _mm512_set1_ps(c->m[i]);
        long j = 0;
        for (; j + 16 <= visible; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(si + j));
        if (j < visible)
            top = _mm512_mask_max_ps(top, (__mmask16)((1u << (visible - j)) - 1), top, _mm512_loadu_ps(si + j));
        c->mx = _mm512_reduce_max_ps(top), c->total = _mm512_setzero_ps(), c->key = 0;
        return;
    }
    const long j = c->key, left0 = visible - j, left1 = visible - j - 16;
    const __m512 mv = _mm512_set1_ps(c->mx);
    __m512 e0, e1;
    if (left1 >= 16) { /* all 32 visible: the shared pass's every slice */
        e0 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(si + j), mv));
        e1 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(si + j + 16), mv));
    } else {
        const __mmask16 in0 = left0 >= 16 ? 0xFFFF : left0 > 0 ? (__mmask16)((1u << left0) - 1) : 0;
        const __mmask16 in1 = left1 > 0 ? (__mmask16)((1u << left1) - 1) : 0;
        e0 = _mm512_maskz_mov_ps(in0, exp2_16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in0, si + j), mv)));
        e1 = _mm512_maskz_mov_ps(in1, exp2_16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in1, si + j + 16), mv)));
    }
    c->total = _mm512_add_ps(c->total, _mm512_add_ps(e0, e1));
    __m512i hi, mid, lo;
    split3(e0, e1, &hi, &mid, &lo);
    _mm512_storeu_si512(p + i * SUB_KEYS + j, hi);
    _mm512_storeu_si512(p + (16 + i) * SUB_KEYS + j, mid);
    _mm512_storeu_si512(p + (32 + i) * SUB_KEYS + j, lo);
    c->key += 32;
    if (c->key < padded) return;
    const float alpha = c->m[i] == -INFINITY ? 0.0f : exp2f(c->m[i] - c->mx);
    c->l[i] = c->l[i] * alpha + _mm512_reduce_add_ps(c->total);
    c->m[i] = c->mx;
    float *acc = c->acc + i * c->D;
    for (long d = 0; d < c->D; d += 16)
        _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(alpha)));
    c->row++, c->key = -1;
}

/* After a few of the tile unit's products: the slices due by now, in proportion. The core takes in the next
 * products only as earlier ones drain, and runs on into the vector code behind them meanwhile: a slice or two fits
 * behind a few products, a whole row would not. */
INLINE_AMX void pace(Softmax *c) {
    ask_ahead(c->ahead, c->ahead->at_pace);
    const long due = c->slices * ++c->paced; /* slices due: due / paces, rounded down */
    for (; (c->done + 1) * c->paces <= due; c->done++) softmax_slice(c);
}

/* A row tile's scores over the step's n keys (whole blocks) into s [16][SUB_KEYS], three tiles of 16 keys at a
 * time (q's tiles loaded once for them, and three sums in flight rather than one chain). q is [3][16][D]: hi, mid,
 * lo. */
INLINE_AMX void tile_scores(const int KV, const uint16_t *q, const uint32_t *kt, long n, long D, float *s, Softmax *c) {
    const long per_hl = D / 32 * (SUB_KEYS / 16) * 256, blocks = (n + 15) / 16;
    for (long kb = 0; kb < blocks; kb += 3) {
        const long tiles = blocks - kb < 3 ? blocks - kb : 3;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (long ch = 0; ch < D / 32; ch++) {
            LOAD_TERMS(q + ch * 32, D);
            SCORE_TILE(0);
            if (tiles > 1) SCORE_TILE(1);
            if (tiles > 2) SCORE_TILE(2);
        }
        STORE_ACCUMULATORS(s + kb * 16, tiles, SUB_KEYS * 4);
    }
}

/* A row tile's acc [16][D] += P V over the step's n keys (rounded up to 32), 48 columns (three accumulator tiles) a
 * pass. p is [3][16][SUB_KEYS]: hi, mid, lo. */
INLINE_AMX void tile_values(const int KV, const uint16_t *p, const uint16_t *vv, long n, long D, float *acc,
                            Softmax *c) {
    const long per_hl = SUB_KEYS / 32 * (D / 16) * 512, pairs = (n + 31) / 32;
    for (long col = 0; col < D / 16; col += 3) {
        const long cols = D / 16 - col < 3 ? D / 16 - col : 3;
        _tile_loadd(0, acc + col * 16, D * 4);
        if (cols > 1) _tile_loadd(1, acc + col * 16 + 16, D * 4);
        if (cols > 2) _tile_loadd(2, acc + col * 16 + 32, D * 4);
        for (long kp = 0; kp < pairs; kp++) {
            LOAD_TERMS(p + kp * 32, SUB_KEYS);
            PV_COLUMN(0);
            if (cols > 1) PV_COLUMN(1);
            if (cols > 2) PV_COLUMN(2);
        }
        STORE_ACCUMULATORS(acc + col * 16, cols, D * 4);
    }
}

/* A step's row tiles as a pipeline: round i gives the tile unit row tile i's scores and row tile i - 2's values, and
 * the vector units row tile i - 1's softmax, its slices spread between the tile unit's runs of products (in order,
 * each part of a row tile took its turn: the tiles idle during the softmax, the vector units during the products).
 * s and p are double buffered: a round's scores and softmax, and its softmax and values, use different halves. */
INLINE_AMX void step_tiles(const int KV, const uint16_t *qs, const uint32_t *kt, const uint16_t *vv, long k0, long n,
                           const int32_t *tpos, long R, long G, long tiles, long D, float *s, uint16_t *p, float *m,
                           float *l, float *acc, Ahead *ahead) {
    const long blocks = (n + 15) / 16, pairs = (n + 31) / 32, s_half = 16 * SUB_KEYS, p_half = 3 * 16 * SUB_KEYS;
    const long paces = 2 * tiles * (blocks * (D / 32) + pairs * (D / 16)); /* pace points in all the rounds */
    ahead->at_pace = ((ahead->end - ahead->key) * ahead->lines + paces - 1) / paces;
    for (long i = 0; i < tiles + 2; i++) {
        const long t = i - 1;
        long seen[16]; /* row tile t's rows' keys of the step: all, or up to their positions */
        Softmax c = {.row = 16, .key = -1, .n = n, .D = D, .seen = seen, .ahead = ahead};
        c.paces = 2 * ((i < tiles ? blocks * (D / 32) : 0) + (i >= 2 ? pairs * (D / 16) : 0));
        if (t >= 0 && t < tiles) {
            c.s = s + t % 2 * s_half, c.p = p + t % 2 * p_half, c.m = m + t * 16, c.l = l + t * 16;
            c.acc = acc + t * 16 * D, c.row = 0;
            for (int r = 0; r < 16; r++) {
                const long row = t * 16 + r < R ? t * 16 + r : R - 1, last = tpos ? tpos[row / G] - k0 + 1 : n;
                seen[r] = last < n ? last : n;
                c.slices += seen[r] > 0 ? 1 + pairs : 1;
            }
        }
        if (i < tiles) tile_scores(KV, qs + i * 48 * D, kt, n, D, s + i % 2 * s_half, &c);
        if (i >= 2) tile_values(KV, p + i % 2 * p_half, vv, n, D, acc + (i - 2) * 16 * D, &c);
        while (c.row < 16) softmax_slice(&c);
    }
    ask_ahead(ahead, (ahead->end - ahead->key) * ahead->lines); /* what the pace points left */
}

static inline __attribute__((always_inline)) AMX int amx_rows(const int KV, const float *q, const int32_t *tok,
                                                             const int32_t *tpos, long n_tok, long kvh,
                                                             const void *k_cache, const void *v_cache,
                                                             const int32_t *table, long k_begin, long k_end, long H,
                                                             long KVH, long D, float scale, float *dst, long dst_first,
                                                             float *stats) {
    const long G = H / KVH, R = G * n_tok, tiles = (R + 15) / 16, stride = KVH * D;
    const long s_bytes = 2 * 16 * SUB_KEYS * 4, p_bytes = 2 * 3 * 16 * SUB_KEYS * 2, q_bytes = tiles * 3 * 16 * D * 2;
    const long acc_bytes = tiles * 16 * D * 4, ml_bytes = tiles * 16 * 4;
    const long kt_bytes = 2 * (D / 32) * (SUB_KEYS / 16) * 1024, vv_bytes = 2 * (SUB_KEYS / 32) * (D / 16) * 1024;
    const long bytes = s_bytes + p_bytes + q_bytes + acc_bytes + 2 * ml_bytes + kt_bytes + vv_bytes;
    void *scratch = lp_amx_buffer(LP_AMX_CASCADE, bytes);
    if (!scratch) return LP_OUT_OF_MEMORY;
    float *s = scratch;
    uint16_t *p = (uint16_t *)((char *)scratch + s_bytes), *qs = p + 2 * 3 * 16 * SUB_KEYS;
    float *acc = (float *)(qs + tiles * 3 * 16 * D), *m = acc + tiles * 16 * D, *l = m + tiles * 16;
    uint32_t *kt = (uint32_t *)(l + tiles * 16);
    uint16_t *vv = (uint16_t *)((char *)kt + kt_bytes);
    /* q's rows (row r: token r / G, head kvh G + r % G), times scale and log2 e, split in three (tile t's at qs +
     * t 3 16 D: hi, mid, lo, each [16][D]); padding rows zeros */
    const __m512 scale_log2 = _mm512_set1_ps(scale * 1.44269504088896341f);
    for (long r = 0; r < tiles * 16; r++) {
        const float *qr = r < R ? q + ((long)tok[r / G] * H + kvh * G + r % G) * D : NULL;
        uint16_t *row = qs + (r / 16 * 48 + r % 16) * D;
        for (long d = 0; d < D; d += 32) {
            const __m512 a = qr ? _mm512_mul_ps(_mm512_loadu_ps(qr + d), scale_log2) : _mm512_setzero_ps();
            const __m512 b = qr ? _mm512_mul_ps(_mm512_loadu_ps(qr + d + 16), scale_log2) : _mm512_setzero_ps();
            __m512i hi, mid, lo;
            split3(a, b, &hi, &mid, &lo);
            _mm512_storeu_si512(row + d, hi);
            _mm512_storeu_si512(row + 16 * D + d, mid);
            _mm512_storeu_si512(row + 32 * D + d, lo);
        }
        m[r] = -INFINITY, l[r] = 0.0f;
    }
    memset(acc, 0, acc_bytes);
    lp_amx_configure();
    const long bytes_a_row = D * 2, head = kvh * bytes_a_row;
    for (long k0 = k_begin; k0 < k_end; k0 += SUB_KEYS) {
        const long n = k_end - k0 < SUB_KEYS ? k_end - k0 : SUB_KEYS, next = k0 + n;
        Ahead ahead = {(const char *)k_cache + head, (const char *)v_cache + head, table, next,
                       k_end - next < SUB_KEYS ? k_end : next + SUB_KEYS, 0, bytes_a_row / 64, stride * 2, 0};
        lay_out_keys(KV, k_cache, table, k0, n, kvh, stride, D, kt);
        lay_out_values(KV, v_cache, table, k0, n, kvh, stride, D, vv);
        step_tiles(KV, qs, kt, vv, k0, n, tpos, R, G, tiles, D, s, p, m, l, acc, &ahead);
    }
    _tile_release();
    store_tile(R, G, kvh, H, D, acc, D, m, l, tok, dst, dst_first, stats);
    return LP_OK;
}

AMX int lp_amx_rows(int kv_dtype, const float *q, const int32_t *tok, const int32_t *tpos, long n_tok, long kvh,
                    const void *k_cache, const void *v_cache, const int32_t *table, long k_begin, long k_end, long H,
                    long KVH, long D, float scale, float *dst, long dst_first, float *stats) {
    if (kv_dtype == LP_KV_F16)
        return amx_rows(LP_KV_F16, q, tok, tpos, n_tok, kvh, k_cache, v_cache, table, k_begin, k_end, H, KVH, D, scale,
                        dst, dst_first, stats);
    return amx_rows(LP_KV_BF16, q, tok, tpos, n_tok, kvh, k_cache, v_cache, table, k_begin, k_end, H, KVH, D, scale,
                    dst, dst_first, stats);
}

#else /* no AMX off x86-64: the float32 tile runs */

int lp_amx(int want) {
    (void)want;
    return 0;
}

int lp_amx_runs(int kv_dtype, long D) {
    (void)kv_dtype, (void)D;
    return 0;
}

int lp_amx_int8(void) { return 0; }

int lp_amx_rows(int kv_dtype, const float *q, const int32_t *tok, const int32_t *tpos, long n_tok, long kvh,
                const void *k_cache, const void *v_cache, const int32_t *table, long k_begin, long k_end, long H,
                long KVH, long D, float scale, float *dst, long dst_first, float *stats) {
    (void)kv_dtype, (void)q, (void)tok, (void)tpos, (void)n_tok, (void)kvh, (void)k_cache, (void)v_cache, (void)table;
    (void)k_begin, (void)k_end, (void)H, (void)KVH, (void)D, (void)scale, (void)dst, (void)dst_first, (void)stats;
    return LP_BAD_ARGUMENT;
}
#endif
