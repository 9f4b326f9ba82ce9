/* brisk's native CPU kernels: matrix products directly on 4-bit and 8-bit quantized weights.
 *
 * A plain C library (no Python or torch headers), loaded with ctypes by quant/native.py, built by
 * the platform's C compiler in about a second. The activations are quantized on the fly to 8 bits
 * per block of 32 (one float scale each), so the inner products are integer dot products (as
 * llama.cpp does): 4-bit codes times int8 activations, 32 at a time, in AVX2 or AVX-512 VNNI.
 *
 * For small models the 8-bit activations cost too much accuracy (measured on SmolLM2-135M: KL 0.02 to
 * the float model, against 0.004 for bf16 activations), so the int4 product also comes with the
 * activations kept in float32 (bk_q4f_*): codes widened to float in registers, float32 sums.
 *
 * Weights (one row per output feature, row-major):
 *   int4: codes uint8 [N, K/2], byte i of a row holds column 2i (low nibble) and 2i+1 (high);
 *         per group of G columns (G a multiple of 32) a bf16 scale s and zero z: w = (q - 8) s + z.
 *   int8: codes int8 [N, K], one float scale per row: w = q s.
 * Every output is computed by the same code in the same order whatever the number of rows M
 * and a row's place among them: a row's result does not depend on its batch (batch-invariant).
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BK_X86 1
#endif

#define QB 32 /* activation block */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ------------------------------------------------------------------ activations -> 8 bits
 * Per block of 32: d = max|x| / 127, q = round(x / d), and the block's sum of q.
 * perm: store the block's even columns first, then the odd ones, matching the int4 codes'
 * nibble order (low nibbles = even columns), so no shuffle is needed in the inner loop. */
static void quantize_row(const float *x, int K, int perm, int8_t *q, float *d, int32_t *sum) {
    for (int b = 0; b < K / QB; b++) {
        const float *xb = x + b * QB;
        float amax = 0.f;
        for (int i = 0; i < QB; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t s = 0;
        for (int i = 0; i < QB; i++) {
            int v = (int)lrintf(xb[i] * inv);
            int at = perm ? (i & 1) * (QB / 2) + (i >> 1) : i;
            q[b * QB + at] = (int8_t)v;
            s += v;
        }
        d[b] = scale;
        sum[b] = s;
    }
}

/* ------------------------------------------------------------------ int4 rows
 * y = sum over blocks b of d_b * (s_g * (dot_b - 8 sum_b) + z_g * sum_b), g = the block's group. */
static float q4_row_scalar(const uint8_t *w, const uint16_t *sc, const uint16_t *zr, int K, int G,
                           const int8_t *q, const float *d, const int32_t *sum) {
    float acc = 0.f;
    for (int b = 0; b < K / QB; b++) {
        const uint8_t *wb = w + b * (QB / 2);
        const int8_t *qb = q + b * QB;
        int32_t dot = 0;
        for (int i = 0; i < QB / 2; i++) dot += (wb[i] & 15) * qb[i] + (wb[i] >> 4) * qb[QB / 2 + i];
        int g = b * QB / G;
        float s = bf16_to_f32(sc[g]), z = bf16_to_f32(zr[g]);
        acc += d[b] * s * (float)dot + (z - 8.f * s) * d[b] * (float)sum[b];
    }
    return acc;
}

#ifdef BK_X86
__attribute__((target("avx2,fma"))) static inline int32_t hsum_i32_avx2(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

__attribute__((target("avx2,fma"))) static inline float hsum_f32_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 codes of one block as bytes 0..15, even columns first (the activations' order). */
__attribute__((target("avx2,fma"))) static inline __m256i q4_codes(const uint8_t *w) {
    __m128i c = _mm_loadu_si128((const __m128i *)w);
    const __m128i low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c, 4), low), _mm_and_si128(c, low));
}

/* R rows of int4 weights against one activation row, 8 lanes of float partial sums per row:
 * lane sums of the integer products scaled by d_b * s_g, plus the zero terms (z_g - 8 s_g) * d_b *
 * sum_b as a scalar; the same operations in the same order for every row and every M. */
#define Q4_TILE(NAME, TARGET, DOT)                                                                      \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, const uint16_t *sc,               \
                                                      const uint16_t *zr, size_t row_bytes, size_t ng,    \
                                                      int R, int K, int G, const int8_t *q,               \
                                                      const float *d, const float *ds, float *out) {      \
        __m256 acc[4];                                                                                   \
        float zacc[4];                                                                                   \
        for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); zacc[r] = 0.f; }                      \
        for (int b = 0; b < K / QB; b++) {                                                               \
            __m256i x = _mm256_loadu_si256((const __m256i *)(q + b * QB));                               \
            int g = b * QB / G;                                                                          \
            for (int r = 0; r < R; r++) {                                                                \
                __m256i codes = q4_codes(w + r * row_bytes + b * (QB / 2));                              \
                float s = bf16_to_f32(sc[r * ng + g]), z = bf16_to_f32(zr[r * ng + g]);                  \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT), _mm256_set1_ps(d[b] * s), acc[r]);     \
                zacc[r] += (z - 8.f * s) * ds[b];                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < R; r++) out[r] = hsum_f32_avx2(acc[r]) + zacc[r];                            \
    }

Q4_TILE(q4_tile_avx2, "avx2,fma", _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)))
Q4_TILE(q4_tile_vnni, "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni", _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, x))
#endif

/* ------------------------------------------------------------------ int8 rows: y = s * sum_b d_b dot_b */
static float q8_row_scalar(const int8_t *w, int K, const int8_t *q, const float *d) {
    float acc = 0.f;
    for (int b = 0; b < K / QB; b++) {
        int32_t dot = 0;
        for (int i = 0; i < QB; i++) dot += w[b * QB + i] * q[b * QB + i];
        acc += d[b] * (float)dot;
    }
    return acc;
}

#ifdef BK_X86
__attribute__((target("avx2,fma"))) static float q8_row_avx2(const int8_t *w, int K, const int8_t *q, const float *d) {
    const __m256i ones = _mm256_set1_epi16(1);
    float acc = 0.f;
    for (int b = 0; b < K / QB; b++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(w + b * QB));
        __m256i x = _mm256_loadu_si256((const __m256i *)(q + b * QB));
        /* maddubs takes unsigned x signed: |a| times x with a's sign moved onto x */
        __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(x, a));
        acc += d[b] * (float)hsum_i32_avx2(_mm256_madd_epi16(p, ones));
    }
    return acc;
}
#endif

/* ------------------------------------------------------------------ dispatch */
enum { LEVEL_SCALAR = 0, LEVEL_AVX2 = 1, LEVEL_VNNI = 2 };

int bk_cpu_level(void) {
#ifdef BK_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return LEVEL_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return LEVEL_AVX2;
#endif
    return LEVEL_SCALAR;
}

static int clamp_level(int level) {
    int best = bk_cpu_level();
    return level < 0 || level > best ? best : level;
}

/* y [M, N] = x [M, K] times the int4 weight; rows n0..n1 of the output only (a thread's share).
 * scratch: M * (K + K/32 * 8) bytes, holding the quantized activations (filled when n0 == 0 or
 * quantized = 0; a caller splitting rows across threads quantizes once, first). */
void bk_q4_quantize_x(const float *x, int M, int K, void *scratch) {
    int8_t *q = (int8_t *)scratch;
    float *d = (float *)(q + (size_t)M * K);
    int32_t *s = (int32_t *)(d + (size_t)M * (K / QB));
    for (int m = 0; m < M; m++)
        quantize_row(x + (size_t)m * K, K, 1, q + (size_t)m * K, d + (size_t)m * (K / QB), s + (size_t)m * (K / QB));
}

void bk_q4_rows(const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, int N, int K, int G,
                int M, const void *scratch, float *y, int n0, int n1, int level) {
    const int8_t *q = (const int8_t *)scratch;
    const float *d = (const float *)(q + (size_t)M * K);
    const int32_t *s = (const int32_t *)(d + (size_t)M * (K / QB));
    int nb = K / QB, ng = K / G;
    level = clamp_level(level);
    float *ds = malloc(sizeof(float) * (size_t)M * nb); /* d_b * sum_b, the zero terms' factor */
    for (size_t i = 0; i < (size_t)M * nb; i++) ds[i] = d[i] * (float)s[i];
    for (int n = n0; n < n1; n += 4) {
        int R = n1 - n < 4 ? n1 - n : 4;
        const uint8_t *w = codes + (size_t)n * (K / 2);
        const uint16_t *sc = scales + (size_t)n * ng, *zr = zeros + (size_t)n * ng;
        for (int m = 0; m < M; m++) {
            const int8_t *qm = q + (size_t)m * K;
            const float *dm = d + (size_t)m * nb, *dsm = ds + (size_t)m * nb;
            float out[4];
#ifdef BK_X86
            if (level == LEVEL_VNNI) q4_tile_vnni(w, sc, zr, K / 2, ng, R, K, G, qm, dm, dsm, out);
            else if (level == LEVEL_AVX2) q4_tile_avx2(w, sc, zr, K / 2, ng, R, K, G, qm, dm, dsm, out);
            else
#endif
                for (int r = 0; r < R; r++)
                    out[r] = q4_row_scalar(w + (size_t)r * (K / 2), sc + (size_t)r * ng, zr + (size_t)r * ng, K, G,
                                           qm, dm, s + (size_t)m * nb);
            for (int r = 0; r < R; r++) y[(size_t)m * N + n + r] = out[r];
        }
    }
    free(ds);
}

void bk_q8_quantize_x(const float *x, int M, int K, void *scratch) {
    int8_t *q = (int8_t *)scratch;
    float *d = (float *)(q + (size_t)M * K);
    int32_t *s = (int32_t *)(d + (size_t)M * (K / QB));
    for (int m = 0; m < M; m++)
        quantize_row(x + (size_t)m * K, K, 0, q + (size_t)m * K, d + (size_t)m * (K / QB), s + (size_t)m * (K / QB));
}

void bk_q8_rows(const int8_t *codes, const float *row_scales, int N, int K, int M, const void *scratch,
                float *y, int n0, int n1, int level) {
    const int8_t *q = (const int8_t *)scratch;
    const float *d = (const float *)(q + (size_t)M * K);
    int nb = K / QB;
    level = clamp_level(level);
    for (int n = n0; n < n1; n++) {
        const int8_t *w = codes + (size_t)n * K;
        for (int m = 0; m < M; m++) {
            float v;
#ifdef BK_X86
            if (level >= LEVEL_AVX2) v = q8_row_avx2(w, K, q + (size_t)m * K, d + (size_t)m * nb);
            else
#endif
                v = q8_row_scalar(w, K, q + (size_t)m * K, d + (size_t)m * nb);
            y[(size_t)m * N + n] = v * row_scales[n];
        }
    }
}

/* ------------------------------------------------------------------ int4 weights, float32 activations
 * x is prepared once per call: each block of 32 with its even columns first (the codes' nibble
 * order) and its sum; then y = sum_b s_g * (q . x)_b + (z_g - 8 s_g) * sum_b. */
static void q4f_prepare_x(const float *x, int M, int K, float *xp, float *xsum) {
    for (int m = 0; m < M; m++)
        for (int b = 0; b < K / QB; b++) {
            const float *xb = x + (size_t)m * K + b * QB;
            float *ob = xp + (size_t)m * K + b * QB, t = 0.f;
            for (int i = 0; i < QB; i++) {
                ob[(i & 1) * (QB / 2) + (i >> 1)] = xb[i];
                t += xb[i];
            }
            xsum[(size_t)m * (K / QB) + b] = t;
        }
}

static void q4f_tile_scalar(const uint8_t *w, const uint16_t *sc, const uint16_t *zr, size_t row_bytes, size_t ng,
                            int R, int K, int G, const float *x, const float *xsum, float *out) {
    for (int r = 0; r < R; r++) {
        float acc = 0.f, zacc = 0.f;
        for (int b = 0; b < K / QB; b++) {
            const uint8_t *wb = w + r * row_bytes + b * (QB / 2);
            const float *xb = x + b * QB;
            float t = 0.f;
            for (int i = 0; i < QB / 2; i++) t += (float)(wb[i] & 15) * xb[i] + (float)(wb[i] >> 4) * xb[QB / 2 + i];
            int g = b * QB / G;
            float sv = bf16_to_f32(sc[r * ng + g]), z = bf16_to_f32(zr[r * ng + g]);
            acc += sv * t;
            zacc += (z - 8.f * sv) * xsum[b];
        }
        out[r] = acc + zacc;
    }
}

#ifdef BK_X86
__attribute__((target("avx2,fma"))) static void q4f_tile_avx2(const uint8_t *w, const uint16_t *sc,
        const uint16_t *zr, size_t row_bytes, size_t ng, int R, int K, int G, const float *x,
        const float *xsum, float *out) {
    __m256 acc[4];
    float zacc[4];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); zacc[r] = 0.f; }
    const __m128i low = _mm_set1_epi8(15);
    for (int b = 0; b < K / QB; b++) {
        const float *xb = x + b * QB;
        __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16),
               x3 = _mm256_loadu_ps(xb + 24);
        int g = b * QB / G;
        for (int r = 0; r < R; r++) {
            __m128i c = _mm_loadu_si128((const __m128i *)(w + r * row_bytes + b * (QB / 2)));
            __m128i lo = _mm_and_si128(c, low), hi = _mm_and_si128(_mm_srli_epi16(c, 4), low);
            __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), x0);
            t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), x1, t);
            t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), x2, t);
            t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), x3, t);
            float sv = bf16_to_f32(sc[r * ng + g]), z = bf16_to_f32(zr[r * ng + g]);
            acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(sv), acc[r]);
            zacc[r] += (z - 8.f * sv) * xsum[b];
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum_f32_avx2(acc[r]) + zacc[r];
}

__attribute__((target("avx2,fma,avx512f"))) static void q4f_tile_avx512(const uint8_t *w, const uint16_t *sc,
        const uint16_t *zr, size_t row_bytes, size_t ng, int R, int K, int G, const float *x,
        const float *xsum, float *out) {
    __m512 acc[4];
    float zacc[4];
    for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); zacc[r] = 0.f; }
    const __m128i low = _mm_set1_epi8(15);
    for (int b = 0; b < K / QB; b++) {
        __m512 xe = _mm512_loadu_ps(x + b * QB), xo = _mm512_loadu_ps(x + b * QB + 16);
        int g = b * QB / G;
        for (int r = 0; r < R; r++) {
            __m128i c = _mm_loadu_si128((const __m128i *)(w + r * row_bytes + b * (QB / 2)));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(c, low)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(c, 4), low)));
            __m512 t = _mm512_fmadd_ps(hi, xo, _mm512_mul_ps(lo, xe));
            float sv = bf16_to_f32(sc[r * ng + g]), z = bf16_to_f32(zr[r * ng + g]);
            acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(sv), acc[r]);
            zacc[r] += (z - 8.f * sv) * xsum[b];
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]) + zacc[r];
}
#endif

static void q4f_rows(const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, int N, int K, int G,
                 int M, const float *xp, const float *xsum, float *y, int n0, int n1, int level) {
    int nb = K / QB, ng = K / G;
    level = clamp_level(level);
    for (int n = n0; n < n1; n += 4) {
        int R = n1 - n < 4 ? n1 - n : 4;
        const uint8_t *w = codes + (size_t)n * (K / 2);
        const uint16_t *sc = scales + (size_t)n * ng, *zr = zeros + (size_t)n * ng;
        for (int m = 0; m < M; m++) {
            const float *xm = xp + (size_t)m * K, *sm = xsum + (size_t)m * nb;
            float out[4];
#ifdef BK_X86
            if (level == LEVEL_VNNI) q4f_tile_avx512(w, sc, zr, K / 2, ng, R, K, G, xm, sm, out);
            else if (level == LEVEL_AVX2) q4f_tile_avx2(w, sc, zr, K / 2, ng, R, K, G, xm, sm, out);
            else
#endif
                q4f_tile_scalar(w, sc, zr, K / 2, ng, R, K, G, xm, sm, out);
            for (int r = 0; r < R; r++) y[(size_t)m * N + n + r] = out[r];
        }
    }
}

/* ------------------------------------------------------------------ threads
 * A persistent pool: a job's rows are cut into chunks that the caller and the workers claim from
 * one counter. The caller never waits for a chunk nobody has started: on a busy machine, where a
 * worker does not get a core, the caller simply does every chunk itself (an earlier design that
 * waited for its workers fell to ~1 tok/s under load). Workers spin briefly between jobs (decode
 * steps come every few tens of microseconds), then sleep. */
#define MAX_THREADS 64
#define EXHAUSTED (1 << 30)

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
            if (++spins < 4000) {
#ifdef BK_X86
                _mm_pause();
#endif
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

int bk_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (P.n_workers < n - 1) {  /* workers are only ever added: a smaller n uses fewer chunks */
        if (pthread_create(&P.th[P.n_workers], NULL, worker, NULL) != 0) break;
        pthread_detach(P.th[P.n_workers]);
        P.n_workers++;
    }
    return P.n_workers + 1;
}

static int want_threads = 1;

static void parallel_rows(chunk_fn run, const void *args, int n, int min_chunk) {
    int threads = want_threads < P.n_workers + 1 ? want_threads : P.n_workers + 1;
    if (threads <= 1 || n < 2 * min_chunk) {
        run(args, 0, n);
        return;
    }
    int chunk = (n + 4 * threads - 1) / (4 * threads); /* a few chunks each: uneven cores even out */
    chunk = (chunk + 3) & ~3;                          /* whole 4-row tiles */
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
    while (atomic_load_explicit(&P.active, memory_order_acquire) > 0) {
#ifdef BK_X86
        _mm_pause();
#endif
    }
}

void bk_threads(int n) {
    int have = bk_set_threads(n);
    want_threads = have < n ? have : n;
}

typedef struct {
    const uint8_t *codes;
    const uint16_t *scales, *zeros;
    int N, K, G, M;
    const float *xp, *xsum;
    float *y;
    int level;
} q4f_job;

static void q4f_chunk(const void *a, int n0, int n1) {
    const q4f_job *j = a;
    q4f_rows(j->codes, j->scales, j->zeros, j->N, j->K, j->G, j->M, j->xp, j->xsum, j->y, n0, n1, j->level);
}

/* q4f_rows over all N rows, split across the pool's threads (bk_threads). */
static void q4f_matmul(const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, int N, int K, int G,
                   int M, const float *xp, const float *xsum, float *y, int level) {
    q4f_job j = {codes, scales, zeros, N, K, G, M, xp, xsum, y, level};
    parallel_rows(q4f_chunk, &j, N, 64);
}

/* ------------------------------------------------------------------ int8 weights, float32 activations
 * y = s_n * sum_k q_nk x_k, float32 sums in a fixed order per row (batch-invariant), threaded. */
static void q8f_tile_scalar(const int8_t *w, size_t K, int R, const float *x, float *out) {
    for (int r = 0; r < R; r++) {
        float acc = 0.f;
        for (size_t k = 0; k < K; k++) acc += (float)w[r * K + k] * x[k];
        out[r] = acc;
    }
}

#ifdef BK_X86
/* R rows of int8 weights against float activations, W lanes at a time (AVX2: 8, AVX-512: 16). */
#define Q8F_TILE(NAME, TARGET, VEC, W, ZERO, LOADX, LOADW, WIDEN, FMA, HSUM)                            \
    __attribute__((target(TARGET))) static void NAME(const int8_t *w, size_t K, int R, const float *x,   \
                                                      float *out) {                                      \
        VEC acc[4];                                                                                      \
        for (int r = 0; r < R; r++) acc[r] = ZERO();                                                     \
        for (size_t k = 0; k < K; k += W) {                                                              \
            VEC xv = LOADX(x + k);                                                                       \
            for (int r = 0; r < R; r++) acc[r] = FMA(WIDEN(LOADW((const __m128i *)(w + r * K + k))), xv, acc[r]); \
        }                                                                                                \
        for (int r = 0; r < R; r++) out[r] = HSUM(acc[r]);                                               \
    }

#define WIDEN8(c) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c))
#define WIDEN16(c) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c))
Q8F_TILE(q8f_tile_avx2, "avx2,fma", __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm_loadl_epi64, WIDEN8,
         _mm256_fmadd_ps, hsum_f32_avx2)
Q8F_TILE(q8f_tile_avx512, "avx2,fma,avx512f", __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm_loadu_si128,
         WIDEN16, _mm512_fmadd_ps, _mm512_reduce_add_ps)
#endif

typedef struct {
    const int8_t *codes;
    const float *scales, *x;
    int N, K, M, level;
    float *y;
} q8f_job;

static void q8f_chunk(const void *a, int n0, int n1) {
    const q8f_job *j = a;
    int level = clamp_level(j->level);
    for (int n = n0; n < n1; n += 4) {
        int R = n1 - n < 4 ? n1 - n : 4;
        const int8_t *w = j->codes + (size_t)n * j->K;
        for (int m = 0; m < j->M; m++) {
            const float *xm = j->x + (size_t)m * j->K;
            float out[4];
#ifdef BK_X86
            if (level == LEVEL_VNNI) q8f_tile_avx512(w, j->K, R, xm, out);
            else if (level == LEVEL_AVX2) q8f_tile_avx2(w, j->K, R, xm, out);
            else
#endif
                q8f_tile_scalar(w, j->K, R, xm, out);
            for (int r = 0; r < R; r++) j->y[(size_t)m * j->N + n + r] = out[r] * j->scales[n + r];
        }
    }
}

/* y [M, N] = x [M, K] times an int8 weight with one float scale per row; K a multiple of 16. */
void bk_q8f_matmul(const int8_t *codes, const float *scales, int N, int K, int M, const float *x, float *y,
                   int level) {
    q8f_job j = {codes, scales, x, N, K, M, level, y};
    parallel_rows(q8f_chunk, &j, N, 64);
}

/* The whole int4 product in one call (what a layer's forward makes): x prepared, rows threaded. */
void bk_q4f_linear(const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, int N, int K, int G,
                   int M, const float *x, float *y, int level) {
    float *xp = malloc(sizeof(float) * ((size_t)M * K + (size_t)M * (K / QB)));
    float *xsum = xp + (size_t)M * K;
    q4f_prepare_x(x, M, K, xp, xsum);
    q4f_matmul(codes, scales, zeros, N, K, G, M, xp, xsum, y, level);
    free(xp);
}
