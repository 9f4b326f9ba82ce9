/* The transformer blocks of a forward pass in one call: for rows of float32 activations, each
 * block's norms, q/k/v products, rope, K/V writes, attention, output product, residuals and gated
 * MLP, the products through brisk_kernels.c's bk_matmul_many. The cache may store its values
 * narrower (bk_cache.type): written converted, read back into float32 before the attention's sums. In torch the same step is ~20 small
 * ops per block, each costing microseconds of dispatch: on a 135M model that overhead was as large
 * as the products themselves.
 *
 * Every row is computed by the same operations in the same order whatever the other rows are: the
 * products are batch-invariant, and norms, rope and attention work row by row (attention over the
 * row's own positions in a fixed order). So a token gets the same bits in a 1-token decode step, in
 * a speculative verification pass, in a prefill chunk and beside other sequences in a batch.
 *
 * Compiled once per instruction set like tiles.c (functions named with BK_SUFFIX).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bk_decoder.h"
#include "bk_vec.h"
#if defined(__SSE2__)
#include <xmmintrin.h> /* _mm_getcsr: attend's flush of subnormals */
#endif

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

/* Attention over fewer keys (summed over rows and heads) runs on the calling thread: one decode
 * step's few thousand dot products take microseconds, and on a busy machine each split across
 * threads risks waiting for a worker the OS has descheduled. */
#define ATTENTION_SPLIT 8192

int bk_matmul_many(const bk_weight *ws, int nw, int M, const float *x, float *y, int level);
void bk_parallel(void (*run)(const void *, int, int), const void *args, int n, int min_chunk);

/* y = x / rms(x) * w over n floats (n a multiple of LANES); y may be x */
BK_INLINE void rms_norm(const float *x, const float *w, float *y, int n, float eps) {
    v16 acc = {0};
    for (int k = 0; k < n; k += LANES) {
        v16 v = load16(x + k);
        acc += v * v;
    }
    float r = 1.0f / sqrtf(reduce16(acc) / (float)n + eps);
    for (int k = 0; k < n; k += LANES) store16(y + k, load16(x + k) * r * load16(w + k));
}

/* rotate-half rope of a head's first D dimensions in place: x[i] cos[i] + x[(i + D/2) mod D] sin[i] */
BK_INLINE void rope(float *x, const float *cos, const float *sin, int D) {
    float t[512];
    int h = D / 2;
    for (int i = 0; i < D; i++) t[i] = x[i] * cos[i] + x[i < h ? i + h : i - h] * sin[i];
    memcpy(x, t, sizeof(float) * D);
}

/* ---- the cache's stored types (bk_cache.type): written converted, read back as float32 ---- */

/* float -> IEEE half, rounded to nearest even (as numpy and torch convert): infinities and NaN kept,
 * overflow to infinity, halves below 2^-14 as subnormals */
BK_INLINE uint16_t to_f16(float f) {
    uint32_t x, sign, ax;
    memcpy(&x, &f, 4);
    sign = x >> 16 & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to 65520 or more */
    if (ax < 0x38800000u) { /* |f| < 2^-14: adding 0.5 rounds it to a multiple of 2^-24, the subnormal's unit */
        float t = bk_f32_bits(ax) + 0.5f;
        uint32_t b;
        memcpy(&b, &t, 4);
        return (uint16_t)(sign | (b - 0x3F000000u));
    }
    ax += 0xFFFu + (ax >> 13 & 1); /* round the 13 dropped bits to nearest even */
    return (uint16_t)(sign | (ax - (112u << 23)) >> 13);
}

/* float -> bfloat16, rounded to nearest even; NaN stays a (quiet) NaN */
BK_INLINE uint16_t to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)(x >> 16 | 0x40u);
    return (uint16_t)((x + 0x7FFFu + (x >> 16 & 1)) >> 16);
}

/* D values (a multiple of 32 for Q8_0) stored as `type` at dst */
static void kv_store(int type, uint8_t *dst, const float *x, int D) {
    if (type == BK_KV_F32) {
        memcpy(dst, x, sizeof(float) * D);
    } else if (type == BK_KV_F16 || type == BK_KV_BF16) {
        for (int i = 0; i < D; i++) {
            uint16_t h = type == BK_KV_F16 ? to_f16(x[i]) : to_bf16(x[i]);
            memcpy(dst + 2 * i, &h, 2);
        }
    } else { /* Q8_0 as gguf-py quantizes it: d = max |x| / 127 in float32, q = round(x / d) half away from 0 */
        for (int b = 0; b < D; b += 32, dst += 34) {
            float amax = 0;
            for (int i = 0; i < 32; i++) amax = fabsf(x[b + i]) > amax ? fabsf(x[b + i]) : amax;
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            uint16_t h = to_f16(d);
            memcpy(dst, &h, 2);
            for (int i = 0; i < 32; i++) dst[2 + i] = (uint8_t)(int8_t)roundf(x[b + i] * id);
        }
    }
}

/* 16 bfloat16 at p -> floats (a bfloat16 is a float's high half) */
BK_INLINE v16 load16_bf16(const uint8_t *p) {
    v16 y;
#if defined(__AVX512F__)
    __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    memcpy(&y, &w, sizeof y);
#elif defined(__AVX2__)
    __m256 w[2];
    for (int h = 0; h < 2; h++)
        w[h] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * h))), 16));
    memcpy(&y, w, sizeof y);
#else
    for (int l = 0; l < LANES; l++) y[l] = bk_f32_bits((uint32_t)(p[2 * l] | p[2 * l + 1] << 8) << 16);
#endif
    return y;
}

/* the fp16 at p in every lane, converted there (a scalar conversion and a broadcast cost
 * attention over a q8_0 cache two more operations per 16 values) */
BK_INLINE v16 splat16_fp16(const uint8_t *p) {
#if defined(__AVX512F__)
    __m512 w = _mm512_cvtph_ps(_mm256_set1_epi16((short)(p[0] | p[1] << 8)));
    v16 y;
    memcpy(&y, &w, sizeof y);
    return y;
#else
    return splat16(bk_fp16(p));
#endif
}

/* 16 int8 at p -> floats */
BK_INLINE v16 load16_i8(const uint8_t *p) {
    v16 y;
#if defined(__AVX512F__)
    __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&y, &w, sizeof y);
#elif defined(__AVX2__)
    __m256 w[2];
    for (int h = 0; h < 2; h++) w[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h))));
    memcpy(&y, w, sizeof y);
#else
    for (int l = 0; l < LANES; l++) y[l] = (float)(int8_t)p[l];
#endif
    return y;
}

/* Values k..k+15 of a cache row stored as `type` at row, as floats (type a constant where it is
 * inlined: attention reads every stored type in place, converting in registers). Q8_0: 16 values
 * lie in one block of 32 (k a multiple of 16), its fp16 scale first. */
BK_INLINE v16 kv16(const uint8_t *row, int k, int type) {
    if (type == BK_KV_F32) return load16((const float *)row + k);
    if (type == BK_KV_BF16) return load16_bf16(row + 2 * k);
    if (type == BK_KV_Q8_0) {
        const uint8_t *b = row + 34 * (k / 32);
        return load16_i8(b + 2 + k % 32) * splat16_fp16(b);
    }
    v16 y;
#if defined(__AVX512F__)
    __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * k)));
    memcpy(&y, &w, sizeof y);
#elif defined(__F16C__)
    __m256 w[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k))),
                   _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k + 16)))};
    memcpy(&y, w, sizeof y);
#else
    for (int l = 0; l < LANES; l++) y[l] = bk_fp16(row + 2 * (k + l));
#endif
    return y;
}

/* A row's keys are attended in spans of ATT_SPAN positions, aligned to absolute positions (span s
 * holds positions s ATT_SPAN ..): each span a task, so one long row's attention spreads over the
 * threads; a row whose keys span several combines their partial results (each span's max score, its
 * sum of exponentials and its unnormalised output) in span order. The spans depend on the position
 * alone, never on the other rows or the threads: a token's bits stay those of any other call. */
#define ATT_SPAN 512

typedef struct {
    int32_t row, h0;   /* the row, its first query head (the task's g heads share one K/V head) */
    int32_t lo, hi;    /* positions [lo, hi) */
    int32_t whole;     /* the row's keys in this one span: normalise and write the output */
} att_task;

typedef struct {
    const bk_arch *a;
    const bk_layer *L;
    const bk_cache *c;
    int layer;
    const int32_t *pos, *table;
    const float *qkv;     /* [N, (H + 2 KV) D] */
    float *out;           /* [N, H D] */
    int group;            /* query heads a task attends together */
    const att_task *tasks;
    int n_tasks;
    float *partial;       /* per task: g heads x (D outputs, max, sum of exponentials), for split rows */
} attention_job;

static _Thread_local float *score_buf;
static _Thread_local size_t score_cap;

/* Chains of multiply-adds side by side (keys x heads in the scores, output vectors x heads in the
 * weighted sum), as many as the registers hold beside the operands: AVX-512 has 32 of 16 floats,
 * else 16 of 8 (2 a v16). Query heads on one K/V head are attended together, up to ATT_CHAINS. */
#if defined(__AVX512F__)
#define ATT_CHAINS 8
#define ATT_ACC 16
#else
#define ATT_CHAINS 4
#define ATT_ACC 4
#endif
/* output vectors a value tile takes at once for g heads: a head of 64 floats in one pass where it fits */
#define ATT_VECS(g) (ATT_ACC / (g) < 4 ? ATT_ACC / (g) : 4)

/* s[e][i + u] = q[e] . key i + u, u < KEYS, e < G (constants where it is inlined: the sums stay in
 * registers), each summed over the head's vectors in order, then its lanes (reduce16); the keys at
 * kb + at[i] (bytes), stored as TYPE */
BK_INLINE void score_tile(const float *const *q, const uint8_t *kb, const int64_t *at, int i, int D, int G, int KEYS,
                          float *const *s, float scale, int TYPE) {
    v16 acc[ATT_ACC] = {{0}};
    for (int k = 0; k < D; k += LANES)
        for (int u = 0; u < KEYS; u++) {
            v16 kv = kv16(kb + at[i + u], k, TYPE);
            for (int e = 0; e < G; e++) acc[u * G + e] += load16(q[e] + k) * kv;
        }
#if ATT_ACC == 16
    if (KEYS * G > 2) { /* the sums side by side (reduce16x16): the horizontal sums were most of a key's work */
        float t[LANES];
        store16(t, reduce16x16(acc) * splat16(scale));
        for (int u = 0; u < KEYS; u++)
            for (int e = 0; e < G; e++) s[e][i + u] = t[u * G + e];
        return;
    }
#endif
    for (int u = 0; u < KEYS; u++)
        for (int e = 0; e < G; e++) s[e][i + u] = reduce16(acc[u * G + e]) * scale;
}

/* y[e][k0 .. k0 + VECS LANES] = sum over the n keys, in order, of s[e][i] value i, times inv[e] */
BK_INLINE void value_tile(const uint8_t *vb, const int64_t *at, int n, int k0, int G, int VECS, float *const *s,
                          const float *inv, float *const *y, int TYPE) {
    v16 acc[ATT_ACC] = {{0}};
    for (int i = 0; i < n; i++)
        for (int u = 0; u < VECS; u++) {
            v16 v = kv16(vb + at[i], k0 + u * LANES, TYPE);
            for (int e = 0; e < G; e++) acc[u * G + e] += splat16(s[e][i]) * v;
        }
    for (int u = 0; u < VECS; u++)
        for (int e = 0; e < G; e++) store16(y[e] + k0 + u * LANES, acc[u * G + e] * inv[e]);
}

/* the tiles for g heads (1 <= g <= ATT_CHAINS) and the four stored types: constants for the compiler,
 * case by case */
#define BY_TYPE(call, ...)                                                                                  \
    (ty == BK_KV_F16 ? call(__VA_ARGS__, BK_KV_F16) : ty == BK_KV_BF16 ? call(__VA_ARGS__, BK_KV_BF16) :        \
     ty == BK_KV_Q8_0 ? call(__VA_ARGS__, BK_KV_Q8_0) : call(__VA_ARGS__, BK_KV_F32))
#define SCORE_CASE(G) case G: BY_TYPE(score_tile, q, kb, at, i, D, G, ATT_ACC / G, s, a->attn_scale); break;
#define VALUE_CASE(G) case G: BY_TYPE(value_tile, vb, at, n, k0, G, ATT_VECS(G), s, inv, y); break;
/* the ends: a key, an output vector at a time */
#define SCORE_ONE(G) case G: BY_TYPE(score_tile, q, kb, at, i, D, G, 1, s, a->attn_scale); break;
#define VALUE_ONE(G) case G: BY_TYPE(value_tile, vb, at, n, k0, G, 1, s, inv, y); break;

/* One task: query heads h0..h0+g-1 of one row (sharing one K/V head) against the row's keys at
 * positions [lo, hi): softmax(q k / sqrt) v. A whole row's task writes the output; with sinks
 * (gpt-oss) the softmax's denominator also holds e^sink, a key whose value is zero, so the real
 * keys' weights sum below 1. A span of a split row writes its partial result instead (see
 * combine_spans). The heads of a group read each key and value once. Each score is summed as
 * score_tile sums it and each output over the keys in order, however many run side by side: a head's bits do
 * not depend on its group. */
static void attend_task(const attention_job *j, int t) {
    const bk_arch *a = j->a;
    const bk_cache *c = j->c;
    const att_task *task = j->tasks + t;
    int D = a->head_dim, r = task->row, h0 = task->h0, g = j->group, lo = task->lo, n = task->hi - task->lo;
    /* a head's scores and its last vector's spare lanes, an even count: the offsets after them 8-byte aligned */
    int stride = (n + 2 * LANES + 1) / 2 * 2;
    size_t need = (size_t)stride * (g + 2); /* then each key's offset in the cache (int64) */
    if (score_cap < need) {
        free(score_buf);
        score_buf = malloc(need * 2 * sizeof(float));
        score_cap = score_buf ? need * 2 : 0;
        if (!score_buf) return;
    }
    int64_t *at = (int64_t *)(score_buf + (size_t)stride * g);
    const float *q[ATT_CHAINS];
    float *s[ATT_CHAINS], *y[ATT_CHAINS], inv[ATT_CHAINS];
    for (int e = 0; e < g; e++) {
        q[e] = j->qkv + (int64_t)r * (a->n_heads + 2 * a->n_kv) * D + (int64_t)(h0 + e) * D;
        s[e] = score_buf + (size_t)e * stride;
        y[e] = task->whole ? j->out + (int64_t)r * a->n_heads * D + (int64_t)(h0 + e) * D
                           : j->partial + ((size_t)t * g + e) * (D + 2);
    }
    const int32_t *tab = c->tables + j->table[r];
    int kv_head = h0 / (a->n_heads / a->n_kv);
    const uint8_t *kb = (const uint8_t *)c->k[j->layer] + kv_head * c->head_stride,
                  *vb = (const uint8_t *)c->v[j->layer] + kv_head * c->head_stride;
    for (int i = 0, blk = lo / c->block_size, in = lo % c->block_size; i < n; i++) { /* no division per key */
        at[i] = (int64_t)tab[blk] * c->block_stride + (int64_t)in * c->pos_stride; /* bytes */
        if (++in == c->block_size) in = 0, blk++;
    }
    int ty = c->type; /* read in place, whatever the stored type (kv16) */
    int keys = ATT_ACC / g, i = 0;
    for (; i + keys <= n; i += keys)
        switch (g) {
            SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4)
#if ATT_CHAINS == 8
            SCORE_CASE(5) SCORE_CASE(6) SCORE_CASE(7) SCORE_CASE(8)
#endif
        }
    for (; i < n; i++) /* one key at a time: the tile of one, summed alike */
        switch (g) {
            SCORE_ONE(1) SCORE_ONE(2) SCORE_ONE(3) SCORE_ONE(4)
#if ATT_CHAINS == 8
            SCORE_ONE(5) SCORE_ONE(6) SCORE_ONE(7) SCORE_ONE(8)
#endif
        }
    const float *sinks = task->whole ? j->L->sinks : NULL; /* a split row's sink joins in combine_spans */
    float m[ATT_CHAINS], total[ATT_CHAINS];
    for (int e = 0; e < g; e++) {
        float *se = s[e], sink = sinks ? sinks[h0 + e] : 0;
        for (i = n; i < n + LANES; i++) se[i] = -INFINITY; /* the last vector's spare lanes: e^-inf = 0 */
        v16 mv = splat16(-INFINITY); /* lanes side by side: a scalar chain waited on each compare */
        for (i = 0; i < n; i += LANES) {
            v16 x = load16(se + i);
            mv = select16(x > mv, x, mv);
        }
        m[e] = -INFINITY;
        for (i = 0; i < LANES; i++) m[e] = mv[i] > m[e] ? mv[i] : m[e];
        if (sinks) m[e] = sink > m[e] ? sink : m[e];
        v16 sum = {0};
        for (i = 0; i < n; i += LANES) {
            v16 x = exp16(load16(se + i) - m[e]);
            store16(se + i, x);
            sum += x;
        }
        total[e] = reduce16(sum);
        if (sinks) total[e] += expf(sink - m[e]);
        inv[e] = task->whole ? 1.0f / total[e] : 1.0f;
    }
    int vecs = ATT_VECS(g), k0 = 0;
    for (; k0 + vecs * LANES <= D; k0 += vecs * LANES)
        switch (g) {
            VALUE_CASE(1) VALUE_CASE(2) VALUE_CASE(3) VALUE_CASE(4)
#if ATT_CHAINS == 8
            VALUE_CASE(5) VALUE_CASE(6) VALUE_CASE(7) VALUE_CASE(8)
#endif
        }
    for (; k0 < D; k0 += LANES)
        switch (g) {
            VALUE_ONE(1) VALUE_ONE(2) VALUE_ONE(3) VALUE_ONE(4)
#if ATT_CHAINS == 8
            VALUE_ONE(5) VALUE_ONE(6) VALUE_ONE(7) VALUE_ONE(8)
#endif
        }
    if (!task->whole)
        for (int e = 0; e < g; e++) y[e][D] = m[e], y[e][D + 1] = total[e];
}

/* The weights of keys far below a row's best score, and their products with the values, are
 * subnormal floats, and x86 takes a microcode assist (~100 cycles) for each subnormal operand or
 * result: decode at depth went data-dependent, up to 2.5x slower. A task flushes them to zero
 * (FTZ/DAZ, restored after): a term below 1e-38 is under the rounding of any sum holding the best
 * key's weight of 1. */
static void attend(const attention_job *j, int t) {
#if defined(__SSE2__)
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    attend_task(j, t);
    _mm_setcsr(csr);
#else
    attend_task(j, t);
#endif
}

/* the tasks last to first: a prefill's later rows read more keys, and taken first they leave the
 * short ones to even out the threads' ends */
static void attention_chunk(const void *p, int i0, int i1) {
    const attention_job *j = p;
    for (int i = i0; i < i1; i++) attend(j, j->n_tasks - 1 - i);
}

/* A split row's output, head by head: its spans' partial outputs rescaled to the largest max and
 * added in span order, over the spans' sums (and the sink's e^sink, gpt-oss). Tasks t0.. are the
 * row's, grouped as built: for each group of g heads, its spans in order. */
static void combine_spans(const attention_job *j, int t0, int spans) {
    const bk_arch *a = j->a;
    int D = a->head_dim, g = j->group, r = j->tasks[t0].row;
    const float *sinks = j->L->sinks;
    for (int h = 0; h < a->n_heads; h++) {
        int first = t0 + h / g * spans, e = h % g;
        float M = sinks ? sinks[h] : -INFINITY, total = 0;
        for (int sp = 0; sp < spans; sp++) {
            float m = j->partial[((size_t)(first + sp) * g + e) * (D + 2) + D];
            M = m > M ? m : M;
        }
        float *y = j->out + (int64_t)r * a->n_heads * D + (int64_t)h * D;
        memset(y, 0, sizeof(float) * D);
        for (int sp = 0; sp < spans; sp++) {
            const float *p = j->partial + ((size_t)(first + sp) * g + e) * (D + 2);
            float w = expf(p[D] - M);
            total += p[D + 1] * w;
            for (int k = 0; k < D; k += LANES) store16(y + k, load16(y + k) + load16(p + k) * splat16(w));
        }
        if (sinks) total += expf(sinks[h] - M);
        for (int k = 0; k < D; k += LANES) store16(y + k, load16(y + k) * (1.0f / total));
    }
}

/* a row's gate/up [2 F] -> act(gate) * up [F] */
BK_INLINE void gated(const bk_arch *a, const float *gu, float *out, int F) {
    if (a->act == BK_SWIGLU_CLAMP) { /* gpt-oss: min(g, l) sigmoid(alpha min(g, l)) (clamp(u, -l, l) + 1) */
        v16 lim = splat16(a->swiglu_limit), alpha = splat16(a->swiglu_alpha);
        for (int k = 0; k < F; k += LANES) {
            v16 g = load16(gu + k), u = load16(gu + F + k);
            g = select16(g > lim, lim, g);
            u = select16(u > lim, lim, select16(u < -lim, -lim, u));
            store16(out + k, g / (1.0f + exp16(-(g * alpha))) * (u + 1.0f));
        }
        return;
    }
    int gelu = a->act == BK_GELU;
    for (int k = 0; k < F; k += LANES) {
        v16 g = load16(gu + k), u = load16(gu + F + k);
        if (gelu) { /* 0.5 g (1 + tanh(z)), tanh(z) = 1 - 2 / (e^2z + 1) */
            v16 z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
            g = 0.5f * g * (2.0f - 2.0f / (exp16(2.0f * z) + 1.0f));
        } else {
            g = g / (1.0f + exp16(-g));
        }
        store16(out + k, g * u);
    }
}

static void add_rows(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += LANES) store16(x + i, load16(x + i) + load16(y + i));
}

/* A row's experts: the n_used largest logits (ties: the lower expert), in ascending expert order,
 * the order their outputs are added in; weighted by the softmax over all logits, renormalized if
 * asked, or (of_top, gpt-oss) by the softmax over the chosen ones alone. */
static void route(const float *logits, int E, int k, int renorm, int of_top, int *chosen, float *w) {
    float m = -INFINITY, sum = 0, picked = 0;
    for (int i = 0; i < k; i++) { /* k passes: k is small (2-8), E up to a few hundred */
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < i; j++) taken |= chosen[j] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        chosen[i] = best;
    }
    for (int i = 1; i < k; i++) /* ascending expert order */
        for (int j = i; j > 0 && chosen[j - 1] > chosen[j]; j--) {
            int t = chosen[j];
            chosen[j] = chosen[j - 1], chosen[j - 1] = t;
        }
    if (of_top) {
        for (int i = 0; i < k; i++) m = logits[chosen[i]] > m ? logits[chosen[i]] : m;
        for (int i = 0; i < k; i++) sum += w[i] = expf(logits[chosen[i]] - m);
        for (int i = 0; i < k; i++) w[i] /= sum;
        return;
    }
    for (int e = 0; e < E; e++) m = logits[e] > m ? logits[e] : m;
    for (int e = 0; e < E; e++) sum += expf(logits[e] - m);
    for (int i = 0; i < k; i++) picked += w[i] = expf(logits[chosen[i]] - m) / sum;
    if (renorm)
        for (int i = 0; i < k; i++) w[i] /= picked;
}

/* out [N, dim] = each row's routed experts' MLPs on xn (with their biases, if any), weighted and
 * added in ascending expert order. Each expert runs once on the rows routed to it (gathered): its
 * weights are read once a pass, and since a product's row does not depend on the others, nor does
 * a row's result. */
static int moe(const bk_arch *a, const bk_layer *L, int N, const float *xn, float *out, int level) {
    int dim = a->dim, E = L->n_experts, k = a->n_used, F = a->expert_ffn, rc = 0;
    size_t floats = (size_t)N * E + (size_t)N * k + (size_t)N * dim + (size_t)N * 2 * F + (size_t)N * F + (size_t)N * dim;
    float *buf = malloc(floats * sizeof(float) + (size_t)N * k * sizeof(int) + (size_t)(E + 1) * sizeof(int) +
                        (size_t)N * k * 2 * sizeof(int));
    if (!buf) return -2;
    float *logits = buf, *w = logits + (size_t)N * E, *g = w + (size_t)N * k, *gu = g + (size_t)N * dim,
          *act = gu + (size_t)N * 2 * F, *y = act + (size_t)N * F;
    int *chosen = (int *)(y + (size_t)N * dim), *start = chosen + (size_t)N * k, *rows = start + E + 1,
        *slot = rows + (size_t)N * k;
    if ((rc = bk_matmul_many(L->router, 1, N, xn, logits, level))) goto done;
    for (int r = 0; r < N; r++) {
        float *lr = logits + (size_t)r * E;
        if (L->router_bias)
            for (int e = 0; e < E; e++) lr[e] += L->router_bias[e];
        route(lr, E, k, a->norm_topk, a->topk_softmax, chosen + (size_t)r * k, w + (size_t)r * k);
    }
    int B = 2 * F + dim; /* an expert's biases */
    /* the (row, slot) pairs by expert, rows ascending within each */
    memset(start, 0, sizeof(int) * (E + 1));
    for (int i = 0; i < N * k; i++) start[chosen[i] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    int *fill = (int *)logits; /* the logits are read: their room holds the fill counters */
    memcpy(fill, start, sizeof(int) * E);
    for (int i = 0; i < N * k; i++) {
        int at = fill[chosen[i]]++;
        rows[at] = i / k, slot[at] = i;
    }
    memset(out, 0, sizeof(float) * (size_t)N * dim);
    if (N == 1 && 2 * k <= 32) { /* a decode step: every routed expert's gate and up in one call (the
                                   same input; each weight's rows as alone), then each down */
        bk_weight ws[32];
        for (int i = 0; i < k; i++) ws[2 * i] = L->experts[3 * chosen[i]], ws[2 * i + 1] = L->experts[3 * chosen[i] + 1];
        float *gus = malloc(sizeof(float) * (size_t)k * 2 * F + sizeof(float) * (size_t)k * F);
        if (!gus) {
            rc = -2;
            goto done;
        }
        float *acts = gus + (size_t)k * 2 * F;
        rc = bk_matmul_many(ws, 2 * k, 1, xn, gus, level);
        for (int i = 0; i < k && rc == 0; i++) {
            const float *b = L->expert_bias ? L->expert_bias + (size_t)chosen[i] * B : NULL;
            if (b) add_rows(gus + (size_t)i * 2 * F, b, 2 * F);
            gated(a, gus + (size_t)i * 2 * F, acts + (size_t)i * F, F);
            if ((rc = bk_matmul_many(L->experts + 3 * chosen[i] + 2, 1, 1, acts + (size_t)i * F, y, level))) break;
            if (b) add_rows(y, b + 2 * F, dim);
            v16 s = splat16(w[i]);
            for (int d = 0; d < dim; d += LANES) store16(out + d, load16(out + d) + load16(y + d) * s);
        }
        free(gus);
        goto done;
    }
    for (int e = 0; e < E && rc == 0; e++) {
        int m = start[e + 1] - start[e];
        if (!m) continue;
        for (int i = 0; i < m; i++) memcpy(g + (size_t)i * dim, xn + (size_t)rows[start[e] + i] * dim, sizeof(float) * dim);
        const float *b = L->expert_bias ? L->expert_bias + (size_t)e * B : NULL;
        if ((rc = bk_matmul_many(L->experts + 3 * e, 2, m, g, gu, level))) break;
        for (int i = 0; i < m; i++) {
            if (b) add_rows(gu + (size_t)i * 2 * F, b, 2 * F);
            gated(a, gu + (size_t)i * 2 * F, act + (size_t)i * F, F);
        }
        if ((rc = bk_matmul_many(L->experts + 3 * e + 2, 1, m, act, y, level))) break;
        for (int i = 0; i < m; i++) {
            float *o = out + (size_t)rows[start[e] + i] * dim, *yi = y + (size_t)i * dim;
            if (b) add_rows(yi, b + 2 * F, dim);
            v16 s = splat16(w[slot[start[e] + i]]);
            for (int d = 0; d < dim; d += LANES) {
                store16(o + d, load16(o + d) + load16(yi + d) * s);
            }
        }
    }
done:
    free(buf);
    return rc;
}

/* A layer's work row by row between its products (norms, biases, rope, the K/V writes, the gated
 * activation, the residual adds), across the threads where there are rows enough: a prefill's 512
 * rows on the calling thread alone left the others waiting. Each row's operations are its own. */
enum { ROWS_ATTN_IN, ROWS_QKV, ROWS_ATTN_OUT, ROWS_GATED, ROWS_FFN_OUT };

typedef struct {
    const bk_arch *a;
    const bk_layer *L;
    const bk_cache *c;
    int layer, stage;
    const int32_t *pos, *table;
    float *x, *xn, *qkv, *o, *gu, *act;
} rows_job;

static void rows_stage(const void *p, int r0, int r1) {
    const rows_job *j = p;
    const bk_arch *a = j->a;
    const bk_layer *L = j->L;
    const bk_cache *c = j->c;
    int dim = a->dim, D = a->head_dim, H = a->n_heads, KV = a->n_kv, F = a->ffn, W = (H + 2 * KV) * D;
    int R = a->rope_dim ? a->rope_dim : D;
    for (int r = r0; r < r1; r++) {
        float *xr = j->x + (int64_t)r * dim, *xnr = j->xn + (int64_t)r * dim, *orow = j->o + (int64_t)r * dim;
        switch (j->stage) {
        case ROWS_ATTN_IN:
            rms_norm(xr, L->attn_in, xnr, dim, a->eps);
            break;
        case ROWS_QKV: {
            const int32_t *pos = j->pos;
            float *q = j->qkv + (int64_t)r * W, *k = q + H * D, *v = k + KV * D;
            const float *bias[3] = {L->q_bias, L->k_bias, L->v_bias};
            float *part[3] = {q, k, v};
            int width[3] = {H * D, KV * D, KV * D};
            for (int i = 0; i < 3; i++)
                if (bias[i])
                    for (int e = 0; e < width[i]; e++) part[i][e] += bias[i][e];
            const float *cs = L->cos + (int64_t)pos[r] * R, *sn = L->sin + (int64_t)pos[r] * R;
            for (int h = 0; h < H + KV; h++) { /* q heads, then k heads */
                float *head = q + (int64_t)h * D;
                if (a->qk_norm) rms_norm(head, h < H ? L->q_norm : L->k_norm, head, D, a->eps);
                rope(head, cs, sn, R);
            }
            const int32_t *tab = c->tables + j->table[r];
            int64_t at = (int64_t)tab[pos[r] / c->block_size] * c->block_stride +
                         (int64_t)(pos[r] % c->block_size) * c->pos_stride;
            for (int h = 0; h < KV; h++) {
                kv_store(c->type, (uint8_t *)c->k[j->layer] + at + h * c->head_stride, k + (int64_t)h * D, D);
                kv_store(c->type, (uint8_t *)c->v[j->layer] + at + h * c->head_stride, v + (int64_t)h * D, D);
            }
            break;
        }
        case ROWS_ATTN_OUT:
            if (L->o_bias) add_rows(orow, L->o_bias, dim);
            if (a->sandwich) {
                rms_norm(orow, L->post_attn, orow, dim, a->eps);
                add_rows(xr, orow, dim);
                rms_norm(xr, L->pre_ffn, xnr, dim, a->eps);
            } else {
                add_rows(xr, orow, dim);
                rms_norm(xr, L->post_attn, xnr, dim, a->eps);
            }
            break;
        case ROWS_GATED:
            gated(a, j->gu + (int64_t)r * 2 * F, j->act + (int64_t)r * F, F);
            break;
        case ROWS_FFN_OUT:
            if (a->sandwich) rms_norm(orow, L->post_ffn, orow, dim, a->eps);
            add_rows(xr, orow, dim);
            break;
        }
    }
}

static void rows_pass(rows_job *j, int stage, int N) {
    j->stage = stage;
    bk_parallel(rows_stage, j, N, 16);
}

/* Rows x [N, dim] (in place) through every layer: row r at position pos[r], its sequence's block
 * table at c->tables + table[r]. Every row's K/V are written before any row attends, so a row sees
 * the rows of this call that precede it in its sequence. With tp (a rank of a tensor-parallel
 * model: its heads and its part of the MLP's width in a and layers; no experts, no bias on o), the
 * outputs of o and down are summed over the ranks as they are made.
 * Returns 0, -1 on a product's shape error, -2 out of memory, BK_TP_* when a collective failed. */
int CAT(bk_decoder, BK_SUFFIX)(const bk_arch *a, const bk_layer *layers, int n_layers, const bk_cache *c, int N,
                               const int32_t *pos, const int32_t *table, float *x, const bk_tp *tp, int level) {
    int dim = a->dim, D = a->head_dim, H = a->n_heads, KV = a->n_kv, F = a->ffn, W = (H + 2 * KV) * D;
    size_t floats = (size_t)N * (dim + W + H * D + dim + 2 * F + F);
    float *buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (!buf) return -2;
    float *xn = buf, *qkv = xn + (size_t)N * dim, *att = qkv + (size_t)N * W, *o = att + (size_t)N * H * D,
          *gu = o + (size_t)N * dim, *act = gu + (size_t)N * 2 * F;
    int64_t keys_read = 0, spans = 0; /* per layer at most: the positions all rows attend over, times the
                                         heads; the rows' spans of keys */
    for (int r = 0; r < N; r++) keys_read += (int64_t)(pos[r] + 1) * H, spans += pos[r] / ATT_SPAN + 1;
    /* a task's query heads (attend): as many of a K/V head's as the registers take (each key read
     * once for all of them), while that leaves tasks for the threads where they are used */
    int group = 1;
    for (int g = H / KV < ATT_CHAINS ? H / KV : ATT_CHAINS; g > 1; g--)
        if (H / KV % g == 0 && (keys_read < ATTENTION_SPLIT || spans * (H / g) >= 8)) {
            group = g;
            break;
        }
    int64_t max_tasks = spans * (H / group);
    att_task *tasks = malloc(sizeof(att_task) * max_tasks);
    float *partial = malloc(sizeof(float) * max_tasks * group * (D + 2));
    if (!tasks || !partial) {
        free(tasks), free(partial), free(buf);
        return -2;
    }
    int rc = 0;
    for (int l = 0; l < n_layers && rc == 0; l++) {
        const bk_layer *L = layers + l;
        rows_job rj = {a, L, c, l, 0, pos, table, x, xn, qkv, o, gu, act};
        rows_pass(&rj, ROWS_ATTN_IN, N);
        if ((rc = bk_matmul_many(L->qkv, 3, N, xn, qkv, level))) break;
        rows_pass(&rj, ROWS_QKV, N);
        int n_tasks = 0;
        for (int r = 0; r < N; r++) {
            int lo = L->window && pos[r] + 1 > L->window ? pos[r] + 1 - L->window : 0, hi = pos[r] + 1;
            int whole = lo / ATT_SPAN == pos[r] / ATT_SPAN;
            for (int h0 = 0; h0 < H; h0 += group)
                for (int s0 = lo; s0 < hi; s0 = (s0 / ATT_SPAN + 1) * ATT_SPAN) {
                    int s1 = (s0 / ATT_SPAN + 1) * ATT_SPAN;
                    tasks[n_tasks++] = (att_task){r, h0, s0, s1 < hi ? s1 : hi, whole};
                }
        }
        attention_job job = {a, L, c, l, pos, table, qkv, att, group, tasks, n_tasks, partial};
        if (keys_read < ATTENTION_SPLIT) attention_chunk(&job, 0, n_tasks); /* a sync point costs more than it saves */
        else bk_parallel(attention_chunk, &job, n_tasks, 1);
        for (int t = 0; t < n_tasks;) { /* the split rows' outputs */
            const att_task *first = tasks + t;
            int per = first->whole ? 1 : pos[first->row] / ATT_SPAN - first->lo / ATT_SPAN + 1;
            int row_tasks = H / group * per;
            if (!first->whole) combine_spans(&job, t, per);
            t += row_tasks;
        }
        if ((rc = bk_matmul_many(&L->o, 1, N, att, o, level))) break;
        if (tp && (rc = bk_tp_all_reduce(tp, o, (int64_t)N * dim))) break;
        rows_pass(&rj, ROWS_ATTN_OUT, N);
        if (L->n_experts) {
            if ((rc = moe(a, L, N, xn, o, level))) break;
        } else {
            if ((rc = bk_matmul_many(L->gate_up, 2, N, xn, gu, level))) break;
            rows_pass(&rj, ROWS_GATED, N);
            if ((rc = bk_matmul_many(&L->down, 1, N, act, o, level))) break;
        }
        if (tp && (rc = bk_tp_all_reduce(tp, o, (int64_t)N * dim))) break;
        rows_pass(&rj, ROWS_FFN_OUT, N);
    }
    free(buf), free(tasks), free(partial);
    return rc == -2 || rc == BK_TP_GONE || rc == BK_TP_TIMEOUT ? rc : rc ? -1 : 0;
}
