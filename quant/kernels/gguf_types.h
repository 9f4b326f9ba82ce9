/* Block formats of the weights brisk's kernels read, dequantized one block at a time to float32.
 *
 * GGUF's types as ggml defines them (little-endian; a row is its blocks one after another), plus
 * brisk's own int4 groups. Each dq_* function turns one block into its weights in order, with plain
 * loops that the compiler vectorizes for whichever instruction set the caller was compiled for
 * (brisk_kernels.c instantiates its kernels per level and these inline into them).
 *
 *   Q4_0  32 weights, 18 bytes: d (fp16), 16 code bytes              w = d (q - 8)
 *   Q4_1  32 weights, 20 bytes: d, m (fp16), 16 code bytes           w = d q + m
 *   Q5_0  32 weights, 22 bytes: d (fp16), qh (32 high bits), 16 code bytes   w = d (q - 16)
 *   Q5_1  32 weights, 24 bytes: d, m (fp16), qh, 16 code bytes       w = d q + m
 *   Q8_0  32 weights, 34 bytes: d (fp16), 32 int8                    w = d q
 *   MXFP4 32 weights, 17 bytes: e (E8M0), 16 code bytes              w = kvalue[q] 2^(e - 128)
 * In the 4/5-bit types, code byte j holds weight j (low nibble) and weight j + 16 (high nibble);
 * bit j of qh is weight j's fifth bit. MXFP4 (gpt-oss's experts): kvalue[q] is the e2m1 value
 * doubled, {0, 1, 2, 3, 4, 6, 8, 12} then the same negated, and 2^(e - 128) is the E8M0 scale
 * halved, a float denormal for e < 2. The K-quants (256 weights per super-block) are in
 * gguf_kquants.h.
 */
#ifndef BRISK_GGUF_TYPES_H
#define BRISK_GGUF_TYPES_H

#include <stdint.h>
#include <string.h>
#if defined(__SSSE3__)
#include <tmmintrin.h>
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#define BK_INLINE static inline __attribute__((always_inline))

enum {
    BK_F32 = 0, /* plain float32 rows (a float model's weights, read in place) */
    BK_Q4_0 = 2, BK_Q4_1 = 3, BK_Q5_0 = 6, BK_Q5_1 = 7, BK_Q8_0 = 8,
    BK_Q2_K = 10, BK_Q3_K = 11, BK_Q4_K = 12, BK_Q5_K = 13, BK_Q6_K = 14, BK_MXFP4 = 39,
};

/* What the kernels need to know of each type: BK_TYPE_TABLE below (quant/gguf_types.py is the same
 * table for Python: a new type is a row in both). Its flags: */
enum {
    BK_INT = 1,    /* integer products on 16-bit activations (int_dot.h) */
    BK_SUPER = 2,  /* of those, on the 256-weight grid (the K-quants) */
    BK_ACT8 = 4,   /* 8-bit activations per 256 where they are on (int8_dot.h) */
    BK_MIN = 8,    /* a per-block minimum: w = d q + m */
    BK_FIFTH = 16, /* qh: a fifth bit per weight, after the fp16 fields (Q5_0, Q5_1) */
};

/* One row per type: id, weights and bytes per block (an interleaved group's block, BK_X8, holds 8
 * rows' blocks, moved), flags. Read through the functions below: with the type a constant (each
 * kernel is instantiated per type) they fold away in the compiler's first passes. */
#define BK_TYPE_TABLE(X)                                        \
    X(BK_Q4_0, 32, 18, BK_INT)                                  \
    X(BK_Q4_1, 32, 20, BK_INT | BK_MIN)                         \
    X(BK_Q5_0, 32, 22, BK_INT | BK_FIFTH)                       \
    X(BK_Q5_1, 32, 24, BK_INT | BK_MIN | BK_FIFTH)              \
    X(BK_Q8_0, 32, 34, BK_INT)                                  \
    X(BK_Q2_K, 256, 84, BK_ACT8)                                \
    X(BK_Q3_K, 256, 110, BK_ACT8)                               \
    X(BK_Q4_K, 256, 144, BK_INT | BK_SUPER | BK_ACT8 | BK_MIN)  \
    X(BK_Q5_K, 256, 176, BK_INT | BK_SUPER | BK_ACT8)           \
    X(BK_Q6_K, 256, 210, BK_INT | BK_SUPER | BK_ACT8)           \
    X(BK_MXFP4, 32, 17, BK_INT)

#define BK_WEIGHTS_CASE(id, weights, bytes, flags) case id: return weights;
#define BK_BYTES_CASE(id, weights, bytes, flags) case id: return bytes;
#define BK_FLAGS_CASE(id, weights, bytes, flags) case id: return flags;

/* Weights and bytes per block of a type, and its flags; 0 for a type brisk cannot read. */
BK_INLINE int bk_block_weights(int type) {
    switch (type) { BK_TYPE_TABLE(BK_WEIGHTS_CASE) default: return 0; }
}
BK_INLINE int bk_block_bytes(int type) {
    switch (type) { BK_TYPE_TABLE(BK_BYTES_CASE) default: return 0; }
}
BK_INLINE int bk_type_flags(int type) {
    switch (type) { BK_TYPE_TABLE(BK_FLAGS_CASE) default: return 0; }
}
/* Whether a type has a flag (a constant): the comparisons with the ids that have it, folded while the
 * compiler parses them, so that a type known only at run time costs what a hand-written list of ids
 * would (a switch there gave whole kernels other register allocations, measurably slower). */
#define BK_HAS_CASE(id, weights, bytes, flags) || (((flags) & bk_flag_) && bk_type_ == (id))
#define bk_type_has(type, flag) \
    __extension__({ int bk_type_ = (type); enum { bk_flag_ = (flag) }; 0 BK_TYPE_TABLE(BK_HAS_CASE); })

BK_INLINE float bk_f32_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__F16C__)
/* IEEE half -> float: one instruction where the copy is built for F16C (the AVX2 and AVX-512 ones) */
BK_INLINE float bk_fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#elif defined(__aarch64__)
BK_INLINE float bk_fp16(const uint8_t *p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return (float)h;
}
#else
/* IEEE half -> float, exact for every half (subnormals, infinities, NaN), without branches: the
 * half's exponent and mantissa are placed in a float's and the exponent bias fixed by a multiply
 * by 2^-112 (which also turns an all-ones exponent into infinity); subnormal halves instead become
 * 0.5 + m 2^-24 with a chosen exponent, minus 0.5. */
BK_INLINE float bk_fp16(const uint8_t *p) {
    uint32_t h = (uint32_t)(p[0] | p[1] << 8), two = h << 17; /* the sign shifted out */
    float normal = bk_f32_bits((two >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float subnormal = bk_f32_bits((two >> 17) | (126u << 23)) - 0.5f;
    uint32_t bits;
    float v = two < (1u << 27) ? subnormal : normal;
    memcpy(&bits, &v, 4);
    return bk_f32_bits(bits | (h & 0x8000u) << 16);
}
#endif

/* GCC vector types: 16 lanes whatever the instruction set (one AVX-512 register, two AVX2 ones, four
 * SSE or NEON ones). Plain loops over bytes do not vectorize well; these do, on every level. */
typedef uint8_t bk_u8x16 __attribute__((vector_size(16)));
typedef float bk_f32x16 __attribute__((vector_size(64)));
typedef int32_t bk_i32x16 __attribute__((vector_size(64)));
typedef uint32_t bk_u32x16 __attribute__((vector_size(64)));

BK_INLINE bk_u8x16 bk_load_u8x16(const uint8_t *p) {
    bk_u8x16 v;
    memcpy(&v, p, 16);
    return v;
}

BK_INLINE void bk_store16(float *y, bk_f32x16 v) { memcpy(y, &v, 64); }

/* 16 codes as floats, through int32 (GCC 12 converts bytes to floats one at a time otherwise) */
BK_INLINE bk_f32x16 bk_u8_to_f32(bk_u8x16 c) {
    return __builtin_convertvector(__builtin_convertvector(c, bk_i32x16), bk_f32x16);
}

BK_INLINE void dq_q4_0(const uint8_t *b, float *y) {
    float d = bk_fp16(b);
    bk_u8x16 c = bk_load_u8x16(b + 2);
    bk_store16(y, (bk_u8_to_f32(c & 15) - 8.f) * d);
    bk_store16(y + 16, (bk_u8_to_f32(c >> 4) - 8.f) * d);
}

BK_INLINE void dq_q4_1(const uint8_t *b, float *y) {
    float d = bk_fp16(b), m = bk_fp16(b + 2);
    bk_u8x16 c = bk_load_u8x16(b + 4);
    bk_store16(y, bk_u8_to_f32(c & 15) * d + m);
    bk_store16(y + 16, bk_u8_to_f32(c >> 4) * d + m);
}

BK_INLINE uint32_t bk_u32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

/* The fifth bits of weights `first`..`first` + 15 from qh, in place (16) */
BK_INLINE bk_i32x16 bk_high_bits(uint32_t qh, int first) {
    const bk_u32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    bk_u32x16 h = (bk_u32x16){0} + qh;
    return (bk_i32x16)(((h >> (lane + (uint32_t)first)) & 1) << 4);
}

BK_INLINE void dq_q5_0(const uint8_t *b, float *y) {
    float d = bk_fp16(b);
    uint32_t qh = bk_u32(b + 2);
    bk_u8x16 c = bk_load_u8x16(b + 6);
    bk_i32x16 lo = __builtin_convertvector(c & 15, bk_i32x16) | bk_high_bits(qh, 0);
    bk_i32x16 hi = __builtin_convertvector(c >> 4, bk_i32x16) | bk_high_bits(qh, 16);
    bk_store16(y, __builtin_convertvector(lo - 16, bk_f32x16) * d);
    bk_store16(y + 16, __builtin_convertvector(hi - 16, bk_f32x16) * d);
}

BK_INLINE void dq_q5_1(const uint8_t *b, float *y) {
    float d = bk_fp16(b), m = bk_fp16(b + 2);
    uint32_t qh = bk_u32(b + 4);
    bk_u8x16 c = bk_load_u8x16(b + 8);
    bk_i32x16 lo = __builtin_convertvector(c & 15, bk_i32x16) | bk_high_bits(qh, 0);
    bk_i32x16 hi = __builtin_convertvector(c >> 4, bk_i32x16) | bk_high_bits(qh, 16);
    bk_store16(y, __builtin_convertvector(lo, bk_f32x16) * d + m);
    bk_store16(y + 16, __builtin_convertvector(hi, bk_f32x16) * d + m);
}

/* 16 signed bytes as floats: flipped to unsigned and back (GCC 12 vectorizes the unsigned widening only) */
BK_INLINE bk_f32x16 bk_i8_to_f32(const uint8_t *p) {
    bk_u8x16 u = bk_load_u8x16(p) ^ 0x80;
    return __builtin_convertvector(__builtin_convertvector(u, bk_i32x16) - 128, bk_f32x16);
}

BK_INLINE void dq_q8_0(const uint8_t *b, float *y) {
    float d = bk_fp16(b);
    bk_store16(y, bk_i8_to_f32(b + 2) * d);
    bk_store16(y + 16, bk_i8_to_f32(b + 18) * d);
}

/* MXFP4's kvalues as bytes (int8): the table of its 16 codes */
BK_INLINE bk_u8x16 bk_mxfp4_kvalues(void) { return (bk_u8x16){0, 1, 2, 3, 4, 6, 8, 12, 0, 255, 254, 253, 252, 250, 248, 244}; }

/* The kvalues of 16 codes (0..15): one byte shuffle where there is one (pshufb, tbl; clang has no
 * variable-shuffle builtin, so intrinsics); else computed in byte lanes (plain x86-64 has no byte
 * shuffle for GCC's __builtin_shuffle to use): magnitude m = q & 7 for m <= 4, 6 / 8 / 12 for 5 / 6 / 7 */
BK_INLINE bk_u8x16 bk_mxfp4_k(bk_u8x16 q) {
#if defined(__SSSE3__)
    return (bk_u8x16)_mm_shuffle_epi8((__m128i)bk_mxfp4_kvalues(), (__m128i)q);
#elif defined(__aarch64__)
    return (bk_u8x16)vqtbl1q_u8((uint8x16_t)bk_mxfp4_kvalues(), (uint8x16_t)q);
#else
    bk_u8x16 m = q & 7, neg = (bk_u8x16)((q & 8) != 0);
    bk_u8x16 mag = m + ((bk_u8x16)(m > 4) & (m - 4)) + ((bk_u8x16)(m == 7) & 2);
    return (mag ^ neg) - neg;
#endif
}

/* 2^(e - 128) for every e, as ggml's e8m0 half (e < 2: the denormals 2^-128, 2^-127), without a
 * branch: 2^(a - 64) 2^(e - a - 64) with a = e / 2, two normal floats whose product is exact */
BK_INLINE float bk_e8m0_half(uint32_t e) { return bk_f32_bits(((e >> 1) + 63) << 23) * bk_f32_bits((e - (e >> 1) + 63) << 23); }

BK_INLINE void dq_mxfp4(const uint8_t *b, float *y) {
    float d = bk_e8m0_half(b[0]);
    bk_u8x16 c = bk_load_u8x16(b + 1);
    /* offset to 0..24 (GCC 12 vectorizes only unsigned byte widening); (k + 12) - 12, and k times a
     * power of two, are exact: gguf's floats bit for bit */
    bk_store16(y, (bk_u8_to_f32(bk_mxfp4_k(c & 15) + 12) - 12.f) * d);
    bk_store16(y + 16, (bk_u8_to_f32(bk_mxfp4_k(c >> 4) + 12) - 12.f) * d);
}

#endif
