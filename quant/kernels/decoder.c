/* The transformer blocks of a forward pass in one call: for rows of float32 activations, each
 * block's norms, q/k/v products, rope, K/V writes, attention, output product, residuals and gated
 * MLP, the products through brisk_kernels.c's bk_matmul_many. In torch the same step is ~20 small
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

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

/* Attention over fewer keys (summed over rows and heads) runs on the calling thread: one decode
 * step's few thousand dot products take microseconds, and on a busy machine each split across
 * threads risks waiting for a worker the OS has descheduled. */
#define ATTENTION_SPLIT 32768

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

/* rotate-half rope of one head in place: x[i] cos[i] + x[(i + D/2) mod D] sin[i] */
BK_INLINE void rope(float *x, const float *cos, const float *sin, int D) {
    float t[512];
    int h = D / 2;
    for (int i = 0; i < D; i++) t[i] = x[i] * cos[i] + x[i < h ? i + h : i - h] * sin[i];
    memcpy(x, t, sizeof(float) * D);
}

BK_INLINE float dot(const float *a, const float *b, int n) {
    v16 acc = {0};
    for (int k = 0; k < n; k += LANES) acc += load16(a + k) * load16(b + k);
    return reduce16(acc);
}

typedef struct {
    const bk_arch *a;
    const bk_layer *L;
    const bk_cache *c;
    int layer;
    const int32_t *pos, *table;
    const float *qkv; /* [N, (H + 2 KV) D] */
    float *out;       /* [N, H D] */
} attention_job;

static _Thread_local float *score_buf;
static _Thread_local size_t score_cap;

/* One query head of one row against its sequence's keys: softmax(q k / sqrt) v, over the positions
 * the row sees (its own and before; with a window, the last `window` of them). */
static void attend_one(const attention_job *j, int r, int h) {
    const bk_arch *a = j->a;
    const bk_cache *c = j->c;
    int D = a->head_dim, P = j->pos[r];
    int lo = j->L->window && P + 1 > j->L->window ? P + 1 - j->L->window : 0, n = P + 1 - lo;
    size_t need = (size_t)(n + LANES);
    if (score_cap < need) {
        free(score_buf);
        score_buf = malloc(need * 2 * sizeof(float));
        score_cap = score_buf ? need * 2 : 0;
        if (!score_buf) return;
    }
    float *s = score_buf;
    const float *q = j->qkv + (int64_t)r * (a->n_heads + 2 * a->n_kv) * D + (int64_t)h * D;
    const int32_t *tab = c->tables + j->table[r];
    int64_t head = (int64_t)(h / (a->n_heads / a->n_kv)) * c->head_stride;
    const float *kc = c->k[j->layer] + head, *vc = c->v[j->layer] + head;
#define AT(base, p) ((base) + (int64_t)tab[(p) / c->block_size] * c->block_stride + (int64_t)((p) % c->block_size) * c->pos_stride)
    float m = -INFINITY;
    for (int i = 0; i < n; i++) {
        s[i] = dot(q, AT(kc, lo + i), D) * a->attn_scale;
        m = s[i] > m ? s[i] : m;
    }
    for (int i = n; i < n + LANES; i++) s[i] = -INFINITY; /* the last vector's spare lanes: e^-inf = 0 */
    v16 sum = {0};
    for (int i = 0; i < n; i += LANES) {
        v16 e = exp16(load16(s + i) - m);
        store16(s + i, e);
        sum += e;
    }
    float acc[512] __attribute__((aligned(64)));
    memset(acc, 0, sizeof(float) * D);
    for (int i = 0; i < n; i++) {
        const float *v = AT(vc, lo + i);
        v16 p = splat16(s[i]);
        for (int k = 0; k < D; k += LANES) store16(acc + k, load16(acc + k) + p * load16(v + k));
    }
#undef AT
    float inv = 1.0f / reduce16(sum), *y = j->out + (int64_t)r * a->n_heads * D + (int64_t)h * D;
    for (int k = 0; k < D; k += LANES) store16(y + k, load16(acc + k) * inv);
}

static void attention_chunk(const void *p, int i0, int i1) {
    const attention_job *j = p;
    for (int i = i0; i < i1; i++) attend_one(j, i / j->a->n_heads, i % j->a->n_heads);
}

/* gate/up [N, 2 F] -> act(gate) * up [N, F] */
BK_INLINE void gated(const float *gu, float *out, int F, int gelu) {
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

/* Rows x [N, dim] (in place) through every layer: row r at position pos[r], its sequence's block
 * table at c->tables + table[r]. Every row's K/V are written before any row attends, so a row sees
 * the rows of this call that precede it in its sequence. Returns 0, -1 on a product's shape error,
 * -2 out of memory. */
int CAT(bk_decoder, BK_SUFFIX)(const bk_arch *a, const bk_layer *layers, int n_layers, const bk_cache *c, int N,
                               const int32_t *pos, const int32_t *table, float *x, int level) {
    int dim = a->dim, D = a->head_dim, H = a->n_heads, KV = a->n_kv, F = a->ffn, W = (H + 2 * KV) * D;
    size_t floats = (size_t)N * (dim + W + H * D + dim + 2 * F + F);
    float *buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (!buf) return -2;
    float *xn = buf, *qkv = xn + (size_t)N * dim, *att = qkv + (size_t)N * W, *o = att + (size_t)N * H * D,
          *gu = o + (size_t)N * dim, *act = gu + (size_t)N * 2 * F;
    int64_t keys_read = 0; /* per layer: the positions all rows attend over, times the heads */
    for (int r = 0; r < N; r++) keys_read += (int64_t)(pos[r] + 1) * H;
    int rc = 0;
    for (int l = 0; l < n_layers && rc == 0; l++) {
        const bk_layer *L = layers + l;
        for (int r = 0; r < N; r++) rms_norm(x + (int64_t)r * dim, L->attn_in, xn + (int64_t)r * dim, dim, a->eps);
        if ((rc = bk_matmul_many(L->qkv, 3, N, xn, qkv, level))) break;
        for (int r = 0; r < N; r++) {
            float *q = qkv + (int64_t)r * W, *k = q + H * D, *v = k + KV * D;
            const float *bias[3] = {L->q_bias, L->k_bias, L->v_bias};
            float *part[3] = {q, k, v};
            int width[3] = {H * D, KV * D, KV * D};
            for (int i = 0; i < 3; i++)
                if (bias[i])
                    for (int e = 0; e < width[i]; e++) part[i][e] += bias[i][e];
            const float *cs = L->cos + (int64_t)pos[r] * D, *sn = L->sin + (int64_t)pos[r] * D;
            for (int h = 0; h < H + KV; h++) { /* q heads, then k heads */
                float *head = q + (int64_t)h * D;
                if (a->qk_norm) rms_norm(head, h < H ? L->q_norm : L->k_norm, head, D, a->eps);
                rope(head, cs, sn, D);
            }
            const int32_t *tab = c->tables + table[r];
            int64_t at = (int64_t)tab[pos[r] / c->block_size] * c->block_stride +
                         (int64_t)(pos[r] % c->block_size) * c->pos_stride;
            for (int h = 0; h < KV; h++) {
                memcpy(c->k[l] + at + h * c->head_stride, k + (int64_t)h * D, sizeof(float) * D);
                memcpy(c->v[l] + at + h * c->head_stride, v + (int64_t)h * D, sizeof(float) * D);
            }
        }
        attention_job job = {a, L, c, l, pos, table, qkv, att};
        if (keys_read < ATTENTION_SPLIT) attention_chunk(&job, 0, N * H); /* a sync point costs more than it saves */
        else bk_parallel(attention_chunk, &job, N * H, 2);
        if ((rc = bk_matmul_many(&L->o, 1, N, att, o, level))) break;
        for (int r = 0; r < N; r++) {
            float *xr = x + (int64_t)r * dim, *orow = o + (int64_t)r * dim, *xnr = xn + (int64_t)r * dim;
            if (a->sandwich) {
                rms_norm(orow, L->post_attn, orow, dim, a->eps);
                add_rows(xr, orow, dim);
                rms_norm(xr, L->pre_ffn, xnr, dim, a->eps);
            } else {
                add_rows(xr, orow, dim);
                rms_norm(xr, L->post_attn, xnr, dim, a->eps);
            }
        }
        if ((rc = bk_matmul_many(L->gate_up, 2, N, xn, gu, level))) break;
        for (int r = 0; r < N; r++) gated(gu + (int64_t)r * 2 * F, act + (int64_t)r * F, F, a->gelu);
        if ((rc = bk_matmul_many(&L->down, 1, N, act, o, level))) break;
        for (int r = 0; r < N; r++) {
            float *xr = x + (int64_t)r * dim, *orow = o + (int64_t)r * dim;
            if (a->sandwich) rms_norm(orow, L->post_ffn, orow, dim, a->eps);
            add_rows(xr, orow, dim);
        }
    }
    free(buf);
    return rc ? -1 : 0;
}
