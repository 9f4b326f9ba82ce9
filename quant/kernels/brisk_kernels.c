/* brisk's native CPU kernels: matrix products straight from quantized weights.
 *
 * A plain C library (no Python or torch headers), loaded with ctypes by quant/native.py and built by
 * the platform's C compiler in about a second. Three kinds of products, by weight type:
 *  - float activations (tiles.c): a tile of 4 rows dequantized to float32 into a small buffer
 *    (gguf_types.h knows the formats), then float32 sums: the widened model's floats up to summation
 *    order (float32 rows, int4 groups of other sizes);
 *  - 16-bit activations (int_dot.h): exact int32 sums of codes times activations rounded to 2^-16 of
 *    their block's largest, scaled in float (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, int8 rows, int4 groups of 32k);
 *    8-bit ones per block cost SmolLM2-135M KL 0.02 to its float self and flipped its greedy answer;
 *  - 8-bit activations (int8_dot.h, and the interleaved q4k_x8.h / q3k_x8.h) for the K-quants, llama.cpp's grid: KL ~0.008 on Gemma 3 270M
 *    Q4_K_M, and the 16-bit path left a 1.1B Q4_K_M model at 0.38x llama.cpp's decode speed.
 * Every output is the same operations in the same order whatever the number of activation rows
 * (decode: 1; verification, batches, prefill: many) and a row's place among them: a row's result
 * does not depend on its batch (batch-invariant), which keeps greedy speculative and batched
 * decoding token-for-token equal to plain decoding.
 * The sums run over 16 fixed lanes (GCC vector extensions: one AVX-512 register, two AVX2 ones, four
 * NEON or SSE ones) reduced in a fixed order, so a level gives the same bits on every machine.
 * The kernels (tiles.c) are compiled once per instruction set (plain, AVX2+FMA, AVX-512) and picked
 * at run time; this file holds the dispatch, the thread pool and the entry points.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bk_decoder.h"
#include "bk_weight.h"
#include "gguf_quantize.h"
#include "gguf_types.h"
#include "int_dot.h"
#include "int8_dot.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

/* ------------------------------------------------------------------ one copy per instruction set
 * tiles.c, compiled per level (BK_LEVELS: 1 builds the plain copy only, e.g. on ARM, where the
 * plain copy is NEON through the compiler; 2 adds AVX2+FMA on x86-64, 3 AVX-512 too: the build
 * compiles only the levels the CPU it runs on has). */
typedef void (*tile_fn)(const bk_weight *, int, int, int, const float *, float *, int64_t, float *);
typedef void (*rows_fn)(const bk_weight *, const int64_t *, int, float *);
typedef void (*slab_fn)(const bk_weight *, int, int, int, int, float *);
typedef int (*columns_fn)(const bk_weight *, const int *, int, int, int, float *const *);
typedef int (*row_outliers_fn)(const float *, int, int, float, bk_outlier *);
typedef void (*add_entries_fn)(const bk_outlier *, int, int, int, const float *, const int32_t *, int64_t, int64_t,
                               float *, int64_t, int, int);
typedef void (*int_rows_fn)(const bk_weight *, int, int, int, const bk_xq *, float *, int64_t, float *);
typedef void (*quantize_x_fn)(const float *, int, int, int16_t *, float *, float *); /* both grids */
typedef void (*quantize_x8_fn)(const float *, int, int, int8_t *, int8_t *, float *, int16_t *, int16_t *);
typedef int (*decoder_fn)(const bk_arch *, const bk_layer *, int, const bk_cache *, int, const int32_t *,
                          const int32_t *, float *, const bk_tp *, int);
#define LEVEL_FUNCTIONS(S)                                                                                  \
    void bk_tile_rows_##S(const bk_weight *, int, int, int, const float *, float *, int64_t, float *);    \
    void bk_dequant_rows_##S(const bk_weight *, const int64_t *, int, float *);                           \
    void bk_dequant_slab_##S(const bk_weight *, int, int, int, int, float *);                             \
    int bk_dequant_columns_##S(const bk_weight *, const int *, int, int, int, float *const *);            \
    int bk_row_outliers_##S(const float *, int, int, float, bk_outlier *);                                \
    void bk_add_entries_##S(const bk_outlier *, int, int, int, const float *, const int32_t *, int64_t,    \
                            int64_t, float *, int64_t, int, int);                                          \
    int bk_decoder_##S(const bk_arch *, const bk_layer *, int, const bk_cache *, int, const int32_t *,    \
                       const int32_t *, float *, const bk_tp *, int);                                      \
    void bk_int_rows_##S(const bk_weight *, int, int, int, const bk_xq *, float *, int64_t, float *);      \
    void bk_quantize_x_##S(const float *, int, int, int16_t *, float *, float *);                         \
    void bk_quantize_x256_##S(const float *, int, int, int16_t *, float *, float *);                      \
    void bk_quantize_x8_##S(const float *, int, int, int8_t *, int8_t *, float *, int16_t *, int16_t *);
LEVEL_FUNCTIONS(plain)
#if BK_LEVELS > 1
LEVEL_FUNCTIONS(avx2)
#endif
#if BK_LEVELS > 2
LEVEL_FUNCTIONS(avx512)
#endif

enum { LEVEL_PLAIN = 0, LEVEL_AVX2 = 1, LEVEL_AVX512 = 2 };

int bk_cpu_level(void) {
#if BK_LEVELS > 1
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    /* VNNI too (every AVX-512 CPU since Cascade Lake / Zen 4): its multiply-add-accumulate is 5-12% of
     * the integer products; Skylake-X-era CPUs without it take the AVX2 copy */
    if (BK_LEVELS > 2 && avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
        return LEVEL_AVX512;
    if (avx2) return LEVEL_AVX2;
#endif
    return LEVEL_PLAIN;
}

static int clamp_level(int level) {
    int best = bk_cpu_level();
    return level < 0 || level > best ? best : level;
}

/* Each level's copy of the kernels, by level (a CPU without a level never gets it: clamp_level). */
static const struct {
    tile_fn tile;
    rows_fn rows;
    slab_fn slab;
    columns_fn columns;
    row_outliers_fn row_outliers;
    add_entries_fn add_entries;
    decoder_fn decoder;
    int_rows_fn int_rows;
    quantize_x_fn quantize_x, quantize_x256;
    quantize_x8_fn quantize_x8;
} KERNELS[] = {
#define LEVEL(S) {bk_tile_rows_##S, bk_dequant_rows_##S, bk_dequant_slab_##S, bk_dequant_columns_##S, bk_row_outliers_##S, bk_add_entries_##S, bk_decoder_##S, bk_int_rows_##S, bk_quantize_x_##S, \
                  bk_quantize_x256_##S, bk_quantize_x8_##S}
    LEVEL(plain),
#if BK_LEVELS > 1
    LEVEL(avx2),
#endif
#if BK_LEVELS > 2
    LEVEL(avx512),
#endif
#undef LEVEL
};

/* ------------------------------------------------------------------ threads
 * A persistent pool: a job's rows are cut into chunks that the caller and the workers claim from
 * one counter. The caller never waits for a chunk nobody has started: on a busy machine, where a
 * worker does not get a core, the caller simply does every chunk itself (an earlier design that
 * waited for its workers crawled under load). Workers spin briefly between jobs (decode
 * steps come every few tens of microseconds), then sleep. */
#define MAX_THREADS 64
#define EXHAUSTED (1 << 30)
#ifndef SPIN
#define SPIN 20000
#endif

typedef void (*chunk_fn)(const void *args, int n0, int n1);

static struct {
    int n_workers;
    pthread_t th[MAX_THREADS];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint epoch;
    atomic_int next, active;
    chunk_fn run;
    const void *args;
    int n, chunk;
} P = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .next = EXHAUSTED};

static void claim_chunks(void) {
    for (;;) {
        int c = atomic_fetch_add_explicit(&P.next, 1, memory_order_acq_rel);
        if (c >= EXHAUSTED || (long)c * P.chunk >= P.n) break;
        int n0 = c * P.chunk, n1 = n0 + P.chunk < P.n ? n0 + P.chunk : P.n;
        P.run(P.args, n0, n1);
    }
}

static void *worker(void *unused) {
    (void)unused;
    unsigned seen = atomic_load(&P.epoch);
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&P.epoch, memory_order_acquire) == seen) {
            if (++spins < SPIN) {
                PAUSE();
                continue;
            }
            pthread_mutex_lock(&P.mu);
            while (atomic_load(&P.epoch) == seen) pthread_cond_wait(&P.cv, &P.mu);
            pthread_mutex_unlock(&P.mu);
        }
        seen = atomic_load(&P.epoch);
        atomic_fetch_add(&P.active, 1);
        claim_chunks();
        atomic_fetch_sub(&P.active, 1);
    }
    return NULL;
}

static int want_threads = 1;

void bk_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (P.n_workers < n - 1) { /* workers are only ever added: a smaller n uses fewer chunks */
        if (pthread_create(&P.th[P.n_workers], NULL, worker, NULL) != 0) break;
        pthread_detach(P.th[P.n_workers]);
        P.n_workers++;
    }
    want_threads = n < P.n_workers + 1 ? n : P.n_workers + 1;
}

static void parallel_rows(chunk_fn run, const void *args, int n, int min_chunk) {
    int threads = want_threads;
    if (threads <= 1 || n < 2 * min_chunk) {
        run(args, 0, n);
        return;
    }
    int chunk = (n + 4 * threads - 1) / (4 * threads); /* a few chunks each: uneven cores even out */
    if (min_chunk >= 4) chunk = (chunk + 7) / 8 * 8; /* whole tiles of 4, whole interleaved groups of 8 (q4k_x8.h) */
    if (chunk < min_chunk) chunk = min_chunk;
    P.run = run;
    P.args = args;
    P.n = n;
    P.chunk = chunk;
    atomic_store_explicit(&P.next, 0, memory_order_release);
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add_explicit(&P.epoch, 1, memory_order_release);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    claim_chunks();
    atomic_store(&P.next, EXHAUSTED); /* late workers find nothing left */
    while (atomic_load_explicit(&P.active, memory_order_acquire) > 0) PAUSE();
}

/* The pool for decoder.c's attention (tasks: a row's query heads on one K/V head, over one span of keys). */
void bk_parallel(chunk_fn run, const void *args, int n, int min_chunk) { parallel_rows(run, args, n, min_chunk); }

/* The machine's read bandwidth, as the kernels' pool sees it: the threads stream through `bytes` of
 * memory in chunks of 1 MiB, each XOR-folding its 64-bit words (a load per word, nothing stored), and
 * the folds are combined so the compiler cannot drop the reads. Benchmarks put decode's bytes per
 * second beside it. */
typedef struct {
    const uint64_t *words;
    size_t n_words;
    _Atomic uint64_t fold;
} read_probe_job;

#define PROBE_CHUNK_WORDS (1 << 17)

static void read_probe_chunk(const void *p, int c0, int c1) {
    read_probe_job *j = (read_probe_job *)p;
    size_t i = (size_t)c0 * PROBE_CHUNK_WORDS, end = (size_t)c1 * PROBE_CHUNK_WORDS;
    if (end > j->n_words) end = j->n_words;
    uint64_t acc[8] = {0}; /* independent chains: the loads, not a dependency, set the pace */
    for (; i + 8 <= end; i += 8)
        for (int u = 0; u < 8; u++) acc[u] ^= j->words[i + u];
    for (; i < end; i++) acc[0] ^= j->words[i];
    atomic_fetch_xor(&j->fold, acc[0] ^ acc[1] ^ acc[2] ^ acc[3] ^ acc[4] ^ acc[5] ^ acc[6] ^ acc[7]);
}

uint64_t bk_read_probe(const void *buf, size_t bytes) {
    read_probe_job j = {(const uint64_t *)buf, bytes / 8, 0};
    int chunks = (int)((j.n_words + PROBE_CHUNK_WORDS - 1) / PROBE_CHUNK_WORDS);
    parallel_rows(read_probe_chunk, &j, chunks, 1);
    return atomic_load(&j.fold);
}

/* Interleaving a GGUF matrix's rows for the x8 kernels at load (quant/gguf_interleave.py): every
 * layout moves bits only, so a group of 8 rows' super-block becomes its interleaved block by a list of
 * terms, out[dst] ^= (in[src] & mask) shifted, over a constant (the bits the layout flips), derived
 * once per type from the layout's reference implementation and checked against it. */
typedef struct {
    int32_t src; /* byte offset in the group's first row: row * row_bytes + byte within the block */
    uint16_t dst;
    int8_t shift; /* left by shift (right by -shift) */
    uint8_t mask;
    uint16_t run, pad; /* run > 1: that many whole bytes from src.. to dst.. (mask 255, shift 0) */
} bk_pack_term;

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    int64_t row_bytes;
    int block_bytes, blocks;
    const bk_pack_term *terms;
    int n_terms;
    const uint8_t *flips; /* 8 * block_bytes */
    void (*block)(const uint8_t *const *in, uint8_t *out); /* bk_pack_x8: one group's block, by hand */
} pack_job;

static void pack_chunk(const void *p, int g0, int g1) {
    const pack_job *j = p;
    const bk_pack_term *terms = j->terms;
    const uint8_t *flips = j->flips;
    int n_terms = j->n_terms, blocks = j->blocks, block_bytes = j->block_bytes, out_bytes = 8 * block_bytes;
    int64_t group_bytes = 8 * j->row_bytes;
    for (int g = g0; g < g1; g++)
        for (int s = 0; s < blocks; s++) {
            /* restrict: the stores to out cannot touch in or the terms, which then stay in registers */
            const uint8_t *restrict in = j->src + g * group_bytes + (int64_t)s * block_bytes;
            uint8_t *restrict out = j->dst + g * group_bytes + (int64_t)s * out_bytes;
            memcpy(out, flips, out_bytes);
            for (int t = 0; t < n_terms; t++) {
                bk_pack_term e = terms[t];
                if (e.run > 1) {
                    for (int k = 0; k < e.run; k++) out[e.dst + k] ^= in[e.src + k];
                } else {
                    unsigned v = in[e.src] & e.mask;
                    out[e.dst] ^= (uint8_t)(e.shift >= 0 ? v << e.shift : v >> -e.shift);
                }
            }
        }
}

/* groups of 8 rows (row_bytes each, `blocks` blocks of block_bytes) from src into dst, interleaved */
void bk_pack_groups(const uint8_t *src, uint8_t *dst, int64_t groups, int64_t row_bytes, int block_bytes,
                    const bk_pack_term *terms, int n_terms, const uint8_t *flips) {
    pack_job j = {src, dst, row_bytes, block_bytes, (int)(row_bytes / block_bytes), terms, n_terms, flips, NULL};
    parallel_rows(pack_chunk, &j, (int)groups, 8);
}

/* Q4_K, Q6_K, Q8_0, Q4_0 and Q4_1 written out by hand: Q6_K's, Q8_0's and Q4_0/Q4_1's layouts move
 * 6-bit codes, single bytes and nibbles, one program term each, which the generic packer runs
 * slowly (the default model's Q4_1 at 0.2 GB/s: half its load); Q4_K, the most common, goes faster
 * as whole 8-byte copies. The layouts are quant/gguf_interleave.py's
 * (_pack_q6_k, _small), the kernels' (q4k_x8.h, q8_x8.h). */
BK_INLINE uint64_t bytes8(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

#define NIBBLES 0x0F0F0F0F0F0F0F0FULL
#define PAIRS 0x0303030303030303ULL

/* a Q6_K super-block's 8 rows (in[r]) -> the layout's 1680 bytes, 8 bytes (a row's part of a vector)
 * at a time: weight 128h + x's low nibble is ql byte 64h + x % 64's (high nibble for x >= 64), its
 * top pair qh byte 128 + 32h + x % 32's bits 2 (x / 32) */
static void pack_q6k_block(const uint8_t *const *in, uint8_t *restrict out) {
    for (int q = 0; q < 8; q++) {
        uint8_t *c = out + q * 192;
        for (int v = 0; v < 2; v++) { /* vector u = 2q + v, row r: weights 8u + i (low) and 128 + 8u + i (high) */
            int u = 2 * q + v, off = u < 8 ? 8 * u : 8 * u - 64, sh = u < 8 ? 0 : 4;
            for (int r = 0; r < 8; r++) {
                uint64_t w = (bytes8(in[r] + off) >> sh & NIBBLES) | (bytes8(in[r] + 64 + off) >> sh & NIBBLES) << 4;
                memcpy(c + v * 64 + r * 8, &w, 8);
            }
        }
        int off = 128 + 16 * (q & 1), sh = 2 * (q >> 1); /* weights 16q + i, 128 + 16q + i, 16q + 8 + i, 136 + 16q + i */
        for (int r = 0; r < 8; r++) {
            uint64_t w = (bytes8(in[r] + off) >> sh & PAIRS) | (bytes8(in[r] + off + 32) >> sh & PAIRS) << 2 |
                         (bytes8(in[r] + off + 8) >> sh & PAIRS) << 4 | (bytes8(in[r] + off + 40) >> sh & PAIRS) << 6;
            memcpy(c + 128 + r * 8, &w, 8);
        }
    }
    for (int q = 0; q < 4; q++)
        for (int r = 0; r < 8; r++) memcpy(out + 1536 + q * 32 + 4 * r, in[r] + 192 + 4 * q, 4);
    for (int r = 0; r < 8; r++) memcpy(out + 1664 + 2 * r, in[r] + 208, 2);
}

/* a Q4_K super-block's 8 rows -> the layout's 1152 bytes: vector u, row r = the row's code bytes
 * 8u.., then the 8 d's, the 8 -dmin's (the fp16 sign flipped: the kernel adds the minimum term) and
 * the scale bytes 4 at a time */
static void pack_q4k_block(const uint8_t *const *in, uint8_t *restrict out) {
    for (int u = 0; u < 16; u++)
        for (int r = 0; r < 8; r++) memcpy(out + u * 64 + r * 8, in[r] + 16 + 8 * u, 8);
    for (int r = 0; r < 8; r++) {
        memcpy(out + 1024 + 2 * r, in[r], 2);
        out[1040 + 2 * r] = in[r][2];
        out[1041 + 2 * r] = in[r][3] ^ 0x80;
    }
    for (int q = 0; q < 3; q++)
        for (int r = 0; r < 8; r++) memcpy(out + 1056 + q * 32 + 4 * r, in[r] + 4 + 4 * q, 4);
}

/* a Q8_0 block's 8 rows -> vector c, lane 8r + i: weight 8c + i of rows r (low byte) and 4 + r (high
 * byte); then the 8 d's */
static void pack_q8_0_block(const uint8_t *const *in, uint8_t *restrict out) {
    for (int c = 0; c < 4; c++)
        for (int r = 0; r < 4; r++) {
            const uint8_t *lo = in[r] + 2 + 8 * c, *hi = in[4 + r] + 2 + 8 * c;
#if defined(__SSE2__)
            __m128i a = _mm_loadl_epi64((const __m128i *)lo), b = _mm_loadl_epi64((const __m128i *)hi);
            _mm_storeu_si128((__m128i *)(out + c * 64 + r * 16), _mm_unpacklo_epi8(a, b));
#else
            for (int i = 0; i < 8; i++) out[c * 64 + r * 16 + 2 * i] = lo[i], out[c * 64 + r * 16 + 2 * i + 1] = hi[i];
#endif
        }
    for (int r = 0; r < 8; r++) memcpy(out + 256 + 2 * r, in[r], 2);
}

/* a Q4_0 / Q4_1 block's 8 rows (its `fields` fp16 fields, then 16 code bytes: weight i low nibble,
 * i + 16 high) -> two vectors of 32 uint16 lanes, lane 8r + i of vector V holding weight 8c + i of
 * rows r and 4 + r in nibbles c = 2V (low byte) and 2V + 1 (high byte), each row r's code below row
 * 4 + r's; then the 8 rows' d (and m): gguf_interleave._q4_lanes' layout, the kernels' (q8_x8.h) */
BK_INLINE void pack_q4_block(const uint8_t *const *in, uint8_t *restrict out, int fields) {
    int head = 2 * fields;
    for (int V = 0; V < 2; V++)
        for (int r = 0; r < 4; r++) {
            int sh = 4 * V;
            uint64_t lo = (bytes8(in[r] + head) >> sh & NIBBLES) | (bytes8(in[4 + r] + head) >> sh & NIBBLES) << 4,
                     hi = (bytes8(in[r] + head + 8) >> sh & NIBBLES) | (bytes8(in[4 + r] + head + 8) >> sh & NIBBLES) << 4;
            uint8_t *o = out + V * 64 + r * 16;
#if defined(__SSE2__)
            _mm_storeu_si128((__m128i *)o, _mm_unpacklo_epi8(_mm_cvtsi64_si128((long long)lo),
                                                             _mm_cvtsi64_si128((long long)hi)));
#else
            for (int i = 0; i < 8; i++) o[2 * i] = (uint8_t)(lo >> 8 * i), o[2 * i + 1] = (uint8_t)(hi >> 8 * i);
#endif
        }
    for (int f = 0; f < fields; f++)
        for (int r = 0; r < 8; r++) memcpy(out + 128 + 16 * f + 2 * r, in[r] + 2 * f, 2);
}

static void pack_q4_0_block(const uint8_t *const *in, uint8_t *restrict out) { pack_q4_block(in, out, 1); }
static void pack_q4_1_block(const uint8_t *const *in, uint8_t *restrict out) { pack_q4_block(in, out, 2); }

static void pack_x8_chunk(const void *p, int g0, int g1) {
    const pack_job *j = p;
    int64_t group_bytes = 8 * j->row_bytes;
    for (int g = g0; g < g1; g++)
        for (int s = 0; s < j->blocks; s++) {
            const uint8_t *in[8];
            for (int r = 0; r < 8; r++) in[r] = j->src + g * group_bytes + r * j->row_bytes + (int64_t)s * j->block_bytes;
            j->block(in, j->dst + g * group_bytes + (int64_t)s * 8 * j->block_bytes);
        }
}

/* groups of 8 rows of GGUF type qtype (12: Q4_K, 14: Q6_K, 8: Q8_0, 2: Q4_0, 3: Q4_1) from src into
 * dst, interleaved; -1 for another type (bk_pack_groups takes those) */
int bk_pack_x8(const uint8_t *src, uint8_t *dst, int64_t groups, int64_t row_bytes, int qtype) {
    int block_bytes = qtype == 12 ? 144 : qtype == 14 ? 210 : qtype == 8 ? 34 : qtype == 2 ? 18 : qtype == 3 ? 20 : 0;
    if (!block_bytes) return -1;
    pack_job j = {src, dst, row_bytes, block_bytes, (int)(row_bytes / block_bytes), NULL, 0, NULL,
                  qtype == 12 ? pack_q4k_block : qtype == 14 ? pack_q6k_block : qtype == 8 ? pack_q8_0_block :
                  qtype == 2 ? pack_q4_0_block : pack_q4_1_block};
    parallel_rows(pack_x8_chunk, &j, (int)groups, 8);
    return 0;
}

/* ------------------------------------------------------------------ entry points */
#define MAX_JOINED 32 /* a decode step's routed experts' gate and up (decoder.c moe): up to 16 experts */
#define LANES_OK 16 /* decoder.c works in whole vectors of 16 floats */

typedef struct {
    const bk_weight *ws; /* weights on the same input, outputs side by side */
    int nw, M;
    int starts[MAX_JOINED + 1]; /* weight i's rows are starts[i]..starts[i + 1] of the joined rows */
    const float *x;
    bk_xq xq; /* x quantized (int_dot.h), for the weights with integer blocks */
    float *y;
    int level;
    const struct bk_outlier *o; /* exact outlier inputs to add to each chunk's outputs (below), or NULL */
    int no;
    const int32_t *stream;      /* NULL: their columns are in the weights' caches; else each column's
                                   place among its 256-column block's wanted ones (stream_outliers) */
    int fill;                   /* some cached columns are reserved, not yet dequantized: each chunk fills its rows */
} matmul_job;

/* Integer products for the types that have them (0: every type dequantizes to float; tests, bench) */
static int int_dot = 1;

void bk_int_dot(int on) { int_dot = on; }

/* 8-bit activations for the K-quants (int8_dot.h; 0: int_dot.h's 16-bit ones) */
static int act8 = 1;

void bk_act8(int on) { act8 = on; }

/* A row whose 8-bit activations round coarsely goes through the products twice: as itself and as
 * its rounding's remainder, each on the 8-bit grid, and the two results are added. The remainder's
 * own grid is about 254 times finer, so the row ends about as close as 16-bit activations would put
 * it, for one more activation row in the same pass over the weights. Coarse: the rounding's squared
 * error above split_err times the row's squared norm without each block's largest input (which sets
 * the grid and would hide the rest). A Gaussian row stays near 7e-5 (a 256-block's maximum is ~3.5
 * sigma); the MLP's down projection takes the gated activation, heavy-tailed, where one outlier per
 * 256 leaves the rest a few levels (1e-2), and it carried nearly all the K-quants' KL to the widened
 * file (bench/RESULTS.md). The choice is the row's own, so a row's bits never depend on its batch.
 * 0 (the default: prefill, compute-bound, pays for the extra rows) never; 1e-3 is the measured
 * setting (BRISK_ACT8_SPLIT). */
static float split_err = 0.0f;

void bk_act8_split(float err) { split_err = err; }

/* Exact outlier inputs. An 8-bit activation block (256 inputs, one scale) whose rounding is coarse
 * (tiles.c bk_row_outliers: one outlier leaves the rest a few levels) gives up its largest inputs (up to
 * OUTLIERS_PER_BLOCK): they are zeroed before the block is quantized, so the rest get a finer grid,
 * and their products with the weight's columns are added in float afterwards. The MLP's down
 * projection takes the heavy-tailed gated activation: with it the K-quant files' KL to the widened
 * file falls 10-30x (Gemma 3 Q4_K_M 1.7e-2 -> 6.8e-4, Q3_K_M 2.6e-2 -> 9.0e-4 at the default 2.5e-4,
 * bench/RESULTS.md) for 10-12% of prefill, where the remainder pass above (74% of the down
 * projection's rows run twice) costs 19%.
 * The columns are dequantized on need into a bounded cache per weight (bk_columns). A row's choice
 * and sums are its own, and a column's floats are the same whether cached or dequantized again, so a
 * row's bits depend neither on its batch nor on what ran before. 0 turns it off (BRISK_ACT8_OUTLIERS;
 * default 2.5e-4, native.py). */
static float outlier_err = 0.0f;

void bk_act8_outliers(float err) { outlier_err = err; }

/* A weight's dequantized columns, at most cap of them (native.py sizes it from the weight's bytes):
 * the columns a text's outliers touch keep growing with the text (an unbounded cache reached 188 MB
 * on a 1.1B model after 1280 tokens). A place's mark: 0 idle, 1 used since the clock hand passed it,
 * 2 needed by the running product (never evicted), 3 needed and not yet dequantized. */
typedef struct {
    int N, K, n, cap, room, hand; /* n places taken, room allocated (grows to cap) */
    int level;                    /* the kernels' level that dequantized them (-1: none yet) */
    long long filled;             /* columns dequantized so far (tests, benchmarks) */
    int32_t *slot;                /* [K]: a column's place, or -1 */
    int32_t *col;                 /* [cap]: a place's column */
    uint8_t *mark;                /* [cap] */
    int32_t *missing;             /* [cap]: the columns reserved (mark 3) by the running product, by block */
    int nmissing;
    float *vals;                  /* [room][N] */
} bk_columns;

/* One lock for every cache, held through an outlier product: the pool runs one job at a time anyway */
static pthread_mutex_t columns_lock = PTHREAD_MUTEX_INITIALIZER;

void *bk_columns_new(int N, int K, int cap) {
    if (N <= 0 || K <= 0 || cap <= 0) return NULL;
    bk_columns *c = calloc(1, sizeof *c);
    cap = cap < K ? cap : K;
    if (c)
        c->slot = malloc(sizeof(int32_t) * K), c->col = malloc(sizeof(int32_t) * cap), c->mark = calloc(cap, 1),
        c->missing = malloc(sizeof(int32_t) * cap);
    if (!c || !c->slot || !c->col || !c->mark || !c->missing) {
        if (c) free(c->slot), free(c->col), free(c->mark), free(c->missing);
        free(c);
        return NULL;
    }
    for (int k = 0; k < K; k++) c->slot[k] = -1;
    c->N = N, c->K = K, c->cap = cap, c->level = -1;
    return c;
}

void bk_columns_free(void *p) {
    bk_columns *c = p;
    if (!c) return;
    free(c->slot), free(c->col), free(c->mark), free(c->missing), free(c->vals), free(c);
}

/* how many columns are cached now (which 0), the most that can be (1), dequantized so far (2) */
long long bk_columns_count(const void *p, int which) {
    const bk_columns *c = p;
    return !c ? 0 : which == 0 ? c->n : which == 1 ? c->cap : c->filled;
}

/* The coarse blocks of x [M, K] (tiles.c bk_row_outliers: their largest inputs; what coarse means is
 * below), row by row across the threads, each row's entries in their place in o (OUTLIERS_PER_BLOCK
 * per block), its count in count[m]; x2 = x with those inputs zeroed. */
typedef struct {
    const float *x;
    float *x2;
    int K, level;
    bk_outlier *o;
    int *count;
} scan_job;

static void scan_rows(const void *a, int m0, int m1) {
    const scan_job *s = a;
    int per = OUTLIERS_PER_BLOCK * (s->K / 256);
    for (int m = m0; m < m1; m++) {
        const float *xr = s->x + (int64_t)m * s->K;
        float *x2r = s->x2 + (int64_t)m * s->K;
        bk_outlier *o = s->o + (int64_t)m * per;
        int n = s->count[m] = KERNELS[s->level].row_outliers(xr, m, s->K, outlier_err, o);
        memcpy(x2r, xr, sizeof(float) * s->K);
        for (int i = 0; i < n; i++) x2r[o[i].k] = 0.0f;
    }
}

/* a place for one more column: a new one while under cap, else the clock's next idle one */
static int take_place(bk_columns *c) {
    if (c->n < c->cap) {
        if (c->n == c->room) {
            int room = c->room * 2 > c->n + 16 ? c->room * 2 : c->n + 16;
            room = room < c->cap ? room : c->cap;
            float *v = realloc(c->vals, sizeof(float) * (size_t)room * c->N);
            if (!v) return -1;
            c->vals = v, c->room = room;
        }
        return c->n++;
    }
    for (int tries = 0; tries < 3 * c->cap; tries++) { /* 2 sweeps clear every 1; the caller keeps some place < 2 */
        int h = c->hand;
        c->hand = (h + 1) % c->cap;
        if (c->mark[h] >= 2) continue;
        if (c->mark[h] == 1) {
            c->mark[h] = 0;
            continue;
        }
        c->slot[c->col[h]] = -1;
        return h;
    }
    return -1;
}

enum { STREAM_ROWS = 64 }; /* rows a slab of 256 columns holds (fill_rows, stream_outliers) */

/* Places in the weight's cache for the entries' columns (at most cap of them), marked needed (2),
 * the missing ones reserved (3) and listed by block for the product's chunks to dequantize
 * (fill_rows): each thread fills the rows it has just multiplied, while they are in its cache, where
 * one thread filling whole columns first left the others waiting. Called with columns_lock held;
 * the count of reserved columns, or -2 out of memory. */
static int reserve_columns(bk_columns *c, const bk_outlier *o, int n, int level) {
    if (c->level != level) { /* another level's floats (fused multiply-adds differ): none kept */
        for (int k = 0; k < c->K; k++) c->slot[k] = -1;
        c->n = 0, c->hand = 0, c->level = level;
    }
    c->nmissing = 0;
    for (int i = 0; i < n; i++) {
        int k = o[i].k, s = c->slot[k];
        if (s >= 0) {
            c->mark[s] = c->mark[s] == 3 ? 3 : 2;
            continue;
        }
        if ((s = take_place(c)) < 0) return -2;
        c->slot[k] = s, c->col[s] = k, c->mark[s] = 3;
        c->missing[c->nmissing++] = k;
    }
    for (int i = 1; i < c->nmissing; i++) /* by column, so a block's columns come together */
        for (int j = i; j > 0 && c->missing[j - 1] > c->missing[j]; j--) {
            int32_t t = c->missing[j];
            c->missing[j] = c->missing[j - 1], c->missing[j - 1] = t;
        }
    return c->nmissing;
}

/* Rows n0..n1 of the reserved columns: each 256-column block that holds some dequantized by the
 * level's column function (the layouts it reads: a group's 8 rows at once) or its slab function
 * (the rest, slab: STREAM_ROWS x 256 floats), the floats stream_outliers reads too, whatever the
 * rows' range: a column's floats do not depend on the call that made them. */
static void fill_rows(const bk_weight *w, bk_columns *c, int level, int n0, int n1, float *slab) {
    int by_column = KERNELS[level].columns(w, NULL, 0, 0, 0, NULL);
    for (int a = 0, b; a < c->nmissing; a = b) {
        int k0 = c->missing[a] / 256 * 256;
        for (b = a; b < c->nmissing && c->missing[b] < k0 + 256; b++) {}
        if (by_column) {
            float *outs[256];
            for (int i = a; i < b; i++) outs[i - a] = c->vals + (size_t)c->slot[c->missing[i]] * c->N + n0;
            KERNELS[level].columns(w, c->missing + a, b - a, n0, n1, outs);
            continue;
        }
        for (int r0 = n0; r0 < n1; r0 += STREAM_ROWS) {
            int r1 = r0 + STREAM_ROWS < n1 ? r0 + STREAM_ROWS : n1;
            KERNELS[level].slab(w, r0, r1, k0, k0 + 256, slab);
            for (int i = a; i < b; i++) {
                float *v = c->vals + (size_t)c->slot[c->missing[i]] * c->N;
                for (int r = r0; r < r1; r++) v[r] = slab[(r - r0) * 256 + c->missing[i] - k0];
            }
        }
    }
}

/* the product's chunks done (ok), the reserved columns are whole; else (a failed reservation)
 * they are given up: their places idle, their columns uncached (a place evicted later may uncache
 * its column's newer place too: a lost entry, dequantized again on need, never wrong floats) */
static void filled_columns(bk_columns *c, int ok) {
    for (int i = 0; i < c->nmissing; i++) {
        int k = c->missing[i];
        if (ok) c->mark[c->slot[k]] = 2;
        else c->mark[c->slot[k]] = 0, c->slot[k] = -1;
    }
    c->filled += ok ? c->nmissing : 0, c->nmissing = 0;
}

/* the product done: the columns it needed become evictable again (used: 1) */
static void release_columns(bk_columns *c, const bk_outlier *o, int n) {
    for (int i = 0; i < n; i++)
        if (c->slot[o[i].k] >= 0) c->mark[c->slot[o[i].k]] = 1;
}

static _Thread_local float *tile_buf;
static _Thread_local size_t tile_cap;

/* a thread's scratch of at least n floats, kept between calls */
static float *scratch(float **buf, size_t *cap, size_t n) {
    if (*cap < n) {
        free(*buf);
        *buf = aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        *cap = *buf ? n : 0;
    }
    return *buf;
}

/* The entries' adds without the cache, for a product whose entries' columns do not fit it (a prefill's
 * down projection touches hundreds): rows n0..n1 of each 256-column block that holds an entry
 * dequantized by the same function a fill uses, its wanted columns (at[k]: a column's place among
 * its block's, or -1) copied out contiguous, so the sums are the cache's to the bit (the same floats,
 * each output's entries in the same order), for 1 / (K / 256) of the rows' dequant a block, shared
 * by the product's rows. */
static void stream_outliers(const bk_weight *w, int level, const bk_outlier *o, int no, const int32_t *at, float *y,
                            int64_t ldy, int n0, int n1, float *slab /* 2 x STREAM_ROWS x 256 */) {
    enum { R = STREAM_ROWS };
    float *cols = slab + R * 256;
    int by_column = KERNELS[level].columns(w, NULL, 0, 0, 0, NULL); /* one weight a row, a block's columns at once */
    for (int r0 = n0; r0 < n1; r0 += R) {
        int r1 = r0 + R < n1 ? r0 + R : n1, rows = r1 - r0;
        for (int k0 = 0; k0 < w->K; k0 += 256) {
            int any = 0;
            for (int k = k0; k < k0 + 256; k++) any |= at[k] >= 0;
            if (!any) continue;
            if (by_column) {
                int ks[256], nk = 0;
                float *outs[256];
                for (int k = k0; k < k0 + 256; k++)
                    if (at[k] >= 0) ks[nk] = k, outs[nk++] = cols + at[k] * R;
                KERNELS[level].columns(w, ks, nk, r0, r1, outs);
            } else {
                KERNELS[level].slab(w, r0, r1, k0, k0 + 256, slab);
                for (int k = k0; k < k0 + 256; k++)
                    if (at[k] >= 0)
                        for (int r = 0; r < rows; r++) cols[at[k] * R + r] = slab[r * 256 + (k - k0)];
            }
            KERNELS[level].add_entries(o, no, k0, k0 + 256, cols, at, R, r0, y, ldy, r0, r1);
        }
    }
}

static void matmul_chunk(const void *a, int n0, int n1) {
    const matmul_job *j = a;
    size_t need = 0;
    for (int i = 0; i < j->nw; i++) {
        size_t n = bk_tile_floats(j->ws + i, j->M);
        need = n > need ? n : need;
    }
    float *buf = scratch(&tile_buf, &tile_cap, need + (j->stream || j->fill ? 2 * STREAM_ROWS * 256 : 0));
    if (!buf) return;
    for (int i = 0; i < j->nw; i++) { /* the part of each weight inside this chunk */
        int lo = n0 > j->starts[i] ? n0 : j->starts[i], hi = n1 < j->starts[i + 1] ? n1 : j->starts[i + 1];
        if (lo >= hi) continue;
        const bk_weight *w = j->ws + i;
        float *y = j->y + j->starts[i];
        int ints = w->layout == BK_X8 ? (bk_act8_type(w->type) ? j->xq.q8 : (const void *)j->xq.q) != NULL /* else
                                                                  dequantized tiles: they read the layout */
                   : bk_act8_type(w->type) && j->xq.q8 ? 1 : bk_super_type(w->type) ? j->xq.q256 != NULL : j->xq.q != NULL && bk_int_weight(w);
        bk_columns *c = j->no && !j->stream ? w->columns : NULL;
        int a0 = lo - j->starts[i], a1 = hi - j->starts[i], fill = c && j->fill && c->nmissing;
        /* a cache fill goes STREAM_ROWS rows at a time right behind the product, which has just read them */
        for (int a = a0, b; a < a1; a = b) {
            b = fill && (a / STREAM_ROWS + 1) * STREAM_ROWS < a1 ? (a / STREAM_ROWS + 1) * STREAM_ROWS : a1;
            if (ints)
                KERNELS[j->level].int_rows(w, a, b, j->M, &j->xq, y, j->starts[j->nw], buf);
            else
                KERNELS[j->level].tile(w, a, b, j->M, j->x, y, j->starts[j->nw], buf);
            if (fill) fill_rows(w, c, j->level, a, b, buf + need);
        }
        if (j->no && j->stream) /* in the chunk: its outputs are still in cache, and the threads share the work */
            stream_outliers(w, j->level, j->o, j->no, j->stream, y, j->starts[j->nw], a0, a1, buf + need);
        else if (c) /* each entry's column from the cache: y[m, n] += v * column k [n] */
            KERNELS[j->level].add_entries(j->o, j->no, 0, c->K, c->vals, c->slot, c->N, 0, y, j->starts[j->nw], a0, a1);
    }
}

static int shape_ok(const bk_weight *w) {
    if (w->K <= 0 || w->N <= 0 || w->K % 32) return 0;
    if (w->type == BK_I4G) return w->group > 0 && w->group % 2 == 0 && w->K % w->group == 0;
    if (w->type == BK_I8R || w->type == BK_F32) return 1;
    int bw = bk_block_weights(w->type);
    return bw && w->K % bw == 0;
}

static int matmul_many(const bk_weight *ws, int nw, int M, const float *x, float *y, int level, int may_split);

/* The activations' quantization (int_dot.h, int8_dot.h) row by row across the threads: a prefill's
 * [M, K] by the calling thread alone left the others waiting. Each row's codes are its own. */
enum { QX16, QX256, QX8 };

typedef struct {
    int grid, level, K;
    const float *x;
    void *q, *qp;
    float *s, *sums;
    int16_t *xs, *xm;
} quantize_x_job;

static void quantize_x_rows(const void *a, int m0, int m1) {
    const quantize_x_job *j = a;
    int K = j->K, M = m1 - m0;
    int64_t at = (int64_t)m0 * K, b32 = (int64_t)m0 * (K / QK), b256 = (int64_t)m0 * (K / 256);
    const float *x = j->x + at;
    if (j->grid == QX16) KERNELS[j->level].quantize_x(x, M, K, (int16_t *)j->q + at, j->s + b32, j->sums + b32);
    else if (j->grid == QX256) KERNELS[j->level].quantize_x256(x, M, K, (int16_t *)j->q + at, j->s + b256, j->sums + 32 * b256);
    else KERNELS[j->level].quantize_x8(x, M, K, (int8_t *)j->q + at, (int8_t *)j->qp + at, j->s + b256, j->xs + 16 * b256,
                                       j->xm + 16 * b256);
}

static void quantize_activations(quantize_x_job j, int M) { parallel_rows(quantize_x_rows, &j, M, 16); }

/* The rows of x [M, K] that split (split_err above), their remainders after quantize_x8's rounding
 * (codes q, scales s per 256) appended after x's rows in x2; the count. */
static int split_rows(const float *x, int M, int K, const int8_t *q, const float *s, float *x2, int *split) {
    int extra = 0;
    for (int m = 0; m < M; m++) {
        const float *xr = x + (int64_t)m * K;
        const int8_t *qr = q + (int64_t)m * K;
        float *out = x2 + (int64_t)(M + extra) * K; /* the remainder, kept if the row splits */
        double err = 0.0, rest = 0.0;
        for (int k0 = 0; k0 < K; k0 += 256) {
            float amax = 0.0f, sc = s[((int64_t)m * K + k0) / 256];
            for (int k = k0; k < k0 + 256; k++) {
                float r = out[k] = xr[k] - (float)qr[k] * sc;
                err += (double)r * r;
                rest += (double)xr[k] * xr[k];
                amax = fabsf(xr[k]) > amax ? fabsf(xr[k]) : amax;
            }
            rest -= (double)amax * amax;
        }
        split[m] = err > split_err * rest;
        extra += split[m];
    }
    return extra;
}

/* The product of the job with exact outlier inputs (above), the 8-bit codes written to q.. xm: 1
 * when done, 0 when it does not apply (a weight without a column cache, or no coarse block: the
 * plain product then), negative on failure. The entries are added inside the product's chunks, while
 * those outputs are in cache: from the weights' caches when their columns fit (decode), else from
 * their blocks dequantized by each chunk (stream_outliers), to the same bits. Kept out of
 * matmul_many's own code. */
static __attribute__((noinline)) int outlier_product(matmul_job *j, const float *x, int8_t *q, int8_t *qp, float *s,
                                                     int16_t *xs, int16_t *xm) {
    const bk_weight *ws = j->ws;
    int nw = j->nw, M = j->M, K = ws[0].K, cap = K;
    for (int i = 0; i < nw; i++) {
        const bk_columns *c = ws[i].columns;
        if (!c) return 0;
        cap = c->cap < cap ? c->cap : cap;
    }
    static _Thread_local float *obuf;
    static _Thread_local size_t ocap;
    size_t n = (size_t)M * K;
    /* x2 [M, K], the entries (3 words each, at most OUTLIERS_PER_BLOCK per block), a word per column, a count per row */
    float *x2 = scratch(&obuf, &ocap, n + 3 * OUTLIERS_PER_BLOCK * (n / 256) + K + M);
    if (!x2) return -2;
    bk_outlier *o = (bk_outlier *)(x2 + n);
    int32_t *at = (int32_t *)(o + OUTLIERS_PER_BLOCK * (n / 256)); /* a wanted column's place among its block's, else -1 */
    int *count = at + K, no = 0, per = OUTLIERS_PER_BLOCK * (K / 256);
    /* x2: x with those inputs zeroed (the rest of their blocks get a finer grid) */
    scan_job sj = {x, x2, K, j->level, o, count};
    parallel_rows(scan_rows, &sj, M, 4);
    for (int m = 0; m < M; m++) { /* the rows' entries one after another, in row order */
        memmove(o + no, o + (int64_t)m * per, sizeof(bk_outlier) * count[m]);
        no += count[m];
    }
    if (!no) return 0;
    for (int k = 0; k < K; k++) at[k] = -1;
    for (int i = 0; i < no; i++) at[o[i].k] = 0;
    int distinct = 0;
    for (int k0 = 0; k0 < K; k0 += 256)
        for (int k = k0, got = 0; k < k0 + 256; k++)
            if (at[k] == 0) at[k] = got++, distinct++;
    quantize_activations((quantize_x_job){QX8, j->level, K, x2, q, qp, s, NULL, xs, xm}, M);
    j->xq.q8 = q, j->xq.q8p = qp, j->xq.s8 = s, j->xq.xs8 = xs, j->xq.xm8 = xm;
    j->o = o, j->no = no;
    if (distinct > cap) {
        j->stream = at;
        parallel_rows(matmul_chunk, j, j->starts[nw], 32);
        j->o = NULL, j->no = 0, j->stream = NULL;
        return 1;
    }
    pthread_mutex_lock(&columns_lock);
    int rc = 0;
    for (int i = 0; i < nw && rc >= 0; i++) {
        rc = reserve_columns(ws[i].columns, o, no, j->level);
        j->fill |= rc > 0;
    }
    if (rc >= 0) parallel_rows(matmul_chunk, j, j->starts[nw], 32);
    for (int i = 0; i < nw; i++) {
        filled_columns(ws[i].columns, rc >= 0);
        release_columns(ws[i].columns, o, no);
    }
    pthread_mutex_unlock(&columns_lock);
    j->o = NULL, j->no = 0, j->fill = 0;
    rc = rc > 0 ? 0 : rc;
    return rc ? rc : 1;
}

static _Thread_local float *split_buf;
static _Thread_local size_t split_cap;

/* y [M, N1 + N2 + ...] = x [M, K] times each of the nw weights' transposes, outputs side by side (q/k/v
 * or gate/up in one call, without joining their tensors), rows split across the threads.
 * Returns 0, or -1 for a type or shape it does not take (y untouched). */
int bk_matmul_many(const bk_weight *ws, int nw, int M, const float *x, float *y, int level) {
    return matmul_many(ws, nw, M, x, y, level, 1);
}

/* may_split: whether coarse rows may run their remainder (not for the call that runs them) */
static int matmul_many(const bk_weight *ws, int nw, int M, const float *x, float *y, int level, int may_split) {
    if (nw < 1 || nw > MAX_JOINED) return -1;
    level = clamp_level(level);
    matmul_job j = {ws, nw, M, {0}, x, {0}, y, level};
    int ints = 0, supers = 0, eights = 0;
    for (int i = 0; i < nw; i++) {
        if (!shape_ok(ws + i) || ws[i].K != ws[0].K) return -1;
        j.starts[i + 1] = j.starts[i] + ws[i].N;
        eights |= act8 && bk_act8_type(ws[i].type);
        supers |= bk_super_type(ws[i].type) && !(act8 && bk_act8_type(ws[i].type));
        ints |= bk_int_weight(ws + i) && !bk_super_type(ws[i].type);
    }
    if ((ints || supers || eights) && int_dot) { /* the activations quantized once, by the calling thread, on the grids needed */
        static _Thread_local float *xbuf;
        static _Thread_local size_t xcap;
        size_t n = (size_t)M * ws[0].K, blocks = n / QK, supers_n = n / 256;
        /* floats: 16-bit codes and 2 per block; 16-bit codes and 33 per super-block; two copies of
         * 8-bit codes, 1 float and 32 int16 per super-block */
        float *b = scratch(&xbuf, &xcap, 2 * (n / 2 + 2 * blocks) + 33 * supers_n + n / 2 + 17 * supers_n);
        if (!b) return -2;
        if (eights) {
            float *e = b + 2 * (n / 2 + 2 * blocks) + 33 * supers_n, *s = e + n / 2;
            int8_t *q = (int8_t *)e, *qp = q + n;
            int16_t *xs = (int16_t *)(s + supers_n), *xm = xs + 16 * supers_n;
            if (outlier_err > 0.0f && !ints && !supers) { /* every weight here takes 8-bit ones */
                int rc = outlier_product(&j, x, q, qp, s, xs, xm);
                if (rc) return rc > 0 ? 0 : rc;
            }
            quantize_activations((quantize_x_job){QX8, level, ws[0].K, x, q, qp, s, NULL, xs, xm}, M);
            j.xq.q8 = q, j.xq.q8p = qp, j.xq.s8 = s, j.xq.xs8 = xs, j.xq.xm8 = xm;
            if (may_split && split_err > 0.0f && !ints && !supers) { /* every weight here takes 8-bit ones */
                int K = ws[0].K, N = j.starts[nw];
                /* x2: M rows + up to M remainders; y2: their products; split: M flags (as floats' room) */
                float *x2 = scratch(&split_buf, &split_cap, (size_t)2 * M * K + (size_t)2 * M * N + M);
                if (!x2) return -2;
                float *y2 = x2 + (size_t)2 * M * K;
                int *split = (int *)(y2 + (size_t)2 * M * N);
                int extra = split_rows(x, M, K, q, s, x2, split);
                if (extra) {
                    memcpy(x2, x, sizeof(float) * M * K);
                    int rc = matmul_many(ws, nw, M + extra, x2, y2, level, 0);
                    if (rc) return rc;
                    for (int m = 0, e = 0; m < M; m++) {
                        const float *hi = y2 + (int64_t)m * N, *lo = split[m] ? y2 + (int64_t)(M + e++) * N : NULL;
                        float *out = y + (int64_t)m * N;
                        for (int n = 0; n < N; n++) out[n] = lo ? hi[n] + lo[n] : hi[n];
                    }
                    return 0;
                }
            }
        }
        if (ints) {
            float *s = b + n / 2, *sum = s + blocks;
            quantize_activations((quantize_x_job){QX16, level, ws[0].K, x, b, NULL, s, sum}, M);
            j.xq.q = (int16_t *)b, j.xq.s = s, j.xq.sum = sum;
        }
        if (supers) {
            float *b2 = b + n / 2 + 2 * blocks, *s = b2 + n / 2, *bs = s + supers_n;
            quantize_activations((quantize_x_job){QX256, level, ws[0].K, x, b2, NULL, s, bs}, M);
            j.xq.q256 = (int16_t *)b2, j.xq.s256 = s, j.xq.bs256 = bs;
        }
    }
    parallel_rows(matmul_chunk, &j, j.starts[nw], 32);
    return 0;
}

int bk_matmul(const bk_weight *w, int M, const float *x, float *y, int level) {
    return bk_matmul_many(w, 1, M, x, y, level);
}

/* out [n, K] = rows `rows` of the weight, dequantized (embedding lookups, dequantize()). */
int bk_dequant_rows(const bk_weight *w, const int64_t *rows, int n, float *out, int level) {
    if (!shape_ok(w)) return -1;
    for (int i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= w->N) return -1;
    KERNELS[clamp_level(level)].rows(w, rows, n, out);
    return 0;
}

/* Float32 rows [nrows, k] into GGUF blocks of `type` (gguf_quantize.h), rows spread over the threads:
 * 0, or -1 for a type brisk does not write or a k that is not whole blocks. */
typedef struct {
    bkq_fn fn;
    const float *x;
    uint8_t *y;
    int64_t k, row_bytes;
} quantize_job;

static void quantize_chunk(const void *a, int r0, int r1) {
    const quantize_job *j = a;
    for (int r = r0; r < r1; r++) j->fn(j->x + (int64_t)r * j->k, j->y + (int64_t)r * j->row_bytes, j->k);
}

int bk_quantize_rows(int type, const float *x, void *y, int nrows, int64_t k) {
    bkq_fn fn = bkq_for(type);
    int64_t weights = 0, bytes = 0;
#define BK_BLOCK_OF(id, w, b, flags) if (type == (id)) { weights = (w); bytes = (b); }
    BK_TYPE_TABLE(BK_BLOCK_OF)
#undef BK_BLOCK_OF
    if (!fn || !weights || k % weights || nrows < 0) return -1;
    quantize_job j = {fn, x, y, k, k / weights * bytes};
    parallel_rows(quantize_chunk, &j, nrows, 1);
    return 0;
}

/* Rows x [N, dim] through a model's blocks in place (decoder.c), tp a tensor-parallel rank's
 * collectives or NULL: 0, -1 for weights or shapes it does not take, -2 out of memory, BK_TP_* */
int bk_decoder(const bk_arch *a, const bk_layer *layers, int n_layers, const bk_cache *c, int N,
               const int32_t *pos, const int32_t *table, float *x, const bk_tp *tp, int level) {
    if (N < 1 || a->dim % LANES_OK || a->head_dim % LANES_OK || a->ffn % LANES_OK || a->head_dim > 512 ||
        a->n_kv < 1 || a->n_heads % a->n_kv || a->rope_dim < 0 || a->rope_dim > a->head_dim || a->rope_dim % 2)
        return -1;
    for (int l = 0; l < n_layers; l++)
        if ((tp && (layers[l].n_experts || layers[l].o_bias)) || /* tp: rank 0 alone would hold o's bias */
            (layers[l].n_experts && (a->expert_ffn % LANES_OK || a->n_used < 1 || a->n_used > layers[l].n_experts ||
                                     !layers[l].router || !layers[l].experts)))
            return -1;
    return KERNELS[clamp_level(level)].decoder(a, layers, n_layers, c, N, pos, table, x, tp, clamp_level(level));
}

/* Tensor parallelism's same-host collectives (core/tp_shm.py): every rank has a sequence counter in
 * a shared segment. A rank writes its part of collective `seq`, then publishes seq with a release
 * store; a reader that sees seq through an acquire load also sees the part (C11 ordering, which the
 * compiler maps to x86's plain moves and ARM's stlr/ldar). Counters only grow. */
void bk_shm_post(int64_t *counter, int64_t seq) { __atomic_store_n(counter, seq, __ATOMIC_RELEASE); }

/* Until each of n counters (stride bytes apart) holds at least seq: 1, or 0 after `seconds` (the
 * caller checks that its peers live, then waits again). Spins briefly, then yields the core: two
 * ranks on two cores must not keep a peer that still computes from running. */
int bk_shm_wait(const char *counters, int n, int64_t stride, int64_t seq, double seconds) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long spin = 0;; spin++) {
        int ready = 1;
        for (int r = 0; r < n && ready; r++)
            ready = __atomic_load_n((const int64_t *)(counters + r * stride), __ATOMIC_ACQUIRE) >= seq;
        if (ready) return 1;
        if (spin < 256) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            __asm__ __volatile__("yield");
#endif
            continue;
        }
        sched_yield();
        if (spin % 64 == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec) > seconds) return 0;
        }
    }
}

/* Whether process pid runs: its /proc state is not Z or X (a peer that ended is a zombie until its
 * parent collects it). */
static int process_alive(int64_t pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *end = strrchr(buf, ')');
    return end && end[1] == ' ' && end[2] != 'Z' && end[2] != 'X';
}

/* bk_decoder.h; the rounds, banks and checks are tp_shm.Segment's, so the two interleave */
int bk_tp_all_reduce(const bk_tp *tp, float *x, int64_t n) {
    int64_t per = tp->slot / (int64_t)sizeof(float);
    for (int64_t lo = 0; lo < n; lo += per) {
        int64_t m = n - lo < per ? n - lo : per, seq = ++*tp->seq;
        char *bank = tp->base + tp->data + (seq % 2) * tp->world * tp->slot;
        memcpy(bank + tp->rank * tp->slot, x + lo, m * sizeof(float));
        bk_shm_post((int64_t *)(tp->base + tp->rank * tp->line), seq);
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        while (!bk_shm_wait(tp->base, tp->world, tp->line, seq, tp->check)) {
            for (int r = 0; r < tp->world; r++)
                if (r != tp->rank && !process_alive(*(const int64_t *)(tp->base + r * tp->line + 8))) return BK_TP_GONE;
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec) > tp->timeout)
                return BK_TP_TIMEOUT;
        }
        float *y = x + lo;
        memcpy(y, bank, m * sizeof(float));
        for (int r = 1; r < tp->world; r++) {
            const float *s = (const float *)(bank + r * tp->slot);
            for (int64_t i = 0; i < m; i++) y[i] += s[i];
        }
    }
    return 0;
}
