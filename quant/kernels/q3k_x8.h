/* Q3_K and Q2_K with their rows interleaved 8 at a time (layout BK_X8), times 8-bit activations:
 * q4k_x8.h's recipe (one broadcast of 8 activations serves 8 rows, a sub-block's codes summed in
 * int16 before one scale multiply-add, scales and the float epilogue once per 8 rows): several times
 * the speed of float32 tiles or of the file's layout on int8_dot.h. Uses q4k_x8.h's helpers;
 * x8_rows.h dispatches here.
 *
 * Both layouts only move whole bytes (quant/gguf_interleave.py _moved_bytes): a byte's bits keep
 * their file meaning, so packing is one gather and so is getting a block back.
 *
 * Q3_K, 880 bytes per group's super-block (8 x 110):
 *   [0, 768)    4 chunks of 3 vectors: chunk p holds, for rows 0..7 in turn (8 bytes each), the row's
 *               qs bytes 8p..8p+7, then qs bytes 32 + 8p.., then hmask bytes 8p... Byte i of the k-th
 *               (k < 2) holds in bits 2t, 2t + 1 the low bits of weight 128k + 32t + 8p + i; hmask's
 *               bit 4k + t that weight's third bit. Chunks 2q and 2q + 1 hold sub-blocks 8k + 2t + q
 *               (the first and second 8 weights): the kernel reads them together, one forward stream.
 *   [768, 864)  the 12 scale bytes of each row regrouped as Q4_K's: bytes 0..3 of rows 0..7, then
 *               4..7, then 8..11 (lane 4r + i of each 32 bytes: row r's byte i, 4 + i, 8 + i)
 *   [864, 880)  d of rows 0..7 (fp16)
 * The codes are taken as q + 4 (0..7, unsigned for maddubs) and 4 sum_j scale_j x_j taken off after.
 * Exact: a sub-block's int16 sum is at most 4 x 7 x 127 = 3556 (two maddubs, 4 products a lane); its
 * scale (-32..31) times that, summed over 16 sub-blocks, and the offset's 4 x 16 x 32 x 2032 are far
 * inside int32 (|codes - 4| <= 4: the true sum is at most 256 x 4 x 127 x 32 = 4.2e6).
 *
 * Q2_K, 672 bytes per group's super-block (8 x 84):
 *   [0, 512)    2 halves of 4 vectors: half q holds chunk 2q then 2q + 1, each the rows' qs bytes
 *               8p..8p+7 then 32 + 8p.. (p the chunk; bits as Q3_K's, no third bit)
 *   [512, 640)  the 16 scale bytes (low nibble scale, high nibble minimum) as Q6_K's scales: vector
 *               q (32 bytes), byte 4r + t = row r's byte 4q + t
 *   [640, 656)  d of rows 0..7, [656, 672) dmin of rows 0..7 (fp16)
 * A sub-block's int16 sum is at most 4 x 3 x 127 = 1524; scales and minimums are 0..15. */
#ifndef BRISK_Q3K_X8_H
#define BRISK_Q3K_X8_H

#include <stdint.h>
#include <string.h>

#include "bk_weight.h"
#include "gguf_types.h"
#include "q4k_x8.h" /* the helpers these share */

#define Q3X8_BYTES 880
#define Q2X8_BYTES 672

/* the two low bits of code vector t (bits 2t, 2t + 1 of each byte) */
BK_INLINE u8x64 low2(u8x64 v, int t) { return (u8x64)(((u16x32v)v >> (2 * t)) & 0x0303); }

/* bit b of each byte moved to bit 2 (16-bit shifts: no bit reaches bit 2 from the other byte) */
BK_INLINE u8x64 third_bit(u8x64 v, int b) {
    u16x32v w = (u16x32v)v;
    return (u8x64)((b >= 2 ? w >> (b - 2) : w << (2 - b)) & 0x0404);
}

/* Q3_K's 16 scales (-32..31) of rows 0..7, laid out as Q6_K's (q6x8_head); hd: g + 768 */
BK_INLINE void q3x8_read(const uint8_t *hd, q6x8_head *h) {
    u8x32s A, B, C; /* lanes 4r + i: row r's scale bytes i, 4 + i, 8 + i */
    memcpy(&A, hd, 32), memcpy(&B, hd + 32, 32), memcpy(&C, hd + 64, 32);
    /* scale i: nibble i / 8 of byte i % 8, then bits 2 (i / 4).. of byte 8 + i % 4 as its top two */
    u8x32s q[4] = {(A & 15) | (C & 3) << 4, (B & 15) | ((C >> 2) & 3) << 4, (A >> 4) | ((C >> 4) & 3) << 4,
                   (B >> 4) | (C >> 6) << 4};
    for (int k = 0; k < 4; k++) {
        i16x32 w = __builtin_convertvector(q[k], i16x32) - 32;
        h->scq[k] = w;
        h->sc[4 * k] = SPREAD(w, 0), h->sc[4 * k + 1] = SPREAD(w, 1), h->sc[4 * k + 2] = SPREAD(w, 2);
        h->sc[4 * k + 3] = SPREAD(w, 3);
    }
    bk_v8 d = half8(hd + 96);
    h->d = __builtin_shufflevector(d, d, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
}

/* code vector t of L with its third bits, bit b of H's bytes: q + 4 */
BK_INLINE u8x64 q3_codes(u8x64 L, u8x64 H, int t, int b) {
#if defined(__AVX512BW__) /* a byte test into a mask, then a masked add: one instruction fewer */
    __m512i lo = (__m512i)low2(L, t);
    __mmask64 k = _mm512_test_epi8_mask((__m512i)H, _mm512_set1_epi8((char)(1 << b)));
    return (u8x64)_mm512_mask_add_epi8(lo, k, lo, _mm512_set1_epi8(4));
#else
    return low2(L, t) | third_bit(H, b);
#endif
}

/* a += sub-blocks 8k + 2t + q (t < 4) of chunks 2q, 2q + 1 times their activations. Called once per
 * (q, k), not looped: clang kept loops over k and t, their shifts in registers, and spilled. */
BK_INLINE vi16 q3x8_part(vi16 a, const uint8_t *g, const int8_t *x, const q6x8_head *h, int q, int k) {
    const uint8_t *p = g + 384 * q;
    u8x64 L0 = load_u8x64(p + 64 * k), L1 = load_u8x64(p + 192 + 64 * k), H0 = load_u8x64(p + 128), H1 = load_u8x64(p + 320);
    const int8_t *xk = x + 128 * k + 16 * q;
#define Q3X8_SUB(t)                                                                                                  \
    a = madd_add(a, maddubs(q3_codes(L0, H0, t, 4 * k + t), bcast8(xk + 32 * t)) +                                  \
                        maddubs(q3_codes(L1, H1, t, 4 * k + t), bcast8(xk + 32 * t + 8)), h->sc[8 * k + 2 * t + q])
    Q3X8_SUB(0); Q3X8_SUB(1); Q3X8_SUB(2); Q3X8_SUB(3);
#undef Q3X8_SUB
    return a;
}

/* the codes are q + 4: take 4 sum_j scale_j x_j off */
BK_INLINE v16 q3x8_finish(vi16 a, const q6x8_head *h, const int16_t *xs, v16 s, v16 f) {
    a -= x8_offset_sums(h->scq, xs) << 2;
    return fma16(fma16(__builtin_convertvector(a, v16), h->d, (v16){0}), s, f);
}

/* f += a group's Q3_K super-block times one activation row (x: its 256 codes in order; xs: its 16
 * sums of 16 codes; s: its scale). Lanes 2r, 2r + 1 of f are row r's. */
BK_INLINE v16 q3x8_accumulate(const uint8_t *g, const q6x8_head *h, const int8_t *x, const int16_t *xs, v16 s, v16 f) {
    vi16 a = {0}; /* chunks 0 and 1 (weights 32t + 0..15 of each 128), then 2 and 3 (16..31) */
    a = q3x8_part(a, g, x, h, 0, 0), a = q3x8_part(a, g, x, h, 0, 1);
    a = q3x8_part(a, g, x, h, 1, 0), a = q3x8_part(a, g, x, h, 1, 1);
    return q3x8_finish(a, h, xs, s, f);
}

/* the codes of x8_codes (q4k_x8.h): sub-block 8k + 2t + q from chunks 2q, 2q + 1 */
BK_INLINE void q3x8_decode(const uint8_t *g, x8_codes *o) {
    for (int q = 0; q < 2; q++) {
        const uint8_t *p = g + 384 * q;
        u8x64 H0 = load_u8x64(p + 128), H1 = load_u8x64(p + 320);
        for (int k = 0; k < 2; k++) {
            u8x64 L0 = load_u8x64(p + 64 * k), L1 = load_u8x64(p + 192 + 64 * k);
            for (int t = 0; t < 4; t++) {
                int j = 8 * k + 2 * t + q;
                o->c[2 * j] = q3_codes(L0, H0, t, 4 * k + t), o->c[2 * j + 1] = q3_codes(L1, H1, t, 4 * k + t);
            }
        }
    }
}

/* Row n's super-block sb back in the file's 110 bytes */
BK_INLINE const uint8_t *q3x8_block(const bk_weight *w, int n, int sb, uint8_t *out) {
    int ns = w->K / 256, whole = w->N / X8_ROWS * X8_ROWS;
    if (n >= whole) return w->data + (int64_t)n * w->row_bytes + sb * 110;
    const uint8_t *g = w->data + ((int64_t)(n / X8_ROWS) * ns + sb) * Q3X8_BYTES;
    int r = n % X8_ROWS;
    for (int p = 0; p < 4; p++) {
        memcpy(out + 32 + 8 * p, g + 192 * p + 8 * r, 8);
        memcpy(out + 64 + 8 * p, g + 192 * p + 64 + 8 * r, 8);
        memcpy(out + 8 * p, g + 192 * p + 128 + 8 * r, 8);
    }
    for (int k = 0; k < 3; k++) memcpy(out + 96 + 4 * k, g + 768 + 32 * k + 4 * r, 4);
    memcpy(out + 108, g + 864 + 2 * r, 2);
    return out;
}

/* Q2_K: one group's super-block, decoded once for every activation row */
typedef struct {
    i16x32 sc[16]; /* sub-block j's scale: int16 lanes 4r..4r+3 hold row r's */
    i16x32 m[4];   /* lane 4r + t: row r's minimum 4q + t */
    v16 d, nm;     /* lanes 2r, 2r + 1: row r's d and -dmin */
} q2x8_head;

BK_INLINE void q2x8_read(const uint8_t *hd, q2x8_head *h) { /* hd: g + 512 */
    for (int q = 0; q < 4; q++) {
        u8x32s v;
        memcpy(&v, hd + 32 * q, 32);
        i16x32 w = __builtin_convertvector(v & 15, i16x32);
        h->m[q] = __builtin_convertvector(v >> 4, i16x32);
        h->sc[4 * q] = SPREAD(w, 0), h->sc[4 * q + 1] = SPREAD(w, 1), h->sc[4 * q + 2] = SPREAD(w, 2);
        h->sc[4 * q + 3] = SPREAD(w, 3);
    }
    bk_v8 d = half8(hd + 128), m = -half8(hd + 144);
    h->d = __builtin_shufflevector(d, d, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    h->nm = __builtin_shufflevector(m, m, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
}

/* minimums x sums of 16, then the float epilogue */
BK_INLINE v16 q2x8_finish(vi16 a, const q2x8_head *h, const int16_t *xs, v16 s, v16 f) {
    vi16 mn = madd(h->m[0], (i16x32)bcast8((const int8_t *)xs));
    for (int q = 1; q < 4; q++) mn = madd_add(mn, h->m[q], (i16x32)bcast8((const int8_t *)(xs + 4 * q)));
    v16 t = fma16(__builtin_convertvector(a, v16), h->d, (v16){0});
    t = fma16(__builtin_convertvector(mn, v16), h->nm, t);
    return fma16(t, s, f);
}

/* f += a group's Q2_K super-block times one activation row (as q3x8_accumulate) */
BK_INLINE v16 q2x8_accumulate(const uint8_t *g, const q2x8_head *h, const int8_t *x, const int16_t *xs, v16 s, v16 f) {
    vi16 a = {0};
    for (int q = 0; q < 2; q++) {
        const uint8_t *p = g + 256 * q;
        for (int k = 0; k < 2; k++) {
            u8x64 L0 = load_u8x64(p + 64 * k), L1 = load_u8x64(p + 128 + 64 * k);
            const int8_t *xk = x + 128 * k + 16 * q;
            for (int t = 0; t < 4; t++) { /* sub-block 8k + 2t + q */
                i16x32 sum = maddubs(low2(L0, t), bcast8(xk + 32 * t)) + maddubs(low2(L1, t), bcast8(xk + 32 * t + 8));
                a = madd_add(a, sum, h->sc[8 * k + 2 * t + q]);
            }
        }
    }
    return q2x8_finish(a, h, xs, s, f);
}

/* the codes of x8_codes: sub-block 8k + 2t + q */
BK_INLINE void q2x8_decode(const uint8_t *g, x8_codes *o) {
    for (int q = 0; q < 2; q++)
        for (int k = 0; k < 2; k++) {
            u8x64 L0 = load_u8x64(g + 256 * q + 64 * k), L1 = load_u8x64(g + 256 * q + 128 + 64 * k);
            for (int t = 0; t < 4; t++) {
                int j = 8 * k + 2 * t + q;
                o->c[2 * j] = low2(L0, t), o->c[2 * j + 1] = low2(L1, t);
            }
        }
}

/* Row n's super-block sb back in the file's 84 bytes */
BK_INLINE const uint8_t *q2x8_block(const bk_weight *w, int n, int sb, uint8_t *out) {
    int ns = w->K / 256, whole = w->N / X8_ROWS * X8_ROWS;
    if (n >= whole) return w->data + (int64_t)n * w->row_bytes + sb * 84;
    const uint8_t *g = w->data + ((int64_t)(n / X8_ROWS) * ns + sb) * Q2X8_BYTES;
    int r = n % X8_ROWS;
    for (int p = 0; p < 4; p++) {
        memcpy(out + 16 + 8 * p, g + 128 * p + 8 * r, 8);
        memcpy(out + 48 + 8 * p, g + 128 * p + 64 + 8 * r, 8);
    }
    for (int q = 0; q < 4; q++) memcpy(out + 4 * q, g + 512 + 32 * q + 4 * r, 4);
    memcpy(out + 80, g + 640 + 2 * r, 2);
    memcpy(out + 82, g + 656 + 2 * r, 2);
    return out;
}

#endif
