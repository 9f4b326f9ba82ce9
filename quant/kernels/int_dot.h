/* Products with the activations as 16-bit integers, for the types whose blocks are small integer
 * codes with scales (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, brisk's int8 rows; Q4_K, Q5_K, Q6_K): the codes times
 * the activations' codes summed exactly in int32 (one multiply-add instruction per 32 pairs), then
 * scaled in float. About half the instructions of dequantizing to float32 first.
 *
 * Each activation row is quantized per block of 32 (per super-block of 256 for the K-quants): x = s q,
 * |q| <= 32767, s = max|x| / 32767. The rounding moves x by at most 2^-16 of its block's largest
 * value, hundreds of times finer than the 8-bit activations llama.cpp uses (which cost a 135M model
 * KL 0.02 to its float self and flipped a greedy answer). Rows are quantized on their own, so a
 * row's result still does not depend on its batch. Included by tiles.c (one copy per instruction set). */
#ifndef BRISK_INT_DOT_H
#define BRISK_INT_DOT_H

#include <math.h>

#include "bk_vec.h"
#include "bk_weight.h"
#include "gguf_kquants.h"
#include "gguf_types.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32 /* weights per block, activations per scale */

typedef int16_t i16x32 __attribute__((vector_size(64)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x32 __attribute__((vector_size(64)));
typedef int8_t i8x32 __attribute__((vector_size(32)));

/* The quantized activations, on two grids: per block of 32, codes [M, K], scale s and s * sum(codes)
 * [M, K / 32] (the 32-weight block types); per super-block of 256 (Q4_K, Q5_K, Q6_K), codes q256 [M, K],
 * scale s256 [M, K / 256] and, per super-block, 32 floats: s256 times its 8 sub-blocks' code sums,
 * even sub-blocks then odd ones, each repeated in kquant_tile's folded lane order. */
typedef struct {
    const int16_t *q;
    const float *s, *sum;
    const int16_t *q256;
    const float *s256, *bs256;
    /* the 8-bit activations of the K-quants (int8_dot.h), where those are on: per row and super-block
     * of 256, codes in order (q8) and in Q4_K/Q5_K's sub-block order 0 2 1 3 4 6 5 7 (q8p), a scale
     * (s8), Q6_K's 16 sums of 16 codes (xs8) and, for Q4_K/Q5_K's minimums, 8 zeros then the 8 sums
     * of 32 codes (xm8) */
    const int8_t *q8, *q8p;
    const float *s8;
    const int16_t *xs8, *xm8;
} bk_xq;

BK_INLINE int bk_int_type(int type) { return bk_type_has(type, BK_INT) || type == BK_I8R; }

/* whether this weight's products take the integer path: its type's, or int4 groups whose groups are
 * whole blocks of 32 (GPTQ/AWQ's 32, 64, 128) */
BK_INLINE int bk_int_weight(const bk_weight *w) {
    return bk_int_type(w->type) || (w->type == BK_I4G && w->group % QK == 0);
}

/* the types on the 256-grid */
BK_INLINE int bk_super_type(int type) { return bk_type_has(type, BK_SUPER); }

/* the types with a per-block minimum (weight = d code + m) */
#define HAS_MIN(type) (bk_type_has(type, BK_MIN) || (type) == BK_I4G)

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

/* acc + madd(a, b): one instruction with AVX-512 VNNI (vpdpwssd; int32 sums wrap as the add does, so
 * the bits are the same either way) */
BK_INLINE vi16 madd_add(vi16 acc, i16x32 a, i16x32 b) {
#if defined(__AVX512VNNI__)
    return (vi16)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#else
    return acc + madd(a, b);
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

/* 16 bytes of 4-bit codes as 32 int16 in column order: byte i holds columns 2i (low) and 2i + 1 (high) */
BK_INLINE i16x32 nibble_pairs(const uint8_t *p) {
    i16x16 c = __builtin_convertvector(bk_load_u8x16(p), i16x16);
    return __builtin_shufflevector(c & 15, c >> 4, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25,
                                   10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}

BK_INLINE float bk_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
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

/* Codes 0..15 plus 16 in the lanes whose bit of mask is set (Q5_0/Q5_1's fifth bits, lane l: bit l). */
BK_INLINE i16x32 fifth_bits(i16x32 q, uint32_t mask) {
#if defined(__AVX512BW__)
    return (i16x32)_mm512_mask_add_epi16((__m512i)q, _cvtu32_mask32(mask), (__m512i)q, _mm512_set1_epi16(16));
#else
    /* a test against one bit per lane, not a shift by a lane's count: AVX2 has no 16-bit variable
     * shift (that form ran Q5_0 at half the AVX-512 copy's speed) */
    uint16_t lo = (uint16_t)mask, hi = (uint16_t)(mask >> 16);
    const u16x32 bit = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                        1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
    u16x32 h = {lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo, lo,
                hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi, hi};
    return q | ((i16x32)((h & bit) != 0) & 16);
#endif
}

/* MXFP4's 16 code bytes as their 32 kvalues (-12..12): looked up on the bytes, then widened */
BK_INLINE i16x32 mxfp4_codes(const uint8_t *p) {
#if defined(__AVX2__)
    /* low nibbles in the low 16 bytes, high ones in the high 16: one 32-byte lookup */
    __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    __m256i n = _mm256_and_si256(_mm256_blend_epi32(c, _mm256_srli_epi16(c, 4), 0xF0), _mm256_set1_epi8(15));
    __m256i k = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256((__m128i)bk_mxfp4_kvalues()), n);
#if defined(__AVX512BW__)
    return (i16x32)_mm512_cvtepi8_epi16(k);
#else
    __m256i h[2] = {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(k)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(k, 1))};
    i16x32 q;
    memcpy(&q, h, 64);
    return q;
#endif
#else
    bk_u8x16 c = bk_load_u8x16(p); /* offset by 12: GCC widens unsigned bytes well, signed ones poorly */
    i16x16 lo = __builtin_convertvector(bk_mxfp4_k(c & 15) + 12, i16x16), hi = __builtin_convertvector(bk_mxfp4_k(c >> 4) + 12, i16x16);
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,
                                   25, 26, 27, 28, 29, 30, 31) - 12;
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
    if (type == BK_Q5_0 || type == BK_Q5_1) { /* Q4_0's / Q4_1's nibbles plus a fifth bit per weight (bit j of qh) */
        const int one = type == BK_Q5_1; /* Q5_1: d, m, qh, codes; codes 0..31, no offset */
        p += b * bk_block_bytes(type);
        uint32_t qh;
        memcpy(&qh, p + (one ? 4 : 2), 4);
        *d = bk_fp16(p);
        *m = one ? bk_fp16(p + 2) : 0.0f;
        i16x32 q = nibbles(p + (one ? 8 : 6));
#if defined(__AVX512BW__) /* Q5_0: qh as a lane mask, q - 16 where the bit is clear (one instruction) */
        if (!one)
            return (i16x32)_mm512_mask_sub_epi16((__m512i)q, _cvtu32_mask32(~qh), (__m512i)q, _mm512_set1_epi16(16));
#endif
        q = fifth_bits(q, qh);
        return one ? q : q - 16;
    }
    if (type == BK_MXFP4) { /* weight = kvalue 2^(e - 128): exact products, as Q4_0's */
        p += b * 17;
        *d = bk_e8m0_half(p[0]);
        *m = 0.0f;
        return mxfp4_codes(p + 1);
    }
    if (type == BK_I4G) { /* weight = (code - 8) s + z = s code + (z - 8 s), s and z per group */
        int g = b * QK / w->group, groups = w->K / w->group;
        float sc = bk_bf16(w->scales[(int64_t)n * groups + g]);
        *d = sc;
        *m = bk_bf16(w->zeros[(int64_t)n * groups + g]) - 8.0f * sc;
        return nibble_pairs(p + b * (QK / 2));
    }
    /* Q4_0 / Q4_1: code byte j holds weight j (low nibble) and j + 16 (high) */
    p += b * bk_block_bytes(type);
    i16x32 q = nibbles(p + (HAS_MIN(type) ? 4 : 2)); /* after d (and m) */
    *d = bk_fp16(p);
    if (type == BK_Q4_0) {
        *m = 0.0f;
        return q - 8;
    }
    *m = bk_fp16(p + 2);
    return q;
}

/* Four rows' 16-lane sums folded to 4 lanes each, side by side: in int32 (exact), or in float for
 * sums whose int32 fold could overflow. */
#define DEFINE_FOLD4(name, T)                                                                                  \
    BK_INLINE T name(T a, T b, T c, T d) {                                                                     \
        T ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +        \
               __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);   \
        T cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +        \
               __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);   \
        return __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +    \
               __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);   \
    }
DEFINE_FOLD4(fold4, vi16)
DEFINE_FOLD4(fold4f, v16)
#undef DEFINE_FOLD4

BK_INLINE i16x32 two_scales(const int8_t *sc) {
    int16_t a = sc[0], b = sc[1];
    return (i16x32){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b, b, b, b, b, b, b, b, b};
}

/* The K-quants with integer codes (Q4_K, Q5_K, Q6_K) take their activations per super-block of 256
 * (the second grid): one float scale per 256 inputs, so a row's products over a whole super-block
 * sum exactly in int32 with the sub-block scales multiplied into the codes first (Q4_K: 6-bit scale
 * x 4-bit code <= 945; Q5_K: x 5-bit code <= 1953; Q6_K: int8 scale x (code - 32) <= 4096, all
 * exact in int16), and the float work (fold, convert, scale) is once per 256 weights instead of
 * once per 32. Int32 bounds per lane of 16 products with |x code| <= 32767: Q4_K 4.95e8, folded 4
 * lanes together 1.98e9 < 2^31; Q5_K 1.02e9 and Q6_K 2147418112 < 2^31 - 1, converted to float
 * before folding. */

BK_INLINE i16x32 splat_i16(int v) { return (i16x32){0} + (int16_t)v; }

/* Q4_K's 6-bit scales and minimums of one super-block, unpacked in one vector: lanes 0..7 the
 * sub-blocks' scales, 8..15 their minimums (bk_k_scale_min's values). */
BK_INLINE bk_u8x16 q4k_six(const uint8_t *blk) {
    bk_u8x16 v = bk_load_u8x16(blk + 4); /* the 12 scale bytes s0..s11 (and 4 code bytes, unused) */
    bk_u8x16 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    bk_u8x16 hi = __builtin_shufflevector(v, v, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7);
    const bk_u8x16 shift = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4};
    const bk_u8x16 low = {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15};
    const bk_u8x16 top = {0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48};
    return ((lo >> shift) & low) | (((hi >> 6) << 4) & top);
}

/* Sub-blocks 2c (low nibbles) and 2c + 1 (high) of a Q4_K super-block: 32 codes each times its scale */
BK_INLINE void q4k_pair(const uint8_t *blk, const uint8_t *sc, int c, i16x32 *lo, i16x32 *hi) {
    i16x32 raw = bytes_i16(blk + 16 + 32 * c);
    *lo = (raw & 15) * splat_i16(sc[2 * c]);
    *hi = (raw >> 4) * splat_i16(sc[2 * c + 1]);
}

/* The same for Q5_K: the fifth bits of sub-blocks 2c and 2c + 1 are bits 2c and 2c + 1 of qh's bytes */
BK_INLINE void q5k_pair(const uint8_t *blk, const uint8_t *sc, int c, i16x32 *lo, i16x32 *hi) {
    i16x32 raw = bytes_i16(blk + 48 + 32 * c), hb = bytes_i16(blk + 16) >> (2 * c);
    *lo = ((raw & 15) | ((hb & 1) << 4)) * splat_i16(sc[2 * c]);
    *hi = ((raw >> 4) | ((hb & 2) << 3)) * splat_i16(sc[2 * c + 1]);
}

/* Half h (sub-blocks 4h..4h+3) of a Q6_K super-block: 32 (code - 32) each times their int8 scales */
BK_INLINE void q6k_half(const uint8_t *blk, int h, i16x32 *W) {
    const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
    const int8_t *sc = (const int8_t *)(blk + 192 + 8 * h);
    i16x32 a = bytes_i16(ql), b = bytes_i16(ql + 32), hb = bytes_i16(qh);
    W[0] = (((a & 15) | ((hb & 3) << 4)) - 32) * two_scales(sc);
    W[1] = (((b & 15) | (((hb >> 2) & 3) << 4)) - 32) * two_scales(sc + 2);
    W[2] = (((a >> 4) | (((hb >> 4) & 3) << 4)) - 32) * two_scales(sc + 4);
    W[3] = (((b >> 4) | (((hb >> 6) & 3) << 4)) - 32) * two_scales(sc + 6);
}

/* Q4_K or Q6_K rows n..n+R-1 (R <= TILE) times M activation rows on the 256-grid: per super-block
 * each activation row's 4 row sums run in int32 over the whole super-block, are folded to 4 lanes a
 * row and scaled once in float; Q4_K's minimum term is its m_j times the activations' per-32 sums,
 * laid out in the folded lanes. For one activation row the codes are unpacked as they are used;
 * for several, once per super-block into W (the same integers, so the same bits whatever M is). */
BK_INLINE void kquant_tile(const bk_weight *w, int type, int n, int R, int M, const bk_xq *x, v16 *acc) {
    int K = w->K, ns = K / 256, bb = bk_block_bytes(type), mins = type != BK_Q6_K;
    for (int sb = 0; sb < ns; sb++) {
        const uint8_t *blk[TILE];
        bk_u8x16 six[TILE]; /* Q4_K, Q5_K: six-bit scales, then minimums */
        float dr[TILE], dm[TILE];
        for (int r = 0; r < TILE; r++) {
            blk[r] = w->data + (int64_t)(n + (r < R ? r : 0)) * w->row_bytes + sb * bb;
            dr[r] = r < R ? bk_fp16(blk[r] + (mins ? 0 : 208)) : 0.0f;
            if (mins) {
                six[r] = q4k_six(blk[r]);
                dm[r] = r < R ? -bk_fp16(blk[r] + 2) : 0.0f;
            }
        }
        v16 d = {dr[0], dr[0], dr[0], dr[0], dr[1], dr[1], dr[1], dr[1],
                 dr[2], dr[2], dr[2], dr[2], dr[3], dr[3], dr[3], dr[3]};
        v16 m0 = {0}, m1 = {0}; /* lane 4 r + k: -dmin m_{2k} and -dmin m_{2k+1} of row r */
        if (mins) {
            v16 dmv = {dm[0], dm[0], dm[0], dm[0], dm[1], dm[1], dm[1], dm[1],
                       dm[2], dm[2], dm[2], dm[2], dm[3], dm[3], dm[3], dm[3]};
            /* the minimums (lanes 8..15 of each row's six-bit vector): even ones, then odd ones, 4 per row */
            bk_u8x16 t01 = __builtin_shufflevector(six[0], six[1], 8, 10, 12, 14, 24, 26, 28, 30, 9, 11, 13, 15, 25, 27, 29, 31);
            bk_u8x16 t23 = __builtin_shufflevector(six[2], six[3], 8, 10, 12, 14, 24, 26, 28, 30, 9, 11, 13, 15, 25, 27, 29, 31);
            bk_u8x16 e = __builtin_shufflevector(t01, t23, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
            bk_u8x16 o = __builtin_shufflevector(t01, t23, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
            m0 = bk_u8_to_f32(e) * dmv;
            m1 = bk_u8_to_f32(o) * dmv;
        }
        i16x32 W[TILE][8];
        if (M > 1)
            for (int r = 0; r < TILE; r++)
                for (int c = 0; c < 4; c++) {
                    if (type == BK_Q4_K) q4k_pair(blk[r], (const uint8_t *)&six[r], c, &W[r][2 * c], &W[r][2 * c + 1]);
                    else if (type == BK_Q5_K) q5k_pair(blk[r], (const uint8_t *)&six[r], c, &W[r][2 * c], &W[r][2 * c + 1]);
                    else if (c < 2) q6k_half(blk[r], c, &W[r][4 * c]);
                }
        for (int mi = 0; mi < M; mi++) {
            const int16_t *xq = x->q256 + (int64_t)mi * K + sb * 256;
            vi16 a[TILE] = {{0}};
            if (M == 1) {
                for (int c = 0; c < 4; c++) {
                    if (mins) {
                        i16x32 x0 = load_i16x32(xq + 64 * c), x1 = load_i16x32(xq + 64 * c + 32);
                        for (int r = 0; r < TILE; r++) {
                            i16x32 lo, hi;
                            if (type == BK_Q4_K) q4k_pair(blk[r], (const uint8_t *)&six[r], c, &lo, &hi);
                            else q5k_pair(blk[r], (const uint8_t *)&six[r], c, &lo, &hi);
                            a[r] = madd_add(madd_add(a[r], lo, x0), hi, x1);
                        }
                    } else if (c < 2) {
                        for (int r = 0; r < TILE; r++) {
                            i16x32 Wh[4];
                            q6k_half(blk[r], c, Wh);
                            for (int j = 0; j < 4; j++) a[r] = madd_add(a[r], Wh[j], load_i16x32(xq + 128 * c + 32 * j));
                        }
                    }
                }
            } else {
                for (int j = 0; j < 8; j++) {
                    i16x32 xv = load_i16x32(xq + 32 * j);
                    for (int r = 0; r < TILE; r++) a[r] = madd_add(a[r], W[r][j], xv);
                }
            }
            int64_t at = (int64_t)mi * ns + sb;
            v16 sums = type == BK_Q4_K ? __builtin_convertvector(fold4(a[0], a[1], a[2], a[3]), v16)
                                       : fold4f(__builtin_convertvector(a[0], v16), __builtin_convertvector(a[1], v16),
                                                __builtin_convertvector(a[2], v16), __builtin_convertvector(a[3], v16));
            v16 t = fma16(sums, d * x->s256[at], acc[mi]);
            if (mins) t = fma16(m1, load16(x->bs256 + 32 * at + 16), fma16(m0, load16(x->bs256 + 32 * at), t));
            acc[mi] = t;
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
        if (bk_super_type(type)) kquant_tile(w, type, n, R, M, x, acc);
        else
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
                v16 a = fma16(__builtin_convertvector(sums, v16), d * x->s[(int64_t)mi * nb + b], acc[mi]);
                if (HAS_MIN(type)) a = fma16(m, splat16(x->sum[(int64_t)mi * nb + b]), a);
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

/* x [M, K] -> the 256-grid (K a multiple of 256): codes, a scale and the sub-block sums' layout. */
BK_INLINE void quantize_x256(const float *x, int M, int K, int16_t *q, float *s, float *bs) {
    const float magic = 12582912.0f;
    for (int64_t b = 0; b < (int64_t)M * (K / 256); b++) {
        const float *xb = x + b * 256;
        float amax = 0.0f;
        for (int k = 0; k < 256; k++) amax = fabsf(xb[k]) > amax ? fabsf(xb[k]) : amax;
        float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int total[8] = {0};
        for (int k = 0; k < 256; k++) {
            int v = (int)((xb[k] * inv + magic) - magic);
            q[b * 256 + k] = (int16_t)v;
            total[k / 32] += v;
        }
        s[b] = amax / 32767.0f;
        for (int l = 0; l < 16; l++) {
            bs[b * 32 + l] = s[b] * (float)total[2 * (l % 4)];
            bs[b * 32 + 16 + l] = s[b] * (float)total[2 * (l % 4) + 1];
        }
    }
}

#endif
