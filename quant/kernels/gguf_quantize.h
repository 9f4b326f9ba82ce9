/* Writing GGUF blocks from float32 rows: llama.cpp's round-to-nearest quantization without an importance
 * matrix (what `llama-quantize` writes then), re-derived from the formats (gguf_types.h, gguf_kquants.h)
 * and the search each type's reference rounding makes. One function per type, a row of k weights (k a
 * multiple of the block) into its blocks; rows are independent, so any split across threads gives the
 * same bytes.
 *
 * The bytes must equal llama.cpp's, so every float operation is the one the reference makes, in its
 * order: no fused multiply-adds (contraction off below), products and sums grouped as written, the
 * nearest integer by the 1.5 * 2^23 trick (ties to even, as the reference), fp16 by round-to-nearest-even.
 *
 *   K-quants with a min (Q2_K, Q4_K, Q5_K): per sub-block, the scale and min that minimise the weighted
 *   error over a few candidate grids (bkq_scale_min), then the sub-block scales and mins themselves
 *   quantized against the super-block's fp16 d and dmin, and every weight rounded again against those.
 *   Symmetric ones (Q3_K, Q6_K): a signed scale per sub-block chosen by least squares (bkq_signed_scale,
 *   bkq_q3_scale), quantized against d.
 */
#ifndef BRISK_GGUF_QUANTIZE_H
#define BRISK_GGUF_QUANTIZE_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gguf_types.h"

#if defined(__clang__)
#define BKQ_EXACT _Pragma("clang fp contract(off)")
#else
#define BKQ_EXACT
#if defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
#endif

#define BKQ_MIN(a, b) ((a) < (b) ? (a) : (b))
#define BKQ_MAX(a, b) ((a) > (b) ? (a) : (b))
#define BKQ_ZERO 1e-15f /* a sub-block whose largest magnitude is below this is all zeros */

/* Round to the nearest integer, ties to even (|v| < 2^22): adding 1.5 * 2^23 leaves it in the mantissa. */
static inline int bkq_round(float v) {
    BKQ_EXACT
    float s = v + 12582912.f;
    int32_t i;
    memcpy(&i, &s, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* float -> IEEE half, round to nearest even (overflow to infinity, subnormals kept) */
static inline void bkq_put_fp16(uint8_t *p, float f) {
    BKQ_EXACT
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    uint16_t h;
    if (ax >= 0x7f800000u) h = (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    else if (ax >= 0x477ff000u) h = (uint16_t)(sign | 0x7c00u); /* 65520 and up round past the largest half */
    else if (ax < 0x38800000u) { /* below 2^-14: a multiple of 2^-24, exact once scaled */
        float v;
        memcpy(&v, &ax, 4);
        h = (uint16_t)(sign | (uint32_t)bkq_round(v * 16777216.f));
    } else {
        ax += 0xfffu + ((ax >> 13) & 1u); /* ties to even */
        h = (uint16_t)(sign | ((ax - 0x38000000u) >> 13));
    }
    memcpy(p, &h, 2);
}

/* The stored half, read back as the dequantizer will read it */
static inline float bkq_fp16_back(const uint8_t *p) { return bk_fp16(p); }

/* -------------------------------------------------------------------- 32-weight blocks */

static void bkq_q8_0(const float *x, uint8_t *y, int64_t k) {
    BKQ_EXACT
    for (int64_t b = 0; b < k / 32; b++, x += 32, y += 34) {
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = BKQ_MAX(amax, fabsf(x[j]));
        float d = amax / 127, id = d ? 1.f / d : 0.f;
        bkq_put_fp16(y, d);
        for (int j = 0; j < 32; j++) y[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
    }
}

/* The signed value of largest magnitude (the first, on ties): symmetric 32-blocks put it at -2^(bits-1) */
static inline float bkq_extreme(const float *x, int n) {
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < n; j++)
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    return max;
}

static void bkq_q4_0(const float *x, uint8_t *y, int64_t k) {
    BKQ_EXACT
    for (int64_t b = 0; b < k / 32; b++, x += 32, y += 18) {
        float d = bkq_extreme(x, 32) / -8, id = d ? 1.f / d : 0.f;
        bkq_put_fp16(y, d);
        for (int j = 0; j < 16; j++) {
            uint8_t lo = (uint8_t)BKQ_MIN(15, (int8_t)(x[j] * id + 8.5f));
            uint8_t hi = (uint8_t)BKQ_MIN(15, (int8_t)(x[j + 16] * id + 8.5f));
            y[2 + j] = (uint8_t)(lo | hi << 4);
        }
    }
}

/* Q5_0 and Q5_1 share the layout of the codes: low nibbles in qs, each fifth bit in qh (bit j: weight j) */
static inline void bkq_put_5bit(uint8_t *qh_at, uint8_t *qs, const uint8_t *q) {
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        qs[j] = (uint8_t)((q[j] & 15) | (q[j + 16] & 15) << 4);
        qh |= (uint32_t)(q[j] >> 4 & 1) << j | (uint32_t)(q[j + 16] >> 4 & 1) << (j + 16);
    }
    memcpy(qh_at, &qh, 4);
}

static void bkq_q5_0(const float *x, uint8_t *y, int64_t k) {
    BKQ_EXACT
    for (int64_t b = 0; b < k / 32; b++, x += 32, y += 22) {
        float d = bkq_extreme(x, 32) / -16, id = d ? 1.f / d : 0.f;
        uint8_t q[32];
        bkq_put_fp16(y, d);
        for (int j = 0; j < 32; j++) q[j] = (uint8_t)BKQ_MIN(31, (int8_t)(x[j] * id + 16.5f));
        bkq_put_5bit(y + 2, y + 6, q);
    }
}

static void bkq_q5_1(const float *x, uint8_t *y, int64_t k) {
    BKQ_EXACT
    for (int64_t b = 0; b < k / 32; b++, x += 32, y += 24) {
        float min = FLT_MAX, max = -FLT_MAX;
        for (int j = 0; j < 32; j++) {
            if (x[j] < min) min = x[j];
            if (x[j] > max) max = x[j];
        }
        float d = (max - min) / 31, id = d ? 1.f / d : 0.f;
        uint8_t q[32];
        bkq_put_fp16(y, d);
        bkq_put_fp16(y + 2, min);
        for (int j = 0; j < 32; j++) q[j] = (uint8_t)((x[j] - min) * id + 0.5f);
        bkq_put_5bit(y + 4, y + 8, q);
    }
}

/* -------------------------------------------------------------------- K-quant searches */

/* An asymmetric sub-block of n weights on codes 0..nmax: w ~ scale q - min. Starts from the range, then
 * tries nstep + 1 wider and narrower grids (nmax + rmin + rdelta i steps over the range), each with the
 * weighted least-squares scale and min for its codes (min clamped to <= 0), keeping the one of least
 * weighted error (absolute with mad, squared otherwise). Returns the scale, *neg_min = -min (>= 0). */
static float bkq_scale_min(int n, int nmax, const float *x, const float *w, uint8_t *L, float *neg_min,
                           float rmin, float rdelta, int nstep, int mad) {
    BKQ_EXACT
    uint8_t Laux[32];
    float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; i++) L[i] = 0;
        *neg_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; i++) {
        int l = bkq_round(iscale * (x[i] - min));
        L[i] = (uint8_t)BKQ_MAX(0, BKQ_MIN(nmax, l));
        float e = scale * L[i] + min - x[i];
        best += w[i] * (mad ? fabsf(e) : e * e);
    }
    for (int s = 0; s <= nstep; s++) {
        iscale = (rmin + rdelta * s + nmax) / (max - min);
        float sl = 0, sl2 = 0, sxl = 0;
        for (int i = 0; i < n; i++) {
            int l = BKQ_MAX(0, BKQ_MIN(nmax, bkq_round(iscale * (x[i] - min))));
            Laux[i] = (uint8_t)l;
            sl += w[i] * l;
            sl2 += w[i] * l * l;
            sxl += w[i] * l * x[i];
        }
        float D = sum_w * sl2 - sl * sl;
        if (!(D > 0)) continue; /* NaN too */
        float ts = (sum_w * sxl - sum_x * sl) / D, tm = (sl2 * sum_x - sl * sxl) / D;
        if (tm > 0) {
            tm = 0;
            ts = sxl / sl2;
        }
        float err = 0;
        for (int i = 0; i < n; i++) {
            float e = ts * Laux[i] + tm - x[i];
            err += w[i] * (mad ? fabsf(e) : e * e);
        }
        if (err < best) {
            memcpy(L, Laux, (size_t)n);
            best = err;
            scale = ts;
            min = tm;
        }
    }
    *neg_min = -min;
    return scale;
}

/* A symmetric sub-block's first codes, on -nmax..nmax-1 through its value of largest magnitude (to -nmax),
 * with the x^2-weighted sums of the least-squares scale sumlx / suml2. Returns that value, 0 (codes all 0)
 * if the sub-block is all zeros. */
static float bkq_first_codes(int n, int nmax, const float *x, int8_t *L, float *sumlx, float *suml2) {
    BKQ_EXACT
    float amax = 0, max = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            max = x[i];
        }
    if (amax < BKQ_ZERO) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max, slx = 0, sl2 = 0;
    for (int i = 0; i < n; i++) {
        int l = BKQ_MAX(-nmax, BKQ_MIN(nmax - 1, bkq_round(iscale * x[i])));
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        slx += w * x[i] * l;
        sl2 += w * l * l;
    }
    *sumlx = slx;
    *suml2 = sl2;
    return max;
}

/* A symmetric sub-block on codes -nmax..nmax-1 weighted by x^2 (Q6_K): the grid through the extreme value,
 * then 18 nearby grids, keeping the least-squares scale of the best fit. L gets codes + nmax. */
static float bkq_signed_scale(int n, int nmax, const float *x, int8_t *L) {
    BKQ_EXACT
    float sumlx, suml2, max = bkq_first_codes(n, nmax, x, L, &sumlx, &suml2), iscale;
    if (max == 0.f) return 0.f;
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    float scale = suml2 ? sumlx / suml2 : 0.f, best = scale * sumlx;
    for (int s = -9; s <= 9; s++) {
        if (s == 0) continue;
        iscale = -(nmax + 0.1f * s) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = BKQ_MAX(-nmax, BKQ_MIN(nmax - 1, bkq_round(iscale * x[i])));
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) L[i] = (int8_t)(nmax + BKQ_MAX(-nmax, BKQ_MIN(nmax - 1, bkq_round(iscale * x[i]))));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q3_K's sub-block search: codes through the extreme value, then up to 5 passes moving single codes to the
 * value the others' least-squares scale asks for while the x^2-weighted fit improves. L gets codes + nmax. */
static float bkq_q3_scale(int n, int nmax, const float *x, int8_t *L) {
    BKQ_EXACT
    float sumlx, suml2;
    if (bkq_first_codes(n, nmax, x, L, &sumlx, &suml2) == 0.f) return 0.f;
    for (int pass = 0; pass < 5; pass++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            float w = x[i] * x[i], slx = sumlx - w * x[i] * L[i];
            if (!(slx > 0)) continue;
            float sl2 = suml2 - w * L[i] * L[i];
            int l = BKQ_MAX(-nmax, BKQ_MIN(nmax - 1, bkq_round(x[i] * sl2 / slx)));
            if (l == L[i]) continue;
            slx += w * x[i] * l;
            sl2 += w * l * l;
            if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                L[i] = (int8_t)l;
                sumlx = slx;
                suml2 = sl2;
                changed++;
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.f ? sumlx / suml2 : 0.f;
}

/* -------------------------------------------------------------------- K-quants (super-blocks of 256) */

/* 2 bits of each of 4 codes 32 apart into one byte (Q2_K's and Q3_K's qs: weights 128 h + 32 t + j) */
static inline void bkq_put_2bit(uint8_t *qs, const uint8_t *L) {
    for (int h = 0; h < 256; h += 128)
        for (int j = 0; j < 32; j++)
            qs[h / 4 + j] = (uint8_t)(L[h + j] | L[h + j + 32] << 2 | L[h + j + 64] << 4 | L[h + j + 96] << 6);
}

static void bkq_q2_k(const float *x, uint8_t *y, int64_t k) {
    BKQ_EXACT
    for (int64_t b = 0; b < k / 256; b++, x += 256, y += 84) {
        uint8_t L[256], *sc = y;
        float w[16], scales[16], mins[16], max_scale = 0, max_min = 0;
        for (int s = 0; s < 16; s++) {
            for (int i = 0; i < 16; i++) w[i] = fabsf(x[16 * s + i]);
            scales[s] = bkq_scale_min(16, 3, x + 16 * s, w, L + 16 * s, &mins[s], -0.5f, 0.1f, 15, 1);
            if (scales[s] > max_scale) max_scale = scales[s];
            if (mins[s] > max_min) max_min = mins[s];
        }
        if (max_scale > 0) {
            float is = 15.f / max_scale;
            for (int s = 0; s < 16; s++) sc[s] = (uint8_t)bkq_round(is * scales[s]);
            bkq_put_fp16(y + 80, max_scale / 15.f);
        } else {
            memset(sc, 0, 16);
            bkq_put_fp16(y + 80, 0.f);
        }
        if (max_min > 0) {
            float is = 15.f / max_min;
            for (int s = 0; s < 16; s++) sc[s] |= (uint8_t)(bkq_round(is * mins[s]) << 4);
            bkq_put_fp16(y + 82, max_min / 15.f);
        } else {
            bkq_put_fp16(y + 82, 0.f);
        }
        for (int s = 0; s < 16; s++) {
            float d = bkq_fp16_back(y + 80) * (sc[s] & 15);
            if (!d) continue; /* keeps the search's codes */
            float dm = bkq_fp16_back(y + 82) * (sc[s] >> 4);
            for (int i = 0; i < 16; i++)
                L[16 * s + i] = (uint8_t)BKQ_MAX(0, BKQ_MIN(3, bkq_round((x[16 * s + i] + dm) / d)));
        }
        bkq_put_2bit(y + 16, L);
    }
}

static void bkq_q3_k(const float *x, uint8_t *y, int64_t k) {
    BKQ_EXACT
    for (int64_t b = 0; b < k / 256; b++, x += 256, y += 110) {
        int8_t L[256];
        uint8_t *hmask = y, *qs = y + 32, *sc = y + 96;
        float scales[16];
        for (int s = 0; s < 16; s++) scales[s] = bkq_q3_scale(16, 4, x + 16 * s, L + 16 * s);
        float max_scale = bkq_extreme(scales, 16);
        memset(sc, 0, 12);
        if (max_scale) {
            float is = -32.f / max_scale;
            for (int s = 0; s < 16; s++) { /* 6 bits: low nibble in scales[s % 8], top 2 in scales[8 + s % 4] */
                int8_t l = (int8_t)bkq_round(is * scales[s]);
                l = (int8_t)(BKQ_MAX(-32, BKQ_MIN(31, l)) + 32);
                sc[s % 8] |= (uint8_t)((l & 15) << (s < 8 ? 0 : 4));
                sc[8 + s % 4] |= (uint8_t)((l >> 4) << (2 * (s / 4)));
            }
            bkq_put_fp16(y + 108, 1 / is);
        } else {
            bkq_put_fp16(y + 108, 0.f);
        }
        for (int s = 0; s < 16; s++) {
            int q = (s < 8 ? sc[s] & 15 : sc[s - 8] >> 4) | ((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4;
            float d = bkq_fp16_back(y + 108) * (int8_t)(q - 32);
            if (!d) continue;
            for (int i = 0; i < 16; i++)
                L[16 * s + i] = (int8_t)(BKQ_MAX(-4, BKQ_MIN(3, bkq_round(x[16 * s + i] / d))) + 4);
        }
        memset(hmask, 0, 32); /* the third bit of weight i: bit i / 32 of hmask[i % 32] */
        uint8_t low[256];
        for (int i = 0; i < 256; i++) {
            if (L[i] > 3) hmask[i % 32] |= (uint8_t)(1 << (i / 32));
            low[i] = (uint8_t)(L[i] > 3 ? L[i] - 4 : L[i]);
        }
        bkq_put_2bit(qs, low);
    }
}

/* Q4_K and Q5_K: 8 sub-blocks of 32, scale and min each, 6 bits against d and dmin; the codes then
 * rounded again against the stored values. nmax 15 or 31; L gets the codes. */
static void bkq_k32(const float *x, uint8_t *y, uint8_t *L, int nmax, float rmin, int nstep) {
    BKQ_EXACT
    float w[32], scales[8], mins[8], max_scale = 0, max_min = 0;
    uint8_t *sc = y + 4;
    for (int s = 0; s < 8; s++) {
        const float *xs = x + 32 * s;
        float sum_x2 = 0;
        for (int i = 0; i < 32; i++) sum_x2 += xs[i] * xs[i];
        float av_x = sqrtf(sum_x2 / 32);
        for (int i = 0; i < 32; i++) w[i] = av_x + fabsf(xs[i]);
        scales[s] = bkq_scale_min(32, nmax, xs, w, L + 32 * s, &mins[s], rmin, 0.1f, nstep, 0);
        if (scales[s] > max_scale) max_scale = scales[s];
        if (mins[s] > max_min) max_min = mins[s];
    }
    float is = max_scale > 0 ? 63.f / max_scale : 0.f, im = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t ls[8], lm[8];
    for (int s = 0; s < 8; s++) {
        ls[s] = BKQ_MIN(63, (uint8_t)bkq_round(is * scales[s]));
        lm[s] = BKQ_MIN(63, (uint8_t)bkq_round(im * mins[s]));
    }
    for (int s = 0; s < 4; s++) { /* gguf_kquants.h: 0..3 in the low 6 bits, 4..7 split into nibbles + top bits */
        sc[s] = (uint8_t)(ls[s] | (ls[s + 4] >> 4) << 6);
        sc[s + 4] = (uint8_t)(lm[s] | (lm[s + 4] >> 4) << 6);
        sc[s + 8] = (uint8_t)((ls[s + 4] & 15) | (lm[s + 4] & 15) << 4);
    }
    bkq_put_fp16(y, max_scale / 63.f);
    bkq_put_fp16(y + 2, max_min / 63.f);
    for (int s = 0; s < 8; s++) {
        float d = bkq_fp16_back(y) * ls[s];
        if (!d) continue;
        float dm = bkq_fp16_back(y + 2) * lm[s];
        for (int i = 0; i < 32; i++)
            L[32 * s + i] = (uint8_t)BKQ_MAX(0, BKQ_MIN(nmax, bkq_round((x[32 * s + i] + dm) / d)));
    }
}

/* 4 low bits: weight 64 c + 32 n + j in nibble n of qs[32 c + j] */
static inline void bkq_put_nibbles(uint8_t *qs, const uint8_t *L) {
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 32; j++) qs[32 * c + j] = (uint8_t)((L[64 * c + j] & 15) | (L[64 * c + j + 32] & 15) << 4);
}

static void bkq_q4_k(const float *x, uint8_t *y, int64_t k) {
    for (int64_t b = 0; b < k / 256; b++, x += 256, y += 144) {
        uint8_t L[256];
        bkq_k32(x, y, L, 15, -1.f, 20);
        bkq_put_nibbles(y + 16, L);
    }
}

static void bkq_q5_k(const float *x, uint8_t *y, int64_t k) {
    for (int64_t b = 0; b < k / 256; b++, x += 256, y += 176) {
        uint8_t L[256], *qh = y + 16;
        bkq_k32(x, y, L, 31, -0.5f, 15);
        memset(qh, 0, 32); /* the fifth bit of weight i: bit i / 32 of qh[i % 32] */
        for (int i = 0; i < 256; i++) qh[i % 32] |= (uint8_t)((L[i] >> 4) << (i / 32));
        bkq_put_nibbles(y + 48, L);
    }
}

static void bkq_q6_k(const float *x, uint8_t *y, int64_t k) {
    BKQ_EXACT
    for (int64_t b = 0; b < k / 256; b++, x += 256, y += 210) {
        int8_t L[256], *sc = (int8_t *)(y + 192);
        float scales[16];
        for (int s = 0; s < 16; s++) scales[s] = bkq_signed_scale(16, 32, x + 16 * s, L + 16 * s);
        float max_scale = bkq_extreme(scales, 16);
        if (fabsf(max_scale) < BKQ_ZERO) {
            memset(y, 0, 210);
            continue;
        }
        float is = -128.f / max_scale;
        bkq_put_fp16(y + 208, 1 / is);
        for (int s = 0; s < 16; s++) sc[s] = (int8_t)BKQ_MIN(127, bkq_round(is * scales[s]));
        for (int s = 0; s < 16; s++) {
            float d = bkq_fp16_back(y + 208) * sc[s];
            if (!d) continue;
            for (int i = 0; i < 16; i++)
                L[16 * s + i] = (int8_t)(BKQ_MAX(-32, BKQ_MIN(31, bkq_round(x[16 * s + i] / d))) + 32);
        }
        uint8_t *ql = y, *qh = y + 128; /* gguf_kquants.h: weight 128 h + 32 t + j */
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 32; j++) {
                const int8_t *q = L + 128 * h + j;
                ql[64 * h + j] = (uint8_t)((q[0] & 15) | (q[64] & 15) << 4);
                ql[64 * h + j + 32] = (uint8_t)((q[32] & 15) | (q[96] & 15) << 4);
                qh[32 * h + j] = (uint8_t)(q[0] >> 4 | (q[32] >> 4) << 2 | (q[64] >> 4) << 4 | (q[96] >> 4) << 6);
            }
    }
}

/* The quantizer of a GGUF type id, NULL for a type brisk does not write (gguf_types.py's `writes`) */
typedef void (*bkq_fn)(const float *, uint8_t *, int64_t);
static inline bkq_fn bkq_for(int type) {
    switch (type) {
    case BK_Q4_0: return bkq_q4_0;
    case BK_Q5_0: return bkq_q5_0;
    case BK_Q5_1: return bkq_q5_1;
    case BK_Q8_0: return bkq_q8_0;
    case BK_Q2_K: return bkq_q2_k;
    case BK_Q3_K: return bkq_q3_k;
    case BK_Q4_K: return bkq_q4_k;
    case BK_Q5_K: return bkq_q5_k;
    case BK_Q6_K: return bkq_q6_k;
    default: return 0;
    }
}

#if !defined(__clang__) && defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif
