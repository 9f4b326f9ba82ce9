/* The per-instruction-set half of brisk's kernels: dequantize a tile of weight rows, multiply it
 * with the activations (see brisk_kernels.c for why this shape). Compiled once per level with that
 * level's compiler flags (native.py: plain, AVX2+FMA, AVX-512), each copy's functions named with
 * BK_SUFFIX, so the compiler vectorizes every loop for the instruction set it runs on.
 */
#include <stdint.h>
#include <string.h>

#include "bk_vec.h"
#include "bk_weight.h"
#include "gguf_types.h"
#include "int_dot.h"
#include "int8_dot.h"
#include "gguf_kquants.h"
#include "q3k_x8.h"
#include "q4k_x8.h"
#include "q8_x8.h"
#include "x8_rows.h"

#ifndef BK_CHUNK1
#define BK_CHUNK1 256
#endif

/* activation rows per dot: 4 x 4 sums fill 16 of AVX-512's 32 registers; AVX2's 16 (two per v16) take 2 x 4 */
#if defined(__AVX512F__)
#define DOT_ROWS 4
#else
#define DOT_ROWS 2
#endif

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)


BK_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Columns k0..k1 of row n of the weight as floats (k0, k1 multiples of chunk_unit). */
BK_INLINE void dequant_row(const bk_weight *w, int n, int k0, int k1, float *y) {
    const uint8_t *r = w->data + (int64_t)n * w->row_bytes;
    int K = w->K;
    if (w->type == BK_I4G) {
        int G = w->group;
        for (int g = k0 / G; g < k1 / G; g++) {
            float s = bf16_to_f32(w->scales[(int64_t)n * (K / G) + g]), z = bf16_to_f32(w->zeros[(int64_t)n * (K / G) + g]);
            const uint8_t *c = r + g * G / 2;
            float *o = y + g * G - k0;
            for (int i = 0; i < G / 2; i++) {
                o[2 * i] = ((float)(c[i] & 15) - 8.f) * s + z;
                o[2 * i + 1] = ((float)(c[i] >> 4) - 8.f) * s + z;
            }
        }
        return;
    }
    if (w->type == BK_F32) {
        memcpy(y, (const float *)r + k0, sizeof(float) * (k1 - k0));
        return;
    }
    if (w->type == BK_I8R) {
        float s = w->row_scales[n];
        for (int k = k0; k < k1; k++) y[k - k0] = (float)((const int8_t *)r)[k] * s;
        return;
    }
    int bw = bk_block_weights(w->type), bb = bk_block_bytes(w->type);
    if (w->layout == BK_X8) { /* each block gathered back into the file's bytes */
        uint8_t blk[210];
        for (int b = k0 / bw; b < k1 / bw; b++) {
            if (w->type == BK_Q4_K) dq_q4_k(x8_block(w, n, b, blk), y + b * bw - k0);
            else if (w->type == BK_Q5_K) dq_q5_k(q5x8_block(w, n, b, blk), y + b * bw - k0);
            else if (w->type == BK_Q6_K) dq_q6_k(q6x8_block(w, n, b, blk), y + b * bw - k0);
            else if (w->type == BK_Q3_K) dq_q3_k(q3x8_block(w, n, b, blk), y + b * bw - k0);
            else if (w->type == BK_Q2_K) dq_q2_k(q2x8_block(w, n, b, blk), y + b * bw - k0);
            else if (w->type == BK_Q8_0) dq_q8_0(x8i16_block(w, n, b, blk), y + b * bw - k0);
            else if (w->type == BK_Q4_1) dq_q4_1(x8i16_block(w, n, b, blk), y + b * bw - k0);
            else if (w->type == BK_Q5_0) dq_q5_0(x8i16_block(w, n, b, blk), y + b * bw - k0);
            else if (w->type == BK_Q5_1) dq_q5_1(x8i16_block(w, n, b, blk), y + b * bw - k0);
            else if (w->type == BK_MXFP4) dq_mxfp4(x8i16_block(w, n, b, blk), y + b * bw - k0);
            else dq_q4_0(x8i16_block(w, n, b, blk), y + b * bw - k0);
        }
        return;
    }
#define ROWS_OF(FN) for (int b = k0 / bw; b < k1 / bw; b++) FN(r + (int64_t)b * bb, y + b * bw - k0); break
    switch (w->type) {
    case BK_Q4_0: ROWS_OF(dq_q4_0);
    case BK_Q4_1: ROWS_OF(dq_q4_1);
    case BK_Q5_0: ROWS_OF(dq_q5_0);
    case BK_Q5_1: ROWS_OF(dq_q5_1);
    case BK_Q8_0: ROWS_OF(dq_q8_0);
    case BK_MXFP4: ROWS_OF(dq_mxfp4);
    case BK_Q2_K: ROWS_OF(dq_q2_k);
    case BK_Q3_K: ROWS_OF(dq_q3_k);
    case BK_Q4_K: ROWS_OF(dq_q4_k);
    case BK_Q5_K: ROWS_OF(dq_q5_k);
    case BK_Q6_K: ROWS_OF(dq_q6_k);
    default: memset(y, 0, sizeof(float) * (k1 - k0));
    }
#undef ROWS_OF
}

/* acc[m][r] += tile row r . x row m over k floats, for MR activation rows (x rows ldx apart, tile
 * rows ldw apart; k a multiple of LANES). Every sum runs over 16 fixed lanes, one multiply-add per
 * vector in column order, so neither splitting K into chunks nor how many activation rows share a
 * call changes a bit. `next` (or NULL): the next tile's rows, fetched a tile ahead as these are
 * read (float rows read in place: the hardware's streams restart at every tile's rows). */
#define DEFINE_DOT(name, MR)                                                                               \
    BK_INLINE void name(const float *w, int ldw, int k, const float *x, int64_t ldx, v16 *acc,              \
                        const float *next) {                                                                \
        v16 a[MR][TILE];                                                                                    \
        for (int m = 0; m < MR; m++)                                                                        \
            for (int r = 0; r < TILE; r++) a[m][r] = acc[m * TILE + r];                                     \
        for (int i = 0; i < k; i += LANES) {                                                                \
            if (next)                                                                                       \
                for (int r = 0; r < TILE; r++) __builtin_prefetch(next + r * ldw + i);                     \
            v16 wv[TILE];                                                                                   \
            for (int r = 0; r < TILE; r++) wv[r] = load16(w + r * ldw + i);                                 \
            for (int m = 0; m < MR; m++) {                                                                  \
                v16 xv = load16(x + m * ldx + i);                                                           \
                for (int r = 0; r < TILE; r++) a[m][r] = mac16(wv[r], xv, a[m][r]);                         \
            }                                                                                               \
        }                                                                                                   \
        for (int m = 0; m < MR; m++)                                                                        \
            for (int r = 0; r < TILE; r++) acc[m * TILE + r] = a[m][r];                                     \
    }
DEFINE_DOT(dot_tile, 1)
DEFINE_DOT(dot_tile_x4, DOT_ROWS)
#undef DEFINE_DOT

/* Rows n0..n1 of y [M, N] = x [M, K] w^T; y[m * ldy + n] (this weight's outputs may sit beside
 * others'). A tile's rows are dequantized CHUNK columns at a time: 4 rows of a whole 2048-wide row
 * (32 KB) overflowed the L1 cache and cost a third of the speed. Float rows are read where they lie.
 * Activation rows go MBLOCK at a time (their chunk stays in L2 while the tiles pass), DOT_ROWS of
 * them per dot. buf: bk_tile_floats(w, M) floats. */
#define MBLOCK 64
/* Float rows with up to SEQ_ROWS activation rows (decode): each weight row read start to end, one row
 * after another, a single forward stream: four rows read side by side (the tiles below) are four
 * streams, which the hardware prefetcher follows worse from DRAM. Each output's sum is the
 * tiles' own: one multiply-add per vector in column order from zero, then reduce16, so the bits do
 * not depend on which path M takes. */
#define SEQ_ROWS 4
BK_INLINE void f32_rows_seq(const bk_weight *w, int n0, int n1, int M, const float *x, float *y, int64_t ldy) {
    int K = w->K;
    for (int n = n0; n < n1; n++) {
        const float *r = (const float *)(w->data + (int64_t)n * w->row_bytes);
        if (M == 1) {
            v16 a = {0};
            for (int i = 0; i < K; i += LANES) a = mac16(load16(r + i), load16(x + i), a);
            y[n] = reduce16(a);
            continue;
        }
        v16 a[SEQ_ROWS] = {{0}};
        for (int i = 0; i < K; i += LANES) {
            v16 wv = load16(r + i);
            for (int m = 0; m < M; m++) a[m] = mac16(wv, load16(x + (int64_t)m * K + i), a[m]);
        }
        for (int m = 0; m < M; m++) y[(int64_t)m * ldy + n] = reduce16(a[m]);
    }
}

BK_INLINE void tile_rows(const bk_weight *w, int n0, int n1, int M, const float *x, float *y, int64_t ldy, float *buf) {
    if (w->type == BK_F32 && M <= SEQ_ROWS) {
        f32_rows_seq(w, n0, n1, M, x, y, ldy);
        return;
    }
    int K = w->K, C = bk_chunk(w), S = C + LANES; /* row stride: padded, off the 4 KB alias */
    v16 *acc = (v16 *)buf; /* [M][TILE] running sums, then the tile's C columns */
    float *tile = buf + (int64_t)M * TILE * LANES;
    for (int m0 = 0; m0 < M; m0 += MBLOCK) {
        int mc = M - m0 < MBLOCK ? M - m0 : MBLOCK;
        const float *xb = x + (int64_t)m0 * K;
        for (int n = n0; n < n1; n += TILE) {
            int R = n1 - n < TILE ? n1 - n : TILE;
            if (n + TILE < n1 && w->type != BK_F32) { /* the next tile's rows on their way while this one computes */
                const char *next = (const char *)w->data + (int64_t)(n + TILE) * w->row_bytes;
                for (int64_t b = 0; b < TILE * w->row_bytes; b += 64) __builtin_prefetch(next + b);
            }
            memset(acc, 0, sizeof(v16) * TILE * mc);
            for (int k0 = 0; k0 < K; k0 += C) {
                int k1 = k0 + C < K ? k0 + C : K;
                const float *rows = tile, *next = NULL;
                int ldw = S;
                if (w->type == BK_F32 && R == TILE) { /* float rows: multiplied where they lie */
                    rows = (const float *)(w->data + (int64_t)n * w->row_bytes) + k0, ldw = K;
                    next = n + 2 * TILE <= n1 ? rows + TILE * K : NULL;
                } else {
                    for (int r = 0; r < TILE; r++) {
                        if (r < R) dequant_row(w, n + r, k0, k1, tile + (int64_t)r * S);
                        else memset(tile + (int64_t)r * S, 0, sizeof(float) * (k1 - k0)); /* a ragged tail: dropped */
                    }
                }
                int m = 0;
                for (; m + DOT_ROWS <= mc; m += DOT_ROWS, next = NULL)
                    dot_tile_x4(rows, ldw, k1 - k0, xb + (int64_t)m * K + k0, K, acc + m * TILE, next);
                for (; m < mc; m++, next = NULL) dot_tile(rows, ldw, k1 - k0, xb + (int64_t)m * K + k0, K, acc + m * TILE, next);
            }
            for (int m = 0; m < mc; m++)
                for (int r = 0; r < R; r++) y[(int64_t)(m0 + m) * ldy + n + r] = reduce16(acc[m * TILE + r]);
        }
    }
}

BK_INLINE void dequant_rows(const bk_weight *w, const int64_t *rows, int n, float *out) {
    for (int i = 0; i < n; i++) dequant_row(w, (int)rows[i], 0, w->K, out + (int64_t)i * w->K);
}

void CAT(bk_tile_rows, BK_SUFFIX)(const bk_weight *w, int n0, int n1, int M, const float *x, float *y, int64_t ldy,
                                  float *buf) {
    tile_rows(w, n0, n1, M, x, y, ldy, buf);
}

void CAT(bk_dequant_rows, BK_SUFFIX)(const bk_weight *w, const int64_t *rows, int n, float *out) {
    dequant_rows(w, rows, n, out);
}

/* Rows n0..n1 of an integer-block weight (bk_int_type) times quantized activations (int_dot.h). */
void CAT(bk_int_rows, BK_SUFFIX)(const bk_weight *w, int n0, int n1, int M, const bk_xq *x, float *y, int64_t ldy,
                                 float *buf) {
    if (w->layout == BK_X8) {
        switch (w->type) { /* each type its own loop (x8i16_rows: type a constant) */
        case BK_Q4_K: x8_rows(w, BK_Q4_K, n0, n1, M, x, y, ldy, (v16 *)buf); break;
        case BK_Q5_K: x8_rows(w, BK_Q5_K, n0, n1, M, x, y, ldy, (v16 *)buf); break;
        case BK_Q6_K: x8_rows(w, BK_Q6_K, n0, n1, M, x, y, ldy, (v16 *)buf); break;
        case BK_Q3_K: x8_rows(w, BK_Q3_K, n0, n1, M, x, y, ldy, (v16 *)buf); break;
        case BK_Q2_K: x8_rows(w, BK_Q2_K, n0, n1, M, x, y, ldy, (v16 *)buf); break;
        case BK_Q8_0: x8i16_rows(w, BK_Q8_0, n0, n1, M, x, y, ldy, (v16 *)buf); break;
        case BK_Q4_1: x8i16_rows(w, BK_Q4_1, n0, n1, M, x, y, ldy, (v16 *)buf); break;
        case BK_Q5_0: x8i16_rows(w, BK_Q5_0, n0, n1, M, x, y, ldy, (v16 *)buf); break;
        case BK_Q5_1: x8i16_rows(w, BK_Q5_1, n0, n1, M, x, y, ldy, (v16 *)buf); break;
        case BK_MXFP4: x8i16_rows(w, BK_MXFP4, n0, n1, M, x, y, ldy, (v16 *)buf); break;
        default: x8i16_rows(w, BK_Q4_0, n0, n1, M, x, y, ldy, (v16 *)buf);
        }
        return;
    }
    if (x->q8 && bk_act8_type(w->type)) {
        v16 one[1], *acc = M == 1 ? one : (v16 *)buf; /* decode: the sums in registers */
        switch (w->type) {
        case BK_Q4_K: int8_tile_rows(w, BK_Q4_K, n0, n1, M, x, y, ldy, acc); return;
        case BK_Q5_K: int8_tile_rows(w, BK_Q5_K, n0, n1, M, x, y, ldy, acc); return;
        case BK_Q6_K: int8_tile_rows(w, BK_Q6_K, n0, n1, M, x, y, ldy, acc); return;
        case BK_Q3_K: int8_tile_rows(w, BK_Q3_K, n0, n1, M, x, y, ldy, acc); return;
        case BK_Q2_K: int8_tile_rows(w, BK_Q2_K, n0, n1, M, x, y, ldy, acc); return;
        }
    }
    if (M == 1) { /* decode: the sums in registers (the same operations) */
        v16 a[1];
#define ONE(T) int_tile_rows(w, T, n0, n1, 1, x, y, ldy, a); return
        switch (w->type) {
        case BK_Q4_0: ONE(BK_Q4_0);
        case BK_Q4_1: ONE(BK_Q4_1);
        case BK_Q8_0: ONE(BK_Q8_0);
        case BK_Q4_K: ONE(BK_Q4_K);
        case BK_Q5_K: ONE(BK_Q5_K);
        case BK_Q5_0: ONE(BK_Q5_0);
        case BK_Q5_1: ONE(BK_Q5_1);
        case BK_MXFP4: ONE(BK_MXFP4);
        case BK_Q6_K: ONE(BK_Q6_K);
        case BK_I8R: ONE(BK_I8R);
        case BK_I4G: ONE(BK_I4G);
        }
#undef ONE
        return;
    }
    v16 *acc = (v16 *)buf;
#define MANY(T) int_tile_rows(w, T, n0, n1, M, x, y, ldy, acc); return
    switch (w->type) {
    case BK_Q4_0: MANY(BK_Q4_0);
    case BK_Q4_1: MANY(BK_Q4_1);
    case BK_Q8_0: MANY(BK_Q8_0);
    case BK_Q4_K: MANY(BK_Q4_K);
    case BK_Q5_K: MANY(BK_Q5_K);
    case BK_Q5_0: MANY(BK_Q5_0);
    case BK_Q5_1: MANY(BK_Q5_1);
    case BK_MXFP4: MANY(BK_MXFP4);
    case BK_Q6_K: MANY(BK_Q6_K);
    case BK_I8R: MANY(BK_I8R);
    case BK_I4G: MANY(BK_I4G);
    }
#undef MANY
}

void CAT(bk_quantize_x, BK_SUFFIX)(const float *x, int M, int K, int16_t *q, float *s, float *sum) {
    quantize_x(x, M, K, q, s, sum);
}

void CAT(bk_quantize_x256, BK_SUFFIX)(const float *x, int M, int K, int16_t *q, float *s, float *bs) {
    quantize_x256(x, M, K, q, s, bs);
}

void CAT(bk_quantize_x8, BK_SUFFIX)(const float *x, int M, int K, int8_t *q, int8_t *qp, float *s, int16_t *xs, int16_t *xm) {
    quantize_x8(x, M, K, q, qp, s, xs, xm);
}

/* out [n1 - n0, k1 - k0] = rows n0..n1 of the weight, columns k0..k1 (whole blocks), dequantized */
void CAT(bk_dequant_slab, BK_SUFFIX)(const bk_weight *w, int n0, int n1, int k0, int k1, float *out) {
    for (int n = n0; n < n1; n++) dequant_row(w, n, k0, k1, out + (int64_t)(n - n0) * (k1 - k0));
}

/* A Q4_K weight from its sub-block's scale and min products (bk_k_scales': d sc, dmin m) and its
 * 4-bit code: every path below computes a weight by this one expression (the same floats) */
BK_INLINE float q4k_weight(float dl, float ml, int q) { return dl * (float)q - ml; }

/* A group of 8 interleaved rows' scale products, a sub-block's (8 rows) decoded on its first need:
 * a prefill's stream wants most of a block's columns, a decode step one or two. */
typedef struct {
    const uint8_t *g;
    int head;        /* Q4_K/Q5_K: where the group's d, -dmin and scale bytes start */
    unsigned done;   /* sub-blocks decoded */
    float a[16][8];  /* Q4_K: d sc (8 sub-blocks); Q6_K: d sc (16) */
    float b[8][8];   /* Q4_K: dmin m */
} x8_scales;

/* Q4_K's sub-block j for the group's 8 rows, by lanes: the group's head keeps the file's scale byte
 * t of row r at 32 + 32 (t / 4) + 4 r + t % 4 (a 32-bit word per row). bk_k_scale_min1's formulas
 * in lanes: the same through x8_head_bytes row by row made a decode step's missed column several times slower. */
BK_INLINE void q4k_x8_scales(x8_scales *S, int j) {
    const uint8_t *hd = S->g + S->head;
    int ta = j < 4 ? j : j + 4, tb = j < 4 ? j + 4 : j - 4, tc = j; /* the bytes sc and m come from */
    uint32_t wa[8], wb[8], wc[8];
    memcpy(wa, hd + 32 + 32 * (ta / 4), 32), memcpy(wb, hd + 32 + 32 * (tb / 4), 32), memcpy(wc, hd + 32 + 32 * (tc / 4), 32);
    int sa = 8 * (ta % 4), sbb = 8 * (tb % 4), scc = 8 * (tc % 4);
    for (int r = 0; r < 8; r++) {
        int A = wa[r] >> sa & 255, B = wb[r] >> sbb & 255, C = wc[r] >> scc & 255;
        int sc = j < 4 ? A & 63 : (A & 15) | (B >> 6) << 4;
        int m = j < 4 ? B & 63 : (A >> 4) | (C >> 6) << 4;
        S->a[j][r] = bk_fp16(hd + 2 * r) * (float)sc;
        S->b[j][r] = -bk_fp16(hd + 16 + 2 * r) /* stored negated */ * (float)m;
    }
    S->done |= 1u << j;
}

/* The group's 8 rows at column `at` of the block (weight 64c + 32hi + l, l < 32). Q4_K: code byte
 * 32c + l of row r sits at 64 (4c + l / 8) + 8 r + l % 8 (a 64-bit word a row); Q5_K: its low bits
 * there in chunk c's nibble vector l / 8 (320c + 64 (l / 8)), the fifth in bit 4hi + l / 8 of byte
 * 320c + 256 + 8r + l % 8 */
BK_INLINE void q4k_x8_column(x8_scales *S, int q5, int at, float *out) {
    int c = at / 64, hi = at % 64 >= 32, l = at % 32, j = 2 * c + hi;
    if (!(S->done >> j & 1)) q4k_x8_scales(S, j);
    uint64_t wq[8], wf[8];
    memcpy(wq, S->g + (q5 ? 320 * c + 64 * (l / 8) : 64 * (4 * c + l / 8)), 64);
    int sq = 8 * (l % 8) + 4 * hi, sf = 8 * (l % 8) + 4 * hi + l / 8;
    if (q5) {
        memcpy(wf, S->g + 320 * c + 256, 64);
        for (int r = 0; r < 8; r++)
            out[r] = q4k_weight(S->a[j][r], S->b[j][r], (int)(wq[r] >> sq & 15) | (int)(wf[r] >> sf & 1) << 4);
    } else {
        for (int r = 0; r < 8; r++) out[r] = q4k_weight(S->a[j][r], S->b[j][r], (int)(wq[r] >> sq & 15));
    }
}

BK_INLINE float q6k_weight(float ds, int q) { return ds * ((float)q - 32.f); } /* ds: d sc */

/* The same for Q6_K's groups: row r's scale, low code byte and high-bits byte sit at 4 r, 8 r and
 * 8 r of 32-, 64- and 64-byte runs of the group's super-block (_pack_q6_k) */
BK_INLINE void q6k_x8_column(x8_scales *S, int at, float *out) {
    const uint8_t *g = S->g;
    int j = at / 16, low = at % 128, ib = low % 8, shift = (at >= 128 ? 2 : 0) + (low % 16 >= 8 ? 4 : 0);
    if (!(S->done >> j & 1)) {
        uint32_t wsc[8];
        memcpy(wsc, g + 1536 + 32 * (at / 64), 32);
        for (int r = 0; r < 8; r++) S->a[j][r] = bk_fp16(g + 1664 + 2 * r) * (float)(int8_t)(wsc[r] >> 8 * (j % 4) & 255);
        S->done |= 1u << j;
    }
    uint64_t wl[8], wh[8];
    memcpy(wl, g + 192 * (low / 16) + 64 * (low / 8 % 2), 64), memcpy(wh, g + 192 * (low / 16) + 128, 64);
    int sl = 8 * ib + (at >= 128 ? 4 : 0), sh = 8 * ib + shift;
    for (int r = 0; r < 8; r++) out[r] = q6k_weight(S->a[j][r], (int)(wl[r] >> sl & 15) | (int)(wh[r] >> sh & 3) << 4);
}

/* Weight at (0..255) of a Q3_K row's super-block, as the file's dequantization computes it: d (sc -
 * 32), then times the 3-bit code less 4. g: the row's group (q3k_x8.h's layout, row r), else b: the
 * file's 110 bytes. Weight 128k + 32t + 8p + i: low bits 2t.. of code byte 32k + 8p + i, third bit
 * 4k + t of mask byte 8p + i; scale at / 16: nibble of byte (at / 16) % 8, top bits of 8 + (at / 16) % 4. */
BK_INLINE float q3k_column_weight(const uint8_t *g, const uint8_t *b, int r, int at) {
    int k = at / 128, t = at % 128 / 32, p = at % 32 / 8, i = at % 8, si = at / 16, ta = si % 8, tb = 8 + si % 4;
    uint8_t qs, hm, sa, sbb;
    float d;
    if (g) {
        qs = g[192 * p + 64 * k + 8 * r + i], hm = g[192 * p + 128 + 8 * r + i];
        sa = g[768 + 32 * (ta / 4) + 4 * r + ta % 4], sbb = g[768 + 32 * (tb / 4) + 4 * r + tb % 4];
        d = bk_fp16(g + 864 + 2 * r);
    } else {
        qs = b[32 + 32 * k + 8 * p + i], hm = b[8 * p + i], sa = b[96 + ta], sbb = b[96 + tb];
        d = bk_fp16(b + 108);
    }
    int sc = ((sa >> 4 * (si / 8)) & 15) | ((sbb >> 2 * (si / 4)) & 3) << 4;
    int q = (qs >> 2 * t & 3) - (hm >> (4 * k + t) & 1 ? 0 : 4);
    float dl = d * (float)(sc - 32);
    return dl * (float)q;
}

/* The same for Q2_K (q3k_x8.h; the file's 84 bytes): d (scale's low nibble) times the 2-bit code,
 * less dmin (its high nibble) */
BK_INLINE float q2k_column_weight(const uint8_t *g, const uint8_t *b, int r, int at) {
    int k = at / 128, t = at % 128 / 32, p = at % 32 / 8, i = at % 8, si = at / 16;
    uint8_t qs, sc;
    float d, dmin;
    if (g) {
        qs = g[128 * p + 64 * k + 8 * r + i], sc = g[512 + 32 * (si / 4) + 4 * r + si % 4];
        d = bk_fp16(g + 640 + 2 * r), dmin = bk_fp16(g + 656 + 2 * r);
    } else {
        qs = b[16 + 32 * k + 8 * p + i], sc = b[si];
        d = bk_fp16(b + 80), dmin = bk_fp16(b + 82);
    }
    float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
    return dl * (float)(qs >> 2 * t & 3) - ml;
}

/* outs[i][n - n0] = column ks[i] of rows n0..n1 for the nk columns ks, all in one 256-column block,
 * for the layouts K-quant files mostly hold (Q4_K and Q6_K rows interleaved by 8; the exact outlier
 * inputs' columns, brisk_kernels.c), a row's scales decoded once for all: 1, or 0 for another type
 * or layout (the caller dequantizes the columns' block). Each weight by one expression, however many
 * columns come along: a column's floats do not depend on the call. A block's slab costs 256 weights
 * a row; this decodes a group's 8 rows at once, each sub-block's scales once for all the columns,
 * several times faster than the slab for a decode step's missed column. Q2_K and Q3_K weights one
 * at a time (their bytes hold 4 weights' bits). */
int CAT(bk_dequant_columns, BK_SUFFIX)(const bk_weight *w, const int *ks, int nk, int n0, int n1, float *const *outs) {
    if (w->layout != BK_X8 || !bk_act8_type(w->type)) return 0;
    if (nk < 1) return 1;
    int ns = w->K / 256, whole = w->N / X8_ROWS * X8_ROWS, sb = ks[0] / 256;
    if (w->type == BK_Q3_K || w->type == BK_Q2_K) {
        int q3 = w->type == BK_Q3_K, fb = bk_block_bytes(w->type), gb = X8_ROWS * fb;
        for (int n = n0; n < n1; n++) {
            const uint8_t *g = NULL, *b = NULL;
            if (n < whole) g = w->data + ((int64_t)(n / X8_ROWS) * ns + sb) * gb;
            else b = w->data + (int64_t)n * w->row_bytes + sb * fb;
            for (int i = 0; i < nk; i++)
                outs[i][n - n0] = q3 ? q3k_column_weight(g, b, n % X8_ROWS, ks[i] % 256) : q2k_column_weight(g, b, n % X8_ROWS, ks[i] % 256);
        }
        return 1;
    }
    if (w->type == BK_Q4_K || w->type == BK_Q5_K) { /* q4k_x8.h's layouts: weight 64c + 32hi + i is sub-block 2c + hi */
        int q5 = w->type == BK_Q5_K, fb = bk_block_bytes(w->type), gb = X8_ROWS * fb, hd = q5 ? Q5X8_HEAD : 1024;
        for (int n = n0; n < n1;) {
            if (n % X8_ROWS == 0 && n + X8_ROWS <= (n1 < whole ? n1 : whole)) { /* a whole group: its 8 rows at once */
                const uint8_t *g = w->data + ((int64_t)(n / X8_ROWS) * ns + sb) * gb;
                if (n + 2 * X8_ROWS <= whole) /* the next group's head: a stride the hardware does not follow */
                    for (int t = hd; t < gb; t += 64) __builtin_prefetch(g + (int64_t)ns * gb + t);
                x8_scales S;
                S.g = g, S.head = hd, S.done = 0;
                for (int i = 0; i < nk; i++)
                    q4k_x8_column(&S, q5, ks[i] % 256, outs[i] + (n - n0));
                n += X8_ROWS;
                continue;
            }
            const uint8_t *b = w->data + (int64_t)n * w->row_bytes + sb * fb, *g = NULL;
            int r = n % X8_ROWS;
            uint8_t head[16];
            if (n < whole) { /* a group's row alone (a call that starts or ends inside it) */
                g = w->data + ((int64_t)(n / X8_ROWS) * ns + sb) * gb;
                x8_head_bytes(g + hd, r, head);
            }
            for (int i = 0; i < nk; i++) {
                int at = ks[i] % 256, c = at / 64, hi = at % 64 >= 32, l = at % 32, sc, m, q;
                bk_k_scale_min1((g ? head : b) + 4, 2 * c + hi, &sc, &m);
                if (!q5) /* code byte 32c + l */
                    q = (g ? g[64 * (4 * c + l / 8) + 8 * r + l % 8] : b[16 + 32 * c + l]) >> 4 * hi & 15;
                else if (g) /* chunk c: nibble vector l / 8, then the fifth bits (bit 4hi + l / 8) */
                    q = (g[320 * c + 64 * (l / 8) + 8 * r + l % 8] >> 4 * hi & 15) |
                        (g[320 * c + 256 + 8 * r + l % 8] >> (4 * hi + l / 8) & 1) << 4;
                else /* the file's: qh[l] bit 2c + hi, qs[32c + l] */
                    q = (b[48 + 32 * c + l] >> 4 * hi & 15) | (b[16 + l] >> (2 * c + hi) & 1) << 4;
                const uint8_t *h = g ? head : b;
                outs[i][n - n0] = q4k_weight(bk_fp16(h) * (float)sc, bk_fp16(h + 2) * (float)m, q);
            }
            n++;
        }
    }
    else /* Q6_K: q4k_x8.h's layout; the file's: dq_q6_k */
        for (int n = n0; n < n1; n++) {
            if (n % X8_ROWS == 0 && n + X8_ROWS <= (n1 < whole ? n1 : whole)) { /* a whole group, as Q4_K's */
                const uint8_t *g = w->data + ((int64_t)(n / X8_ROWS) * ns + sb) * Q6X8_BYTES;
                if (n + 2 * X8_ROWS <= whole)
                    for (int t = 1536; t < Q6X8_BYTES; t += 64) __builtin_prefetch(g + (int64_t)ns * Q6X8_BYTES + t);
                x8_scales S;
                S.g = g, S.head = 0, S.done = 0;
                for (int i = 0; i < nk; i++)
                    q6k_x8_column(&S, ks[i] % 256, outs[i] + (n - n0));
                n += X8_ROWS - 1;
                continue;
            }
            int r = n % X8_ROWS;
            const uint8_t *g = n < whole ? w->data + ((int64_t)(n / X8_ROWS) * ns + sb) * Q6X8_BYTES : NULL;
            const uint8_t *b = g ? NULL : w->data + (int64_t)n * w->row_bytes + sb * 210;
            float d = g ? bk_fp16(g + 1664 + 2 * r) : bk_fp16(b + 208);
            for (int i = 0; i < nk; i++) {
                int at = ks[i] % 256, sc, q;
                if (g) {
                    int low = at % 128, u = low / 8, ib = low % 8, shift = (at >= 128 ? 2 : 0) + (low % 16 >= 8 ? 4 : 0);
                    uint8_t l = g[192 * (u / 2) + 64 * (u % 2) + 8 * r + ib];
                    q = (at >= 128 ? l >> 4 : l & 15) | (g[192 * (low / 16) + 128 + 8 * r + ib] >> shift & 3) << 4;
                    sc = (int8_t)g[1536 + 32 * (at / 64) + 4 * r + at / 16 % 4];
                } else {
                    int h = at / 128, t = at % 128 / 32, o = at % 32;
                    uint8_t l = b[64 * h + 32 * (t & 1) + o], qh = b[128 + 32 * h + o];
                    q = (t < 2 ? l & 15 : l >> 4) | (qh >> (2 * t) & 3) << 4;
                    sc = (int8_t)b[192 + at / 16];
                }
                outs[i][n - n0] = q6k_weight(d * (float)sc, q);
            }
        }
    return 1;
}

/* Row m of the activations (xr, K inputs): its coarse blocks' largest inputs into out, in block
 * order, a block's largest first; their count. Coarse: the 8-bit grid's expected squared error, 255
 * inputs of step^2 / 12 (step = largest / 127), above err times the squared norm of the other 255 (a
 * Gaussian block sits near 6e-5, one outlier over small inputs far above 1e-3): one pass, no
 * rounding. A block stays coarse after giving up its largest when a second outlier stands as far
 * above the rest (one token of Gemma 3 Q3_K_M reached KL 2.6 that way): it gives up inputs, largest
 * first, until it is fine or OUTLIERS_PER_BLOCK are out. A fixed order: the row's choice is its own. */
int CAT(bk_row_outliers, BK_SUFFIX)(const float *xr, int m, int K, float err, bk_outlier *out) {
    const double per = 255.0 / (12.0 * 127.0 * 127.0);
    int n = 0;
    for (int k0 = 0; k0 < K; k0 += 256) {
        const float *b = xr + k0;
        v16 sq = {0}, mx = {0};
        for (int k = 0; k < 256; k += LANES) {
            v16 v = load16(b + k), a = (v16)((vi16)v & 0x7fffffff);
            sq += v * v;
            mx = select16(a > mx, a, mx);
        }
        double norm = 0.0;
        float amax = 0.0f;
        for (int l = 0; l < LANES; l++) norm += sq[l], amax = mx[l] > amax ? mx[l] : amax;
        float a[256]; /* the magnitudes, a taken one set to -1 */
        for (int nt = 0; nt < OUTLIERS_PER_BLOCK; nt++) {
            double top = (double)amax * amax;
            if (!(amax > 0.0f && top * per > err * (norm - top))) break;
            if (nt == 0)
                for (int k = 0; k < 256; k++) a[k] = fabsf(b[k]);
            int at = 0;
            while (a[at] != amax) at++; /* the first: amax is one of them */
            a[at] = -1.0f;
            v16 next = {0}; /* the largest after this one */
            for (int k = 0; k < 256; k += LANES) {
                v16 v = load16(a + k);
                next = select16(v > next, v, next);
            }
            out[n++] = (bk_outlier){m, k0 + at, b[at]};
            norm -= top;
            amax = 0.0f;
            for (int l = 0; l < LANES; l++) amax = next[l] > amax ? next[l] : amax;
        }
    }
    return n;
}

/* y[m, n] += v * col[n] for n in n0..n1, col = vals + slot[k] * stride - shift, for each entry (m, k,
 * v) with k in ka..kb in turn: the outlier products' adds, from the cache or a stream's columns
 * (brisk_kernels.c), one function so that both round alike; every output's sum runs over its row's
 * entries in their order, however the outputs are chunked */
void CAT(bk_add_entries, BK_SUFFIX)(const bk_outlier *o, int no, int ka, int kb, const float *vals, const int32_t *slot,
                                    int64_t stride, int64_t shift, float *y, int64_t ldy, int n0, int n1) {
    for (int i = 0; i < no; i++) {
        if (o[i].k < ka || o[i].k >= kb) continue;
        const float *col = vals + slot[o[i].k] * stride - shift;
        float *yr = y + (int64_t)o[i].m * ldy, v = o[i].v;
        for (int n = n0; n < n1; n++) yr[n] += v * col[n];
    }
}

