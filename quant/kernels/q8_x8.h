/* Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 with their rows interleaved 8 at a time (layout BK_X8), times 16-bit
 * activations (int_dot.h's grid: one scale per 32 inputs).
 *
 * Why: Gemma 3 270M's tied 262144 x 640 Q8_0 table is most of a decode step, and the file layout's
 * tiles of 4 rows read it as 4 streams from memory, about half of what one forward stream reaches
 * (q4k_x8.h). Interleaved, 8 rows' blocks are one stream, and a block's scale work (d times the
 * activations' scale, the float multiply-add) is done for 8 rows at once. Q4_1 (the default model's
 * type) is compute-bound in the file's layout: one row's block at a time, a 16-lane fold per block;
 * interleaved its codes are widened once per block for all activation rows, as Q8_0's.
 *
 * Layout (quant/gguf_interleave.py): rows in groups of 8; per group, block after block, 8 times the
 * file's block (Q8_0 272 bytes, Q4_0 144, Q4_1 160):
 *   codes:  Q8_0: 4 vectors of 32 int16 lanes, 2 codes to a lane: lane 8r + i of vector c holds
 *           weight 8c + i of row r (low byte) and of row 4 + r (high byte): two shifts make each an
 *           int16 (no byte widening on the one shuffle port).
 *           Q4_0/Q4_1: 2 vectors of 32 uint16 lanes, 4 codes to a lane: nibble k of lane 8r + i of
 *           vector V is weight 8c + i of row 4h + r, where 2c + h = 4V + k (q4x8_read)
 *           Q5_0/Q5_1: Q4_0's nibbles, then 8 uint32 lane masks (bit 8r + i of mask j: the fifth bit of
 *           the code at lane 8r + i of code vector j), added as 16 (gguf_interleave._q5_masks)
 *           MXFP4: 2 vectors of 64 bytes, 2 codes to a byte: nibble t of byte p of vector V is the code
 *           of byte p of Q8_0's vector 2V + t, so that two byte lookups give Q8_0's int8 layout
 *   then d of rows 0..7 (fp16), and for Q4_1/Q5_1 m of rows 0..7 (fp16); MXFP4: e of rows 0..7 (a byte)
 * Rows past the last whole group follow in the file's layout, at the file's offsets.
 *
 * The int32 sums are exact and the float epilogue is one function for one activation row or many:
 * a row's bits do not depend on its batch. */
#ifndef BRISK_Q8_X8_H
#define BRISK_Q8_X8_H

#include "q4k_x8.h"

BK_INLINE int x8i16_bytes(int type) { return X8_ROWS * bk_block_bytes(type); } /* a group's block: 8 rows' */

#define X8_FIFTH(type) bk_type_has(type, BK_FIFTH)
#define X8_MIN(type) bk_type_has(type, BK_MIN)

/* 8 int16 activations in every 128-bit lane */
BK_INLINE i16x32 bcast16x8(const int16_t *p) {
#if defined(__AVX512F__)
    return (i16x32)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
#else
    i16x32 v;
    for (int i = 0; i < 32; i += 8) memcpy((int16_t *)&v + i, p, 16);
    return v;
#endif
}

/* A group's block ready for the multiply-adds: codes widened to int16 (vector 2c + h: codes 8c..8c+7
 * of rows 4h..4h+3), the rows' d at lanes 4r'..4r'+3 (rows 0..3, 4..7). Made once for every
 * activation row. */
typedef struct {
    i16x32 w[8];
    v16 d0, d1;
} q8x8_block_t;

/* Q8_0's vector c (two rows' codes to a 16-bit lane) as the int16 codes of rows 0..3 and 4..7 */
BK_INLINE void q8x8_split(i16x32 v, q8x8_block_t *b, int c) {
    b->w[2 * c] = (i16x32)((u16x32)v << 8) >> 8; /* the low bytes, sign-extended */
    b->w[2 * c + 1] = v >> 8;
}

BK_INLINE void x8_scales_d(bk_v8 d, q8x8_block_t *b) {
    b->d0 = __builtin_shufflevector(d, d, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    b->d1 = __builtin_shufflevector(d, d, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
}

BK_INLINE void q8x8_read(const uint8_t *g, q8x8_block_t *b) {
    for (int c = 0; c < 4; c++) q8x8_split(load_i16x32((const int16_t *)(g + 64 * c)), b, c);
    x8_scales_d(half8(g + 256), b);
}

typedef uint32_t u32x8 __attribute__((vector_size(32)));

/* 64 MXFP4 codes (0..15) as their kvalues (int8 bytes) */
BK_INLINE u8x64 mxfp4_k64(u8x64 q) {
#if defined(__AVX512BW__)
    return (u8x64)_mm512_shuffle_epi8(_mm512_broadcast_i32x4((__m128i)bk_mxfp4_kvalues()), (__m512i)q);
#elif defined(__AVX2__)
    __m256i t = _mm256_broadcastsi128_si256((__m128i)bk_mxfp4_kvalues()), h[2];
    memcpy(h, &q, 64);
    h[0] = _mm256_shuffle_epi8(t, h[0]), h[1] = _mm256_shuffle_epi8(t, h[1]);
    u8x64 k;
    memcpy(&k, h, 64);
    return k;
#else
    u8x64 k;
    for (int i = 0; i < 64; i += 16) {
        bk_u8x16 part;
        memcpy(&part, (uint8_t *)&q + i, 16);
        part = bk_mxfp4_k(part);
        memcpy((uint8_t *)&k + i, &part, 16);
    }
    return k;
#endif
}

/* MXFP4: each nibble of the 2 code vectors looked up to Q8_0's int8 vectors; e of rows 0..7 as 2^(e - 128) */
BK_INLINE void mxfp4x8_read(const uint8_t *g, q8x8_block_t *b) {
    for (int V = 0; V < 2; V++) {
        u8x64 v;
        memcpy(&v, g + 64 * V, 64);
        q8x8_split((i16x32)mxfp4_k64(v & 15), b, 2 * V);
        q8x8_split((i16x32)mxfp4_k64(v >> 4), b, 2 * V + 1);
    }
    const uint8_t *h = g + 128;
    u32x8 e = {h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]}, a = e >> 1; /* bk_e8m0_half in lanes */
    x8_scales_d((bk_v8)((a + 63) << 23) * (bk_v8)((e - a + 63) << 23), b);
}

/* The same for Q4_0 / Q4_1 (codes 0..15; Q4_0's minus 8), and Q4_1's m at lanes 4r' (else 0) of m0, m1.
 * Their codes sit 4 to a 16-bit lane (gguf_interleave._q4_lanes): vector j = 2c + h is nibble j % 4 of
 * the lanes of 64-byte vector j / 4, a shift and a mask (no byte widening, which ran on the one
 * shuffle port: 7% of Q4_1's GEMV) */
BK_INLINE void q4x8_read(const uint8_t *g, int type, q8x8_block_t *b, v16 *m0, v16 *m1) {
    u16x32 v[2];
    memcpy(v, g, 128);
    const int fields = 128 + (X8_FIFTH(type) ? 32 : 0);
    for (int j = 0; j < 8; j++) {
        i16x32 q = (i16x32)((v[j >> 2] >> (4 * (j & 3))) & 15);
        if (X8_FIFTH(type)) { /* Q5_0 / Q5_1: + 16 under vector j's lane mask (the fifth bits) */
            uint32_t mk;
            memcpy(&mk, g + 128 + 4 * j, 4);
            q = fifth_bits(q, mk);
        }
        b->w[j] = type == BK_Q4_0 ? q - 8 : type == BK_Q5_0 ? q - 16 : q;
    }
    x8_scales_d(half8(g + fields), b);
    if (X8_MIN(type)) {
        bk_v8 m = half8(g + fields + 16), z = {0};
        *m0 = __builtin_shufflevector(m, z, 0, 8, 8, 8, 1, 8, 8, 8, 2, 8, 8, 8, 3, 8, 8, 8);
        *m1 = __builtin_shufflevector(m, z, 4, 8, 8, 8, 5, 8, 8, 8, 6, 8, 8, 8, 7, 8, 8, 8);
    }
}

/* f0 (rows 0..3), f1 (rows 4..7) += a group's block times one activation row's block (x: 32 codes,
 * s: its scale). Lanes 4r'..4r'+3 of f0 / f1 are row r' / 4 + r''s partial sums. */
BK_INLINE void q8x8_accumulate(const q8x8_block_t *b, const int16_t *x, float s, v16 *f0, v16 *f1) {
    vi16 a0 = {0}, a1 = {0};
    for (int c = 0; c < 4; c++) {
        i16x32 xv = bcast16x8(x + 8 * c);
        a0 = madd_add(a0, b->w[2 * c], xv);
        a1 = madd_add(a1, b->w[2 * c + 1], xv);
    }
    v16 sv = splat16(s);
    /* written as multiply-adds so that no copy is left to -ffp-contract (see fma16) */
    *f0 = fma16(__builtin_convertvector(a0, v16), fma16(b->d0, sv, (v16){0}), *f0);
    *f1 = fma16(__builtin_convertvector(a1, v16), fma16(b->d1, sv, (v16){0}), *f1);
}

BK_INLINE float sum4(v16 f, int r) { return (f[4 * r] + f[4 * r + 1]) + (f[4 * r + 2] + f[4 * r + 3]); }

/* Rows n0..n1 of a BK_X8 Q8_0 / Q4_0 / Q4_1 weight (type: a constant at each call, so each type gets
 * its own loop) times M rows of 16-bit activations, y[m * ldy + n]; a group partly inside n0..n1 is
 * computed whole and only its rows inside stored. acc: 2 M vectors. */
BK_INLINE void x8i16_rows(const bk_weight *w, int type, int n0, int n1, int M, const bk_xq *x, float *y, int64_t ldy,
                          v16 *acc) {
    int nb = w->K / QK, whole = w->N / X8_ROWS * X8_ROWS, bytes = x8i16_bytes(type);
    int64_t group_bytes = (int64_t)nb * bytes;
    int mb = x8_act_rows(M, 2 * (int64_t)w->K); /* 16-bit codes */
    for (int gp = n0 / X8_ROWS * X8_ROWS; gp < n1 && gp < whole; gp += X8_PASS_ROWS)
    for (int m_lo = 0; m_lo < M; m_lo += mb)
    for (int g0 = gp, m_hi = m_lo + mb < M ? m_lo + mb : M; g0 < gp + X8_PASS_ROWS && g0 < n1 && g0 < whole; g0 += X8_ROWS) {
        const uint8_t *grp = w->data + (int64_t)(g0 / X8_ROWS) * group_bytes;
        v16 one[2] = {{0}, {0}}, *f = M == 1 ? one : acc;
        for (int i = 2 * m_lo; i < 2 * m_hi && M > 1; i++) acc[i] = (v16){0};
        for (int b = 0; b < nb; b++) {
            const uint8_t *g = grp + (int64_t)b * bytes;
            for (int o = 0; o < bytes; o += 64) __builtin_prefetch(g + X8_PREFETCH + o);
            q8x8_block_t blk;
            v16 m0 = {0}, m1 = {0};
            if (type == BK_Q8_0) q8x8_read(g, &blk);
            else if (type == BK_MXFP4) mxfp4x8_read(g, &blk);
            else q4x8_read(g, type, &blk, &m0, &m1);
            for (int mi = m_lo; mi < m_hi; mi++) {
                int64_t at = (int64_t)mi * nb + b;
                q8x8_accumulate(&blk, x->q + at * QK, x->s[at], &f[2 * mi], &f[2 * mi + 1]);
                if (X8_MIN(type)) { /* + m s sum(codes), at lane 4r' of row r' */
                    v16 sum = splat16(x->sum[at]);
                    f[2 * mi] = fma16(m0, sum, f[2 * mi]), f[2 * mi + 1] = fma16(m1, sum, f[2 * mi + 1]);
                }
            }
        }
        for (int mi = m_lo; mi < m_hi; mi++)
            for (int r = 0; r < X8_ROWS; r++)
                if (g0 + r >= n0 && g0 + r < n1) y[(int64_t)mi * ldy + g0 + r] = sum4(f[2 * mi + r / 4], r % 4);
    }
    if (n1 > whole) { /* the rows after the last group, as the file has them */
        bk_weight tail = *w;
        tail.layout = 0;
        int a = n0 > whole ? n0 : whole;
        int_tile_rows(&tail, type, a, n1, M, x, y, ldy, acc);
    }
}

/* Row n's block b back in the file's bytes (Q8_0 34, Q4_0 18, Q4_1 20, Q5_0 22, Q5_1 24, MXFP4 17) */
BK_INLINE const uint8_t *x8i16_block(const bk_weight *w, int n, int b, uint8_t *out) {
    int type = w->type, nb = w->K / QK, whole = w->N / X8_ROWS * X8_ROWS, bytes = x8i16_bytes(type);
    int fields = X8_MIN(type) ? 2 : 1, codes = type == BK_Q8_0 ? 32 : 16, fifth = X8_FIFTH(type) ? 4 : 0;
    if (n >= whole) return w->data + (int64_t)n * w->row_bytes + (int64_t)b * (bytes / X8_ROWS);
    const uint8_t *g = w->data + ((int64_t)(n / X8_ROWS) * nb + b) * bytes;
    int r = n % X8_ROWS;
    if (type == BK_MXFP4) { /* weight 8c + i: nibble c % 2 of byte 2 (8 (r % 4) + i) + r / 4 of vector c / 2 */
        out[0] = g[128 + r];
        memset(out + 1, 0, 16);
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 8; i++) {
                int w8 = 8 * c + i, code = g[64 * (c / 2) + 2 * (8 * (r % 4) + i) + r / 4] >> 4 * (c % 2) & 15;
                out[1 + w8 % 16] |= (uint8_t)(code << (w8 >= 16 ? 4 : 0));
            }
        return out;
    }
    for (int f = 0; f < fields; f++) memcpy(out + 2 * f, g + 8 * (codes + fifth) + 16 * f + 2 * r, 2);
    if (type == BK_Q8_0) {
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 8; i++) out[2 + 8 * c + i] = g[64 * c + 2 * (8 * (r % 4) + i) + r / 4];
        return out;
    }
    if (fifth) { /* qh: bit w = weight w's fifth bit, from bit 8 (r % 4) + i of vector 2c + r / 4's mask (w = 8c + i) */
        uint32_t qh = 0;
        for (int c = 0; c < 4; c++) {
            uint32_t mk;
            memcpy(&mk, g + 128 + 4 * (2 * c + r / 4), 4);
            qh |= (mk >> (8 * (r % 4)) & 255u) << (8 * c);
        }
        memcpy(out + 2 * fields, &qh, 4);
    }
    uint8_t *q = out + 2 * fields + fifth; /* weight w: byte w % 16, high nibble from 16 on */
    memset(q, 0, 16);
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 8; i++) {
            int j = 2 * c + r / 4, at = 64 * (j >> 2) + 2 * (8 * (r % 4) + i), w8 = 8 * c + i;
            unsigned lane = g[at] | (unsigned)g[at + 1] << 8, code = lane >> (4 * (j & 3)) & 15;
            q[w8 % 16] |= (uint8_t)(code << (w8 >= 16 ? 4 : 0));
        }
    return out;
}

#endif
