/* Products of the K-quants (Q2_K..Q6_K) with 8-bit activations, as llama.cpp takes them.
 *
 * Why beside int_dot.h's 16-bit path: with 16-bit activations a Q4_K model decoded far slower than
 * llama.cpp: widening every 4-bit code to 16 bits and multiplying it by its sub-block scale costs
 * more instructions than the bytes take to arrive. With
 * the activations as int8, the codes stay bytes: one multiply-add of unsigned codes by signed
 * activations (pairs summed to int16, maddubs), one multiply-add of those by the sub-block scales
 * (to int32, madd), 64 weights per instruction. The price is the activations' rounding: one scale
 * per 256 inputs, |q| <= 127 (llama.cpp's Q8_K grid); measured on Gemma 3 270M Q4_K_M as KL ~0.005
 * to the same file widened (bench/kept_kl.py). BRISK_ACT8=0 (native.set_act8) keeps the 16-bit path
 * (Q2_K, Q3_K: float32 tiles, tiles.c; they have no 16-bit one).
 *
 * The integers are exact and the float epilogue is written once (kq8_accumulate), so a row's result
 * is the same bits whether it is computed alone or among other activation rows. Included by tiles.c
 * after int_dot.h (one copy per instruction set). */
#ifndef BRISK_INT8_DOT_H
#define BRISK_INT8_DOT_H

#include "int_dot.h"

typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef int8_t i8x64 __attribute__((vector_size(64)));
typedef uint16_t u16x32v __attribute__((vector_size(64)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));

/* 32 bytes of a then 32 of b */
BK_INLINE u8x64 halves_u8(unsigned a, unsigned b) {
    u8x32 x = (u8x32){0} + (uint8_t)a, y = (u8x32){0} + (uint8_t)b;
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,
                                   24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46,
                                   47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63);
}

/* the types that take 8-bit activations when they are on */
BK_INLINE int bk_act8_type(int type) { return bk_type_has(type, BK_ACT8); }

BK_INLINE u8x64 load_u8x64(const uint8_t *p) {
    u8x64 v;
    memcpy(&v, p, 64);
    return v;
}

/* 32 bytes twice: [p[0..31] | p[0..31]] */
BK_INLINE u8x64 twice_u8x32(const uint8_t *p) {
    u8x32 h;
    memcpy(&h, p, 32);
    return __builtin_shufflevector(h, h, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                   22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                   14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

/* bytes shifted right by 4, as 16-bit lanes (x86 has no byte shift), high nibbles only */
BK_INLINE u8x64 high_nibbles(u8x64 v) { return (u8x64)(((u16x32v)v >> 4) & 0x0F0F); }

/* lane i = a[2i] b[2i] + a[2i+1] b[2i+1], a unsigned, b signed bytes; exact for the codes here
 * (|sum| <= 2 x 63 x 128 < 2^15, never the instruction's saturation) */
BK_INLINE i16x32 maddubs(u8x64 a, i8x64 b) {
#if defined(__AVX512BW__)
    return (i16x32)_mm512_maddubs_epi16((__m512i)a, (__m512i)b);
#elif defined(__AVX2__)
    __m256i a2[2], b2[2], r[2];
    memcpy(a2, &a, 64);
    memcpy(b2, &b, 64);
    r[0] = _mm256_maddubs_epi16(a2[0], b2[0]);
    r[1] = _mm256_maddubs_epi16(a2[1], b2[1]);
    i16x32 out;
    memcpy(&out, r, 64);
    return out;
#else
    i16x32 ae = __builtin_convertvector(__builtin_shufflevector(a, a, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62), i16x32);
    i16x32 ao = __builtin_convertvector(__builtin_shufflevector(a, a, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63), i16x32);
    i16x32 be = __builtin_convertvector(__builtin_shufflevector(b, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62), i16x32);
    i16x32 bo = __builtin_convertvector(__builtin_shufflevector(b, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63), i16x32);
    return ae * be + ao * bo;
#endif
}

/* 16 int16 then 16 zeros: a madd over them sums only the first 16 lanes' pairs */
BK_INLINE i16x32 zext_i16(i16x16 v) {
    return __builtin_shufflevector(v, (i16x16){0}, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 16, 16, 16, 16,
                                   16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16);
}

BK_INLINE i8x64 load_i8x64(const int8_t *p) {
    i8x64 v;
    memcpy(&v, p, 64);
    return v;
}

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 3072 /* how far ahead of the super-block being read its row's stream is fetched */
#endif

/* One super-block of one weight row, ready for the multiply-adds: four vectors of 64 codes (unsigned
 * bytes) and, per vector, its sub-blocks' scales as int16 lanes (one per code pair). Q4_K/Q5_K:
 * vector v holds sub-blocks (2v', 2v'+2) or (2v'+1, 2v'+3) (the layout of their code bytes), and the
 * activations are stored in that order (quantize_x8's permuted copy); Q2_K, Q3_K, Q6_K: weights
 * 64v..64v+63 in order, with the code offset (Q3_K 4, Q6_K 32) taken off after (the bias term). */
typedef struct {
    u8x64 c[4];
    i16x32 s[4];
} kq8_block;

/* Q6_K's int16 scale lanes, one shuffle each: [sc[a] x 8 | sc[b] x 8 | sc[c] x 8 | sc[d] x 8] */
#define R8(i) i, i, i, i, i, i, i, i
#define QUARTERS(sc, a, b, c, d) __builtin_shufflevector(sc, sc, R8(a), R8(b), R8(c), R8(d))

/* Q4_K/Q5_K: [sc_a x 16 | sc_b x 16] as int16 straight from the six-bit bytes (one byte shuffle
 * within 128-bit lanes, cheaper than a cross-lane word permute) */
BK_INLINE i16x32 six_halves(bk_u8x16 six, i16x16 sc, int a, int b) {
#if defined(__AVX512BW__)
    __m512i src = _mm512_broadcast_i32x4((__m128i)six);
    char A = (char)a, B = (char)b, Z = (char)0x80;
    __m512i ctl = _mm512_set_epi8(Z, B, Z, B, Z, B, Z, B, Z, B, Z, B, Z, B, Z, B, Z, B, Z, B, Z, B, Z, B, Z, B, Z, B, Z, B, Z, B,
                                  Z, A, Z, A, Z, A, Z, A, Z, A, Z, A, Z, A, Z, A, Z, A, Z, A, Z, A, Z, A, Z, A, Z, A, Z, A, Z, A);
    (void)sc;
    return (i16x32)_mm512_shuffle_epi8(src, ctl);
#else
    (void)six;
    i16x32 v = {0};
    for (int i = 0; i < 16; i++) v[i] = sc[a], v[16 + i] = sc[b];
    return v;
#endif
}

/* [a | b] */
BK_INLINE u8x64 cat_u8x32(u8x32 a, u8x32 b) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,
                                   24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46,
                                   47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63);
}

BK_INLINE void kq8_unpack(const uint8_t *blk, int type, i16x16 sc, bk_u8x16 six, kq8_block *o) {
    if (type == BK_Q3_K || type == BK_Q2_K) { /* weights 128h + 32t + j: bits 2t of qs[32h + j]; Q3_K's bit 4h + t
                                                 of hmask[j] on top (as q + 4) */
        typedef uint16_t u16x16v __attribute__((vector_size(32)));
        u8x32 hm = {0}, v[4];
        if (type == BK_Q3_K) memcpy(&hm, blk, 32);
        for (int h = 0; h < 2; h++) {
            u8x32 q;
            memcpy(&q, blk + (type == BK_Q3_K ? 32 : 16) + 32 * h, 32);
            for (int t = 0; t < 4; t++) {
                v[t] = (u8x32)(((u16x16v)q >> (2 * t)) & 0x0303);
                if (type == BK_Q3_K) v[t] |= (u8x32)((hm & (uint8_t)(1u << (4 * h + t))) != 0) & 4;
            }
            o->c[2 * h] = cat_u8x32(v[0], v[1]), o->c[2 * h + 1] = cat_u8x32(v[2], v[3]);
            o->s[2 * h] = h ? QUARTERS(sc, 8, 9, 10, 11) : QUARTERS(sc, 0, 1, 2, 3);
            o->s[2 * h + 1] = h ? QUARTERS(sc, 12, 13, 14, 15) : QUARTERS(sc, 4, 5, 6, 7);
        }
        return;
    }
    if (type == BK_Q6_K) {
        for (int h = 0; h < 2; h++) {
            u8x64 a = load_u8x64(blk + 64 * h);
            u8x32 q;
            memcpy(&q, blk + 128 + 32 * h, 32);
            typedef uint16_t u16x16v __attribute__((vector_size(32)));
            u8x32 b0 = (u8x32)(((u16x16v)q << 4) & 0x3030), b1 = (u8x32)(((u16x16v)q << 2) & 0x3030);
            u8x32 b2 = q & 0x30, b3 = (u8x32)(((u16x16v)q >> 2) & 0x3030);
            u8x64 lo = __builtin_shufflevector(b0, b1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63);
            u8x64 hi = __builtin_shufflevector(b2, b3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63);
            o->c[2 * h] = (a & 15) | lo;
            o->c[2 * h + 1] = high_nibbles(a) | hi;
            o->s[2 * h] = h ? QUARTERS(sc, 8, 9, 10, 11) : QUARTERS(sc, 0, 1, 2, 3);
            o->s[2 * h + 1] = h ? QUARTERS(sc, 12, 13, 14, 15) : QUARTERS(sc, 4, 5, 6, 7);
        }
        return;
    }
    const uint8_t *qs = blk + (type == BK_Q4_K ? 16 : 48);
    for (int p = 0; p < 2; p++) { /* code bytes 64p..64p+63: sub-blocks 4p, 4p+2 (low nibbles) and 4p+1, 4p+3 */
        u8x64 a = load_u8x64(qs + 64 * p);
        u8x64 lo = a & 15, hi = high_nibbles(a);
        if (type == BK_Q5_K) { /* the fifth bit of sub-block j is bit j of qh's bytes */
            u8x64 qh = twice_u8x32(blk + 16);
            const int j = 4 * p;
            /* bytes 0-31 test bit j (low) / j + 1 (high), bytes 32-63 bits j + 2 / j + 3: built from
             * splats (a loop of lane stores stayed a loop in clang's AVX2 copy, far slower) */
            u8x64 mlo = halves_u8(1u << j, 1u << (j + 2)), mhi = halves_u8(2u << j, 2u << (j + 2));
            lo |= (u8x64)((qh & mlo) != 0) & 16;
            hi |= (u8x64)((qh & mhi) != 0) & 16;
        }
        o->c[2 * p] = lo, o->c[2 * p + 1] = hi;
        o->s[2 * p] = six_halves(six, sc, 4 * p, 4 * p + 2);
        o->s[2 * p + 1] = six_halves(six, sc, 4 * p + 1, 4 * p + 3);
    }
}

/* The exact int32 lanes of one row's super-block times one activation row's (x: its 256 codes in the
 * type's order; xs: the 16 sums of 16 codes) */
BK_INLINE vi16 kq8_dot(const kq8_block *b, int type, i16x16 sc, const int8_t *x, const int16_t *xs) {
    vi16 a = madd(maddubs(b->c[0], load_i8x64(x)), b->s[0]);
    for (int v = 1; v < 4; v++) a = madd_add(a, maddubs(b->c[v], load_i8x64(x + 64 * v)), b->s[v]);
    if (type == BK_Q6_K || type == BK_Q3_K) { /* codes are q + 32 (Q3_K: q + 4): take 32 sc_g (4 sc_g) off,
                                                 the sum of group g's activations times its scale */
        i16x16 s;
        memcpy(&s, xs, 32);
        i16x32 sc2 = zext_i16(sc);
        i16x32 s2 = zext_i16(s);
        a -= madd(sc2, s2) << (type == BK_Q6_K ? 5 : 2);
    }
    return a;
}

/* One row's super-block: its scales (sc: Q4_K/Q5_K six-bit scales then minimums, Q2_K/Q3_K/Q6_K
 * their 16), d and -dmin. */
typedef struct {
    i16x16 sc;
    bk_u8x16 six; /* Q4_K/Q5_K: the six-bit values; Q2_K: the scale bytes (minimum: high nibble) */
    v16 d, dmin; /* splat */
} kq8_head;

BK_INLINE kq8_head kq8_read(const uint8_t *blk, int type) {
    kq8_head h;
    if (type == BK_Q6_K) {
        typedef int8_t i8x16 __attribute__((vector_size(16)));
        i8x16 s;
        memcpy(&s, blk + 192, 16);
        h.sc = __builtin_convertvector(s, i16x16);
        h.six = (bk_u8x16){0};
        h.d = splat16(bk_fp16(blk + 208)), h.dmin = (v16){0};
    } else if (type == BK_Q3_K) { /* scale i: nibble i / 8 of byte i % 8, bits 2 (i / 4).. of byte 8 + i % 4 on top;
                                     4 bytes a lane (a loop of lane stores stays a loop in clang's AVX2 copy) */
        typedef uint32_t u32x4 __attribute__((vector_size(16)));
        u32x4 w = {0};
        memcpy(&w, blk + 96, 12);
        u32x4 lo = __builtin_shufflevector(w, w, 0, 1, 0, 1), hi = __builtin_shufflevector(w, w, 2, 2, 2, 2);
        u32x4 v = ((lo >> (u32x4){0, 0, 4, 4}) & 0x0F0F0F0F) | ((hi >> (u32x4){0, 2, 4, 6}) & 0x03030303) << 4;
        bk_u8x16 u = (bk_u8x16)v;
        h.sc = __builtin_convertvector(u, i16x16) - 32;
        h.six = (bk_u8x16){0};
        h.d = splat16(bk_fp16(blk + 108)), h.dmin = (v16){0};
    } else if (type == BK_Q2_K) {
        memcpy(&h.six, blk, 16);
        h.sc = __builtin_convertvector(h.six & 15, i16x16);
        h.d = splat16(bk_fp16(blk + 80)), h.dmin = splat16(-bk_fp16(blk + 82));
    } else {
        h.six = q4k_six(blk);
        h.sc = __builtin_convertvector(h.six, i16x16);
        h.d = splat16(bk_fp16(blk)), h.dmin = splat16(-bk_fp16(blk + 2));
    }
    return h;
}

/* f += one (row, super-block, activation row)'s product: the exact integers, then the float
 * epilogue: t = ints d (+ minimum ints -dmin), f += t s, with d, dmin splat once per row and
 * super-block and s once per activation row and super-block (a scalar d s per pair had cost
 * prefill two scalar multiplies and two broadcasts each). Every path (one activation row or
 * many) goes through here, so a row's bits do not depend on its batch. xm: [0 x 8, the 8 sums of
 * 32 codes] (Q4_K/Q5_K's minimum term). */
BK_INLINE v16 kq8_accumulate(const kq8_block *b, int type, const kq8_head *h, const int8_t *x, const int16_t *xs,
                             const int16_t *xm, v16 s, v16 f) {
    vi16 a = kq8_dot(b, type, h->sc, x, xs);
    /* written as multiply-adds so that no copy is left to -ffp-contract (see fma16) */
    v16 t = fma16(__builtin_convertvector(a, v16), h->d, (v16){0});
    if (type == BK_Q4_K || type == BK_Q5_K) { /* minimums x sums of 32, in int32 lanes 4..7 */
        i16x16 m;
        memcpy(&m, xm, 32);
        i16x32 sc2 = zext_i16(h->sc);
        i16x32 m2 = zext_i16(m);
        t = fma16(__builtin_convertvector(madd(sc2, m2), v16), h->dmin, t);
    } else if (type == BK_Q2_K) { /* minimums x sums of 16, in int32 lanes 0..7 */
        i16x16 m;
        memcpy(&m, xs, 32);
        i16x32 mn = zext_i16(__builtin_convertvector(h->six >> 4, i16x16)), m2 = zext_i16(m);
        t = fma16(__builtin_convertvector(madd(mn, m2), v16), h->dmin, t);
    }
    return fma16(t, s, f);
}

/* Rows n0..n1 of a K-quant weight times M rows of 8-bit activations, y[m * ldy + n]. One activation
 * row: row after row, each read start to end (the matrix is one forward stream); several: tiles of
 * 4 rows, each super-block unpacked once for all M (acc: M x TILE vectors). */
BK_INLINE void int8_tile_rows(const bk_weight *w, int type, int n0, int n1, int M, const bk_xq *x, float *y,
                              int64_t ldy, v16 *acc) {
    int K = w->K, ns = K / 256, bb = bk_block_bytes(type);
    const int8_t *xq = type == BK_Q4_K || type == BK_Q5_K ? x->q8p : x->q8;
    if (M == 1) {
        for (int n = n0; n < n1; n++) {
            const uint8_t *row = w->data + (int64_t)n * w->row_bytes;
            v16 f = {0};
            for (int sb = 0; sb < ns; sb++) {
                const uint8_t *blk = row + sb * bb;
                for (int o = 0; o < bb; o += 64) __builtin_prefetch(blk + PREFETCH_BYTES + o);
                kq8_head h = kq8_read(blk, type);
                kq8_block b;
                kq8_unpack(blk, type, h.sc, h.six, &b);
                f = kq8_accumulate(&b, type, &h, xq + sb * 256, x->xs8 + sb * 16, x->xm8 + sb * 16, splat16(x->s8[sb]), f);
            }
            y[n] = reduce16(f);
        }
        return;
    }
    for (int n = n0; n < n1; n += TILE) {
        int R = n1 - n < TILE ? n1 - n : TILE;
        for (int i = 0; i < M * TILE; i++) acc[i] = (v16){0};
        for (int sb = 0; sb < ns; sb++) {
            kq8_head h[TILE];
            kq8_block b[TILE];
            for (int r = 0; r < R; r++) {
                const uint8_t *blk = w->data + (int64_t)(n + r) * w->row_bytes + sb * bb;
                h[r] = kq8_read(blk, type);
                kq8_unpack(blk, type, h[r].sc, h[r].six, &b[r]);
            }
            for (int mi = 0; mi < M; mi++) {
                int64_t at = (int64_t)mi * ns + sb;
                v16 sx = splat16(x->s8[at]);
                if (R == TILE) { /* in registers: a store to acc could alias the activation bytes */
                    v16 f[TILE];
                    for (int r = 0; r < TILE; r++) f[r] = acc[mi * TILE + r];
                    for (int r = 0; r < TILE; r++)
                        f[r] = kq8_accumulate(&b[r], type, &h[r], xq + at * 256, x->xs8 + at * 16, x->xm8 + at * 16, sx, f[r]);
                    for (int r = 0; r < TILE; r++) acc[mi * TILE + r] = f[r];
                } else {
                    for (int r = 0; r < R; r++)
                        acc[mi * TILE + r] = kq8_accumulate(&b[r], type, &h[r], xq + at * 256, x->xs8 + at * 16,
                                                            x->xm8 + at * 16, sx, acc[mi * TILE + r]);
                }
            }
        }
        for (int mi = 0; mi < M; mi++)
            for (int r = 0; r < R; r++) y[(int64_t)mi * ldy + n + r] = reduce16(acc[mi * TILE + r]);
    }
}

/* an input a coarse 8-bit activation block gives up (brisk_kernels.c's exact outlier inputs): its row,
 * column and value; at most OUTLIERS_PER_BLOCK a block */
typedef struct bk_outlier {
    int m, k;
    float v;
} bk_outlier;

enum { OUTLIERS_PER_BLOCK = 4 };

typedef int8_t bk_i8x16 __attribute__((vector_size(16)));

/* x [M, K] -> the 8-bit activations (K a multiple of 256): bk_xq's q8, q8p, s8, xs8, xm8. In whole
 * vectors of 16 (a scalar loop took 2 ns an input: a sixth of Gemma 3's prefill). */
BK_INLINE void quantize_x8(const float *x, int M, int K, int8_t *q, int8_t *qp, float *s, int16_t *xs, int16_t *xm) {
    const float magic = 12582912.0f; /* adding 1.5 * 2^23 rounds to an integer */
    static const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7}; /* qp's sub-block j holds x's sub-block order[j] */
    for (int64_t b = 0; b < (int64_t)M * (K / 256); b++) {
        const float *xb = x + b * 256;
        v16 mx = {0};
        for (int k = 0; k < 256; k += LANES) {
            v16 a = (v16)((vi16)load16(xb + k) & 0x7fffffff);
            mx = select16(a > mx, a, mx);
        }
        float amax = 0.0f;
        for (int l = 0; l < LANES; l++) amax = mx[l] > amax ? mx[l] : amax;
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int t16[16];
        for (int c = 0; c < 16; c++) {
            vi16 v = __builtin_convertvector((load16(xb + 16 * c) * inv + magic) - magic, vi16);
            bk_i8x16 c8 = __builtin_convertvector(v, bk_i8x16);
            memcpy(q + b * 256 + 16 * c, &c8, 16);
            int t = 0;
            for (int l = 0; l < LANES; l++) t += v[l];
            t16[c] = t;
        }
        for (int j = 0; j < 8; j++) memcpy(qp + b * 256 + 32 * j, q + b * 256 + 32 * order[j], 32);
        s[b] = amax / 127.0f;
        for (int l = 0; l < 16; l++) {
            xs[b * 16 + l] = (int16_t)t16[l];
            xm[b * 16 + l] = (int16_t)(l < 8 ? 0 : t16[2 * (l - 8)] + t16[2 * (l - 8) + 1]);
        }
    }
}

#endif
