/* The per-instruction-set half of brisk's kernels: dequantize a tile of weight rows, multiply it
 * with the activations (see brisk_kernels.c for why this shape). Compiled once per level with that
 * level's compiler flags (native.py: plain, AVX2+FMA, AVX-512), each copy's functions named with
 * BK_SUFFIX, so the compiler vectorizes every loop for the instruction set it runs on.
 */
#include <stdint.h>
#include <string.h>

#include "bk_weight.h"
#include "gguf_types.h"

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

#define TILE 4
#define LANES 16
typedef float v16 __attribute__((vector_size(LANES * 4)));

BK_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Row n of the weight as K floats. */
BK_INLINE void dequant_row(const bk_weight *w, int n, float *y) {
    const uint8_t *r = w->data + (int64_t)n * w->row_bytes;
    int K = w->K;
    if (w->type == BK_I4G) {
        int G = w->group;
        for (int g = 0; g < K / G; g++) {
            float s = bf16_to_f32(w->scales[(int64_t)n * (K / G) + g]), z = bf16_to_f32(w->zeros[(int64_t)n * (K / G) + g]);
            const uint8_t *c = r + g * G / 2;
            float *o = y + g * G;
            for (int i = 0; i < G / 2; i++) {
                o[2 * i] = ((float)(c[i] & 15) - 8.f) * s + z;
                o[2 * i + 1] = ((float)(c[i] >> 4) - 8.f) * s + z;
            }
        }
        return;
    }
    if (w->type == BK_I8R) {
        float s = w->row_scales[n];
        for (int k = 0; k < K; k++) y[k] = (float)((const int8_t *)r)[k] * s;
        return;
    }
    int bw = bk_block_weights(w->type), bb = bk_block_bytes(w->type), nb = K / bw;
#define ROWS_OF(FN) for (int b = 0; b < nb; b++) FN(r + (int64_t)b * bb, y + b * bw); break
    switch (w->type) {
    case BK_Q4_0: ROWS_OF(dq_q4_0);
    case BK_Q4_1: ROWS_OF(dq_q4_1);
    case BK_Q5_0: ROWS_OF(dq_q5_0);
    case BK_Q5_1: ROWS_OF(dq_q5_1);
    case BK_Q8_0: ROWS_OF(dq_q8_0);
    case BK_Q2_K: ROWS_OF(dq_q2_k);
    case BK_Q3_K: ROWS_OF(dq_q3_k);
    case BK_Q4_K: ROWS_OF(dq_q4_k);
    case BK_Q5_K: ROWS_OF(dq_q5_k);
    case BK_Q6_K: ROWS_OF(dq_q6_k);
    default: memset(y, 0, sizeof(float) * K);
    }
#undef ROWS_OF
}

BK_INLINE v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

BK_INLINE float reduce16(v16 a) { /* a fixed pairwise order */
    float t[LANES];
    memcpy(t, &a, sizeof t);
    for (int s = LANES / 2; s >= 1; s /= 2)
        for (int l = 0; l < s; l++) t[l] += t[l + s];
    return t[0];
}

/* out[r] = tile row r . x for the TILE rows of w (row stride K; K a multiple of LANES). */
BK_INLINE void dot_tile(const float *w, int K, const float *x, float *out) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int k = 0; k < K; k += LANES) {
        v16 xv = load16(x + k);
        a0 += load16(w + k) * xv;
        a1 += load16(w + K + k) * xv;
        a2 += load16(w + 2 * K + k) * xv;
        a3 += load16(w + 3 * K + k) * xv;
    }
    out[0] = reduce16(a0);
    out[1] = reduce16(a1);
    out[2] = reduce16(a2);
    out[3] = reduce16(a3);
}

/* Rows n0..n1 of y [M, N] = x [M, K] w^T, buf: TILE * K floats. */
/* y[m * ldy + n] for rows n0..n1 of the weight (y [M, ldy]: this weight's outputs may sit beside others'). */
BK_INLINE void tile_rows(const bk_weight *w, int n0, int n1, int M, const float *x, float *y, int64_t ldy, float *buf) {
    int K = w->K;
    for (int n = n0; n < n1; n += TILE) {
        int R = n1 - n < TILE ? n1 - n : TILE;
        for (int r = 0; r < TILE; r++) {
            if (r < R) dequant_row(w, n + r, buf + (int64_t)r * K);
            else memset(buf + (int64_t)r * K, 0, sizeof(float) * K); /* a ragged tail: computed, dropped */
        }
        for (int m = 0; m < M; m++) {
            float out[TILE];
            dot_tile(buf, K, x + (int64_t)m * K, out);
            for (int r = 0; r < R; r++) y[(int64_t)m * ldy + n + r] = out[r];
        }
    }
}

BK_INLINE void dequant_rows(const bk_weight *w, const int64_t *rows, int n, float *out) {
    for (int i = 0; i < n; i++) dequant_row(w, (int)rows[i], out + (int64_t)i * w->K);
}

void CAT(bk_tile_rows, BK_SUFFIX)(const bk_weight *w, int n0, int n1, int M, const float *x, float *y, int64_t ldy,
                                  float *buf) {
    tile_rows(w, n0, n1, M, x, y, ldy, buf);
}

void CAT(bk_dequant_rows, BK_SUFFIX)(const bk_weight *w, const int64_t *rows, int n, float *out) {
    dequant_rows(w, rows, n, out);
}
