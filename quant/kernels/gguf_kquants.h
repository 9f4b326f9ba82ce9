/* GGUF's K-quants: super-blocks of 256 weights in sub-blocks of 16 or 32, each
 * sub-block with a small integer scale (and min) against the super-block's fp16 d (and dmin).
 *
 *   Q2_K  84 bytes: scales[16] (sc low nibble, m high), qs[64] (2 bits), d, dmin (fp16)
 *         16 sub-blocks of 16                        w = (d sc) q - (dmin m)
 *   Q3_K  110 bytes: hmask[32] (third bits), qs[64] (2 low bits), scales[12] (16 x 6 bits), d (fp16)
 *         16 sub-blocks of 16                        w = (d (sc - 32)) (q - 4 if its hmask bit is 0)
 *   Q4_K  144 bytes: d, dmin (fp16), scales[12] (8 sc + 8 m, 6 bits each), qs[128] (4 bits)
 *         8 sub-blocks of 32                         w = (d sc) q - (dmin m)
 *   Q5_K  176 bytes: d, dmin, scales[12] as Q4_K, qh[32] (fifth bits), qs[128] (4 low bits)
 *         8 sub-blocks of 32                         w = (d sc) q - (dmin m)
 *   Q6_K  210 bytes: ql[128] (4 low bits), qh[64] (2 high bits), scales[16] (int8), d (fp16)
 *         16 sub-blocks of 16                        w = (d sc) (q - 32)
 * Sub-block s holds weights 16 s.. (or 32 s..). Where the bits are (h a half of 128 weights, j < 32):
 *   Q2_K, Q3_K  weight 128 h + 32 t + j (t < 4): bits 2t, 2t+1 of qs[32 h + j]; Q3_K's third bit of
 *               weight i is bit i / 32 of hmask[i % 32]. Q3_K's scale i: low 4 bits nibble i / 8 of
 *               scales[i % 8], high 2 bits bits 2 (i / 4) of scales[8 + i % 4].
 *   Q4_K, Q5_K  weight 64 c + 32 n + j: nibble n of qs[32 c + j]; Q5_K's fifth bit of weight i is bit
 *               i / 32 of qh[i % 32]. Scale/min i < 4: low 6 bits of scales[i] / scales[i + 4];
 *               i >= 4: nibble 0 / 1 of scales[i + 4] | the top 2 bits of scales[i - 4] / scales[i] << 4.
 *   Q6_K        weight 128 h + 32 t + j: nibble t / 2 of ql[64 h + 32 (t & 1) + j] | bits 2t, 2t+1 of
 *               qh[32 h + j] << 4.
 * Every product (d sc) q has at most 23 significant bits (fp16 d 11, sc 7, q 5: Q6_K's), so it is exact in
 * float32, as is dmin m: a fused multiply-add gives the same bits as gguf's numpy (product, then subtract).
 */
#ifndef BRISK_GGUF_KQUANTS_H
#define BRISK_GGUF_KQUANTS_H

#include <stdint.h>

#include "gguf_types.h"

/* The loops below take 16 (or 32) byte positions j at a time and write the 4 (or 2) weights each byte
 * position holds, every one with its sub-block's scale hoisted and constant shifts: GCC vectorizes them. */
BK_INLINE void dq_q2_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b;
    float d = bk_fp16(b + 80), dmin = bk_fp16(b + 82), dl[16], ml[16];
    for (int i = 0; i < 16; i++) {
        dl[i] = d * (float)(sc[i] & 15);
        ml[i] = dmin * (float)(sc[i] >> 4);
    }
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 2; p++) { /* bytes 32 h + 16 p.. hold sub-blocks 8 h + p + 2 t, t < 4 */
            const uint8_t *q = b + 16 + 32 * h + 16 * p;
            const float *a = dl + 8 * h + p, *m = ml + 8 * h + p;
            float a0 = a[0], a1 = a[2], a2 = a[4], a3 = a[6], m0 = m[0], m1 = m[2], m2 = m[4], m3 = m[6];
            float *o = y + 128 * h + 16 * p;
            for (int j = 0; j < 16; j++) {
                o[j] = a0 * (float)(q[j] & 3) - m0;
                o[j + 32] = a1 * (float)(q[j] >> 2 & 3) - m1;
                o[j + 64] = a2 * (float)(q[j] >> 4 & 3) - m2;
                o[j + 96] = a3 * (float)(q[j] >> 6) - m3;
            }
        }
}

BK_INLINE void dq_q3_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b + 96;
    float d = bk_fp16(b + 108), dl[16];
    for (int i = 0; i < 16; i++) {
        int lo = (sc[i % 8] >> (4 * (i / 8))) & 15, hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        dl[i] = d * (float)((lo | hi << 4) - 32);
    }
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 2; p++) { /* as Q2_K */
            const uint8_t *q = b + 32 + 32 * h + 16 * p, *hm = b + 16 * p;
            const float *a = dl + 8 * h + p;
            float a0 = a[0], a1 = a[2], a2 = a[4], a3 = a[6], *o = y + 128 * h + 16 * p;
            int s = 4 * h; /* the third bits of weights 32 t + j: bit t (of 4 h + t) */
            for (int j = 0; j < 16; j++) { /* q - 4 + 4 (its hmask bit) */
                int m = hm[j] >> s;
                o[j] = a0 * (float)((q[j] & 3) + ((m & 1) << 2) - 4);
                o[j + 32] = a1 * (float)((q[j] >> 2 & 3) + ((m & 2) << 1) - 4);
                o[j + 64] = a2 * (float)((q[j] >> 4 & 3) + (m & 4) - 4);
                o[j + 96] = a3 * (float)((q[j] >> 6) + ((m & 8) >> 1) - 4);
            }
        }
}

/* Q4_K's and Q5_K's 12 bytes of scales -> 8 scales and 8 mins (6 bits each). */
BK_INLINE void bk_k_scale_min(const uint8_t *s, int *sc, int *m) {
    for (int i = 0; i < 4; i++) {
        sc[i] = s[i] & 63;
        m[i] = s[i + 4] & 63;
        sc[i + 4] = (s[i + 8] & 15) | (s[i] >> 6) << 4;
        m[i + 4] = (s[i + 8] >> 4) | (s[i + 4] >> 6) << 4;
    }
}

/* bk_k_scale_min's sub-block j alone */
BK_INLINE void bk_k_scale_min1(const uint8_t *s, int j, int *sc, int *m) {
    *sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
    *m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
}

/* Q4_K's and Q5_K's per sub-block scale d sc and min dmin m, as floats (d, dmin, then the 12 bytes). */
BK_INLINE void bk_k_scales(const uint8_t *b, float *dl, float *ml) {
    float d = bk_fp16(b), dmin = bk_fp16(b + 2);
    int sc[8], m[8];
    bk_k_scale_min(b + 4, sc, m);
    for (int i = 0; i < 8; i++) {
        dl[i] = d * (float)sc[i];
        ml[i] = dmin * (float)m[i];
    }
}

BK_INLINE void dq_q4_k(const uint8_t *b, float *y) {
    float dl[8], ml[8];
    bk_k_scales(b, dl, ml);
    for (int c = 0; c < 4; c++) /* bytes 32 c.. hold sub-blocks 2 c (low nibbles), 2 c + 1 (high) */
        for (int h = 0; h < 32; h += 16) {
            bk_u8x16 q = bk_load_u8x16(b + 16 + 32 * c + h);
            bk_store16(y + 64 * c + h, dl[2 * c] * bk_u8_to_f32(q & 15) - ml[2 * c]);
            bk_store16(y + 64 * c + 32 + h, dl[2 * c + 1] * bk_u8_to_f32(q >> 4) - ml[2 * c + 1]);
        }
}

BK_INLINE void dq_q5_k(const uint8_t *b, float *y) {
    float dl[8], ml[8];
    bk_k_scales(b, dl, ml);
    for (int c = 0; c < 4; c++) /* as Q4_K; the fifth bits: bits 2 c, 2 c + 1 of qh */
        for (int h = 0; h < 32; h += 16) {
            bk_u8x16 q = bk_load_u8x16(b + 48 + 32 * c + h), hb = bk_load_u8x16(b + 16 + h) >> (2 * c);
            bk_u8x16 lo = (q & 15) | (hb & 1) << 4, hi = (q >> 4) | (hb & 2) << 3;
            bk_store16(y + 64 * c + h, dl[2 * c] * bk_u8_to_f32(lo) - ml[2 * c]);
            bk_store16(y + 64 * c + 32 + h, dl[2 * c + 1] * bk_u8_to_f32(hi) - ml[2 * c + 1]);
        }
}

BK_INLINE void dq_q6_k(const uint8_t *b, float *y) {
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = bk_fp16(b + 208);
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 32; p += 16) { /* weights 128 h + 32 t + p.., sub-block 8 h + 2 t + p / 16 */
            bk_u8x16 l0 = bk_load_u8x16(b + 64 * h + p), l1 = bk_load_u8x16(b + 64 * h + 32 + p);
            bk_u8x16 qh = bk_load_u8x16(b + 128 + 32 * h + p);
            bk_u8x16 q[4] = {(l0 & 15) | (qh & 3) << 4, (l1 & 15) | (qh >> 2 & 3) << 4,
                             (l0 >> 4) | (qh >> 4 & 3) << 4, (l1 >> 4) | (qh >> 6) << 4};
            for (int t = 0; t < 4; t++) {
                float a = d * (float)sc[8 * h + 2 * t + p / 16];
                bk_store16(y + 128 * h + 32 * t + p, a * (bk_u8_to_f32(q[t]) - 32.f));
            }
        }
}

#endif
