/* Products with the activations as 16-bit integers, for the types whose blocks are 32 small integer
 * codes with a scale (Q4_0, Q4_1, Q8_0, brisk's int8 rows): per block, the codes times the
 * activations' codes summed exactly in int32 (one multiply-add instruction per 32 pairs), then
 * scaled once in float. About half the instructions of dequantizing to float32 first.
 *
 * Each activation row is quantized per block of 32: x = s q, |q| <= 32767, s = max|x| / 32767. The
 * rounding moves x by at most 2^-16 of its block's largest value, ~500x finer than the 8-bit
 * activations llama.cpp uses (which cost a 135M model KL 0.02 to its float self and flipped a greedy
 * answer). Rows are quantized on their own, so a row's result still does not depend on its batch.
 * Included by tiles.c (one copy per instruction set). */
#ifndef BRISK_INT_DOT_H
#define BRISK_INT_DOT_H

#include <math.h>

#include "bk_vec.h"
#include "bk_weight.h"
#include "gguf_types.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32 /* weights per block, activations per scale */

typedef int16_t i16x32 __attribute__((vector_size(64)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x32 __attribute__((vector_size(64)));
typedef int8_t i8x32 __attribute__((vector_size(32)));

/* The quantized activations: codes [M, K], per block scale s and s * sum(codes) [M, K / 32]. */
typedef struct {
    const int16_t *q;
    const float *s, *sum;
} bk_xq;

BK_INLINE int bk_int_type(int type) {
    return type == BK_Q4_0 || type == BK_Q4_1 || type == BK_Q5_0 || type == BK_Q8_0 || type == BK_Q4_K || type == BK_Q6_K ||
           type == BK_I8R;
}

/* the types with a per-block minimum (weight = d code + m) */
#define HAS_MIN(type) ((type) == BK_Q4_1 || (type) == BK_Q4_K)

/* lane l = a[2l] b[2l] + a[2l+1] b[2l+1], exact in int32 */
BK_INLINE vi16 madd(i16x32 a, i16x32 b) {
#if defined(__AVX512BW__)
    return (vi16)_mm512_madd_epi16((__m512i)a, (__m512i)b);
#elif defined(__AVX2__)
    __m256i a2[2], b2[2], r[2];
    memcpy(a2, &a, 64);
    memcpy(b2, &b, 64);
    r[0] = _mm256_madd_epi16(a2[0], b2[0]);
    r[1] = _mm256_madd_epi16(a2[1], b2[1]);
    vi16 out;
    memcpy(&out, r, 64);
    return out;
#else
    /* even and odd lanes widened: vector code on any instruction set (NEON: smull/smlal) */
#define EVEN(v) __builtin_convertvector(__builtin_shufflevector(v, v, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), vi16)
#define ODD(v) __builtin_convertvector(__builtin_shufflevector(v, v, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), vi16)
    return EVEN(a) * EVEN(b) + ODD(a) * ODD(b);
#undef EVEN
#undef ODD
#endif
}

BK_INLINE i16x32 load_i16x32(const int16_t *p) {
    i16x32 v;
    memcpy(&v, p, 64);
    return v;
}

/* 16 bytes of 4-bit codes as 32 int16: the low nibbles, then the high ones */
BK_INLINE i16x32 nibbles(const uint8_t *p) {
#if defined(__AVX512BW__)
    __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), m = _mm256_set1_epi16(15);
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(c, m)),
                                   _mm256_and_si256(_mm256_srli_epi16(c, 4), m), 1);
    return (i16x32)q;
#elif defined(__AVX2__)
    __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), m = _mm256_set1_epi16(15);
    __m256i h[2] = {_mm256_and_si256(c, m), _mm256_and_si256(_mm256_srli_epi16(c, 4), m)};
    i16x32 q;
    memcpy(&q, h, 64);
    return q;
#else
    i16x16 c = __builtin_convertvector(bk_load_u8x16(p), i16x16);
    return __builtin_shufflevector(c & 15, c >> 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,
                                   19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
#endif
}

/* 32 bytes as 32 int16 (zero-extended) */
BK_INLINE i16x32 bytes_i16(const uint8_t *p) {
#if defined(__AVX512BW__)
    return (i16x32)_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__)
    __m256i h[2] = {_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)),
                    _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)))};
    i16x32 q;
    memcpy(&q, h, 64);
    return q;
#else
    i16x32 q;
    for (int i = 0; i < 32; i++) q[i] = p[i];
    return q;
#endif
}

/* Block b of row n as 32 integer codes (weight j = d code_j + m), its d and m. */
BK_INLINE i16x32 int_block(const bk_weight *w, int type, int n, int b, float *d, float *m) {
    const uint8_t *p = w->data + (int64_t)n * w->row_bytes;
    if (type == BK_I8R || type == BK_Q8_0) {
        i8x32 c;
        if (type == BK_I8R) {
            memcpy(&c, p + b * QK, QK);
            *d = w->row_scales[n];
        } else {
            p += b * 34;
            memcpy(&c, p + 2, QK);
            *d = bk_fp16(p);
        }
        *m = 0.0f;
        return __builtin_convertvector(c, i16x32);
    }
    if (type == BK_Q5_0) { /* Q4_0's nibbles plus a fifth bit per weight (bit j of qh) */
        p += b * 22;
        uint32_t qh;
        memcpy(&qh, p + 2, 4);
        uint16_t lo = (uint16_t)qh, hi = (uint16_t)(qh >> 16);
        const u16x32 bit = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        u16x32 h = {lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo,
                    hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi};
        *d = bk_fp16(p);
        *m = 0.0f;
        return (nibbles(p + 6) | (i16x32)(((h >> bit) & 1) << 4)) - 16;
    }
    /* Q4_0 / Q4_1: code byte j holds weight j (low nibble) and j + 16 (high) */
    p += b * (type == BK_Q4_0 ? 18 : 20);
    i16x32 q = nibbles(p + (type == BK_Q4_0 ? 2 : 4));
    *d = bk_fp16(p);
    if (type == BK_Q4_0) {
        *m = 0.0f;
        return q - 8;
    }
    *m = bk_fp16(p + 2);
    return q;
}

/* Four rows' int32 lane sums folded to 4 lanes each, side by side (integer adds: exact). */
BK_INLINE vi16 fold4(vi16 a, vi16 b, vi16 c, vi16 d) {
    vi16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
              __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vi16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
              __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    return __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}

/* One Q4_K super-block's [d sc_0..7, dmin m_0..7] (the 6-bit fields unpacked in one vector; the
 * same floats as bk_k_scales) */
BK_INLINE v16 q4k_scales(const uint8_t *blk) {
    bk_u8x16 v = bk_load_u8x16(blk + 4); /* the 12 scale bytes s0..s11 (and 4 code bytes, unused) */
    bk_u8x16 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    bk_u8x16 hi = __builtin_shufflevector(v, v, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7);
    const bk_u8x16 shift = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4};
    const bk_u8x16 low = {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15};
    const bk_u8x16 top = {0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48};
    bk_u8x16 six = ((lo >> shift) & low) | (((hi >> 6) << 4) & top);
    float d = bk_fp16(blk), dmin = bk_fp16(blk + 2);
    return bk_u8_to_f32(six) * (v16){d, d, d, d, d, d, d, d, dmin, dmin, dmin, dmin, dmin, dmin, dmin, dmin};
}

/* Q4_K's super-blocks of 256 (8 sub-blocks of 32 with 6-bit scales and minimums): the scales
 * decoded once per super-block into each sub-block's d and m vectors, and each 32 code bytes widened
 * once for their two sub-blocks (low nibbles: sub-block 2c, high: 2c + 1). The same per-lane
 * operations as int_tile_rows' loop. */
BK_INLINE void q4k_tile(const bk_weight *w, int n, int R, int M, const bk_xq *x, v16 *acc) {
    int K = w->K, nb = K / QK;
    for (int sb = 0; sb < K / 256; sb++) {
        const uint8_t *row[TILE];
        v16 f[TILE];
        for (int r = 0; r < TILE; r++) {
            row[r] = w->data + (int64_t)(n + (r < R ? r : 0)) * w->row_bytes + sb * 144;
            f[r] = r < R ? q4k_scales(row[r]) : (v16){0};
        }
        /* dv[j]: sub-block j's d of row r in lanes 4r..4r+3; mv[j]: its -m in lane 4r */
        v16 dv[8], mv[8];
        const v16 first = {1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0};
#define SPREAD(j) __builtin_shufflevector(                                                                     \
        __builtin_shufflevector(f[0], f[1], j, j, j, j, 16 + j, 16 + j, 16 + j, 16 + j, 0, 0, 0, 0, 0, 0, 0, 0), \
        __builtin_shufflevector(f[2], f[3], j, j, j, j, 16 + j, 16 + j, 16 + j, 16 + j, 0, 0, 0, 0, 0, 0, 0, 0), \
        0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
#define BOTH(j) dv[j] = SPREAD(j), mv[j] = -SPREAD(8 + j) * first
        BOTH(0); BOTH(1); BOTH(2); BOTH(3); BOTH(4); BOTH(5); BOTH(6); BOTH(7);
#undef BOTH
#undef SPREAD
        for (int c = 0; c < 4; c++) {
            i16x32 lo[TILE], hi[TILE];
            for (int r = 0; r < TILE; r++) {
                i16x32 raw = bytes_i16(row[r] + 16 + 32 * c);
                lo[r] = raw & 15;
                hi[r] = raw >> 4;
            }
            v16 d0 = dv[2 * c], d1 = dv[2 * c + 1], m0 = mv[2 * c], m1 = mv[2 * c + 1];
            int b = sb * 8 + 2 * c;
            for (int mi = 0; mi < M; mi++) {
                const int16_t *xq = x->q + (int64_t)mi * K + b * QK;
                const float *xs = x->s + (int64_t)mi * nb + b, *xsum = x->sum + (int64_t)mi * nb + b;
                i16x32 x0 = load_i16x32(xq), x1 = load_i16x32(xq + QK);
                v16 a = acc[mi] + __builtin_convertvector(fold4(madd(lo[0], x0), madd(lo[1], x0), madd(lo[2], x0), madd(lo[3], x0)), v16) * (d0 * xs[0]);
                a += m0 * xsum[0];
                a += __builtin_convertvector(fold4(madd(hi[0], x1), madd(hi[1], x1), madd(hi[2], x1), madd(hi[3], x1)), v16) * (d1 * xs[1]);
                a += m1 * xsum[1];
                acc[mi] = a;
            }
        }
    }
}

BK_INLINE i16x32 two_scales(const int8_t *sc) {
    int16_t a = sc[0], b = sc[1];
    return (i16x32){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b, b, b, b, b, b, b, b, b};
}

/* Q6_K's super-blocks of 256 (two halves of 128: 4 low bits in ql, 2 high in qh, an int8 scale per
 * 16 weights, one d): the 6-bit codes (q - 32) times their int8 scales, still exact in int16
 * (|.| <= 4096) and in the int32 sums (8 products of <= 4096 * 32767 per folded lane). */
BK_INLINE void q6k_tile(const bk_weight *w, int n, int R, int M, const bk_xq *x, v16 *acc) {
    int K = w->K, nb = K / QK;
    for (int sb = 0; sb < K / 256; sb++) {
        const uint8_t *row[TILE];
        float dr[TILE];
        for (int r = 0; r < TILE; r++) {
            row[r] = w->data + (int64_t)(n + (r < R ? r : 0)) * w->row_bytes + sb * 210;
            dr[r] = r < R ? bk_fp16(row[r] + 208) : 0.0f;
        }
        v16 d = {dr[0], dr[0], dr[0], dr[0], dr[1], dr[1], dr[1], dr[1],
                 dr[2], dr[2], dr[2], dr[2], dr[3], dr[3], dr[3], dr[3]};
        for (int h = 0; h < 2; h++) {
            i16x32 q[4][TILE];
            for (int r = 0; r < TILE; r++) {
                const uint8_t *ql = row[r] + 64 * h, *qh = row[r] + 128 + 32 * h;
                const int8_t *sc = (const int8_t *)(row[r] + 192 + 8 * h);
                i16x32 a = bytes_i16(ql), b = bytes_i16(ql + 32), hb = bytes_i16(qh);
                q[0][r] = (((a & 15) | ((hb & 3) << 4)) - 32) * two_scales(sc);
                q[1][r] = (((b & 15) | (((hb >> 2) & 3) << 4)) - 32) * two_scales(sc + 2);
                q[2][r] = (((a >> 4) | (((hb >> 4) & 3) << 4)) - 32) * two_scales(sc + 4);
                q[3][r] = (((b >> 4) | (((hb >> 6) & 3) << 4)) - 32) * two_scales(sc + 6);
            }
            for (int mi = 0; mi < M; mi++) {
                v16 a = acc[mi];
                for (int j = 0; j < 4; j++) {
                    int blk = sb * 8 + 4 * h + j;
                    i16x32 xv = load_i16x32(x->q + (int64_t)mi * K + blk * QK);
                    vi16 sums = fold4(madd(q[j][0], xv), madd(q[j][1], xv), madd(q[j][2], xv), madd(q[j][3], xv));
                    a += __builtin_convertvector(sums, v16) * (d * x->s[(int64_t)mi * nb + blk]);
                }
                acc[mi] = a;
            }
        }
    }
}

/* The products of rows n0..n1 of an integer-block weight of this type with M quantized activation
 * rows (acc: scratch for M vectors). Per block, the tile's 4 rows' exact integer sums share one
 * vector (4 lanes a row) scaled by d s in float, and a minimum's term m (s sum of x codes) goes
 * into the row's first lane; an output is its 4 lanes' sum over the blocks, reduced in a fixed
 * order. Every output runs the same operations in the same order whatever M is. */
BK_INLINE void int_tile_rows(const bk_weight *w, int type, int n0, int n1, int M, const bk_xq *x, float *y,
                             int64_t ldy, v16 *acc) {
    int K = w->K, nb = K / QK;
    for (int n = n0; n < n1; n += TILE) {
        int R = n1 - n < TILE ? n1 - n : TILE;
        if (n + TILE < n1) {
            const char *next = (const char *)w->data + (int64_t)(n + TILE) * w->row_bytes;
            for (int64_t o = 0; o < TILE * w->row_bytes; o += 64) __builtin_prefetch(next + o);
        }
        for (int i = 0; i < M; i++) acc[i] = (v16){0};
        if (type == BK_Q4_K) {
            q4k_tile(w, n, R, M, x, acc);
        } else if (type == BK_Q6_K) {
            q6k_tile(w, n, R, M, x, acc);
        } else
        for (int b = 0; b < nb; b++) {
            i16x32 q[TILE];
            float dr[TILE], mn[TILE];
            for (int r = 0; r < TILE; r++) {
                if (r < R) q[r] = int_block(w, type, n + r, b, &dr[r], &mn[r]);
                else q[r] = (i16x32){0}, dr[r] = mn[r] = 0.0f;
            }
            v16 d = {dr[0], dr[0], dr[0], dr[0], dr[1], dr[1], dr[1], dr[1],
                     dr[2], dr[2], dr[2], dr[2], dr[3], dr[3], dr[3], dr[3]};
            v16 m = {mn[0], 0, 0, 0, mn[1], 0, 0, 0, mn[2], 0, 0, 0, mn[3], 0, 0, 0}; /* in each row's first lane */
            for (int mi = 0; mi < M; mi++) {
                i16x32 xv = load_i16x32(x->q + (int64_t)mi * K + b * QK);
                vi16 sums = fold4(madd(q[0], xv), madd(q[1], xv), madd(q[2], xv), madd(q[3], xv));
                v16 a = acc[mi] + __builtin_convertvector(sums, v16) * (d * x->s[(int64_t)mi * nb + b]);
                if (HAS_MIN(type)) a += m * x->sum[(int64_t)mi * nb + b];
                acc[mi] = a;
            }
        }
        for (int mi = 0; mi < M; mi++) {
            float t[LANES];
            memcpy(t, acc + mi, sizeof t);
            for (int r = 0; r < R; r++) y[(int64_t)mi * ldy + n + r] = (t[4 * r] + t[4 * r + 2]) + (t[4 * r + 1] + t[4 * r + 3]);
        }
    }
}

/* x [M, K] -> codes, scales and scaled code sums per block of 32 (K a multiple of 32). */
BK_INLINE void quantize_x(const float *x, int M, int K, int16_t *q, float *s, float *sum) {
    const float magic = 12582912.0f; /* adding 1.5 * 2^23 rounds to an integer */
    for (int64_t b = 0; b < (int64_t)M * (K / QK); b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int k = 0; k < QK; k++) amax = fabsf(xb[k]) > amax ? fabsf(xb[k]) : amax;
        float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int total = 0;
        for (int k = 0; k < QK; k++) {
            int v = (int)((xb[k] * inv + magic) - magic);
            q[b * QK + k] = (int16_t)v;
            total += v;
        }
        s[b] = amax / 32767.0f;
        sum[b] = s[b] * (float)total;
    }
}

#endif
