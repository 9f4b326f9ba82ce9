/* 16 float lanes as GCC vector types (one AVX-512 register, two AVX2 ones, four NEON or SSE ones),
 * shared by the per-level files (tiles.c, decoder.c): the compiler lowers them to the instruction
 * set each copy is compiled for. Fixed lane counts and fixed reduction orders keep a level's bits
 * the same on every machine. */
#ifndef BRISK_BK_VEC_H
#define BRISK_BK_VEC_H

#include <stdint.h>
#include <string.h>

#include "gguf_types.h" /* BK_INLINE */
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define LANES 16
typedef float v16 __attribute__((vector_size(LANES * 4)));
typedef int32_t vi16 __attribute__((vector_size(LANES * 4)));

BK_INLINE v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

BK_INLINE void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

BK_INLINE v16 splat16(float f) { return (v16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; } /* not 0 + f: an add per call */

/* a b + c rounded once, in every lane. Written out where a row's bits must not depend on the code
 * path (the integer products' float epilogues, inlined once for one activation row and once for
 * several): left to -ffp-contract, one copy may fuse and another not (seen with GCC 13). */
BK_INLINE v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    __m256 x[2], y[2], z[2];
    memcpy(x, &a, 64), memcpy(y, &b, 64), memcpy(z, &c, 64);
    z[0] = _mm256_fmadd_ps(x[0], y[0], z[0]);
    z[1] = _mm256_fmadd_ps(x[1], y[1], z[1]);
    memcpy(&c, z, 64);
    return c;
#else
    for (int l = 0; l < LANES; l++) c[l] = __builtin_fmaf(a[l], b[l], c[l]); /* NEON: fmla */
    return c;
#endif
}

/* c + a b as one fused multiply-add where the instruction set has one, else as two roundings: every
 * copy of a loop built from it rounds the same way (fma16 without hardware FMA is a libm call). */
#if defined(__AVX512F__) || defined(__FMA__) || defined(__aarch64__)
#define mac16 fma16
#else
BK_INLINE v16 mac16(v16 a, v16 b, v16 c) {
    v16 p = a * b; /* no fused instruction in this copy to contract into */
    return c + p;
}
#endif

/* lane l + lane l + 8, then + 4, + 2, + 1: a fixed pairwise order, in halving vectors (a loop over a
 * stored array cost a sixth of a K-quant row's time at K = 2048) */
typedef float bk_v8 __attribute__((vector_size(32)));
typedef float bk_v4 __attribute__((vector_size(16)));
BK_INLINE float reduce16(v16 a) {
    bk_v8 h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    bk_v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    float e0 = q[0] + q[2], e1 = q[1] + q[3];
    return e0 + e1;
}

/* reduce16 of a[0..15] at once, lane u holding reduce16(a[u]) bit for bit: the same pairs added in
 * the same order, with four vectors' halves side by side in each step (15 adds and 30 permutes
 * for 16 sums, where one reduce16 alone takes ~10 operations) */
BK_INLINE v16 reduce16x16(const v16 *a) {
    v16 b[8], c[4], d[2];
    for (int p = 0; p < 8; p++)
        b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int p = 0; p < 4; p++)
        c[p] = __builtin_shufflevector(b[2 * p], b[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(b[2 * p], b[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)
        d[p] = __builtin_shufflevector(c[2 * p], c[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(c[2 * p], c[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* m ? a : b, lane by lane (m: a comparison's all-ones or zero lanes) */
BK_INLINE v16 select16(vi16 m, v16 a, v16 b) { return (v16)(((vi16)a & m) | ((vi16)b & ~m)); }

/* e^x in every lane, relative error ~2e-7 (Cody-Waite reduction to |r| <= ln2/2, Cephes' degree-6
 * polynomial, scaled by 2^n built in the exponent bits); 0 below -87, large but finite above 88.3.
 * From -87 up the scaled product stays a normal float: below it (clamped to -87.34 before) it went
 * subnormal, and each multiply making a subnormal costs x86 a microcode assist (~100 cycles), which
 * a softmax over many far-below-max keys hit in every vector. */
BK_INLINE v16 exp16(v16 x) {
    const v16 hi = splat16(88.3762626647949f), lo = splat16(-87.0f);
    vi16 under = x < lo;
    x = select16(x > hi, hi, select16(under, lo, x));
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    v16 n = (x * 1.44269504088896341f + magic) - magic;
    v16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16 p = splat16(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
    return select16(under, splat16(0.0f), p * (v16)bits);
}

#endif
