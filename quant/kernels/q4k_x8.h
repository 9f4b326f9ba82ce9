/* Q4_K with its rows interleaved 8 at a time (layout BK_X8), times 8-bit activations.
 *
 * Why: in the file's layout one row's super-block is one row's work: its scales decoded, four code
 * vectors multiplied and each scaled by its sub-blocks' scales, then a float epilogue, all for 256
 * weights. With 8 rows side by side every vector holds the same 8 code positions of 8 rows, so one
 * broadcast of 8 activations serves 8 rows, a sub-block's 32 codes are summed in int16 before a
 * single scale multiply-add, and the scales, d, dmin and the float epilogue are done once per 8
 * rows: Q4_K reads its weights about 1.5x faster from memory than in the file's layout; llama.cpp
 * repacks Q4_K for x86 for the same reason.
 *
 * Layout (quant/gguf_interleave.py writes it): rows in groups of 8; per group, super-block after
 * super-block, 1152 bytes (8 x 144, the file's size):
 *   [0, 1024)     codes: 16 vectors of 64 bytes; vector u holds, for rows 0..7 in turn, bytes
 *                 8u..8u+7 of the row's 128 code bytes. Byte i of vector 4c + t: low nibble = weight
 *                 64c + 8t + i of the super-block (sub-block 2c), high nibble = weight 64c + 32 + 8t + i
 *                 (sub-block 2c + 1), as in the file.
 *   [1024, 1040)  d of rows 0..7 (fp16)
 *   [1040, 1056)  -dmin of rows 0..7 (fp16, sign flipped: exact)
 *   [1056, 1152)  the 12 scale bytes of each row, regrouped: bytes 0..3 of rows 0..7, then bytes
 *                 4..7 of rows 0..7, then bytes 8..11 (so every row's six-bit scales and minimums
 *                 decode in one 32-byte vector each).
 * Rows past the last whole group (N % 8) follow in the file's layout, at the file's offsets.
 *
 * The integers are exact (a sub-block's int16 sum is at most 4 x 2 x 15 x 127 = 15240) and the float
 * epilogue is one function for one activation row or many: a row's bits do not depend on the batch
 *
 * Q5_K the same way (quant/gguf_interleave.py _k_groups), 1408 bytes per group's super-block (8 x 176):
 *   [0, 1280)     4 chunks of 5 vectors: chunk c holds Q4_K's code vectors 4c..4c+3 (the low four bits),
 *                 then the fifth bits of those 256 codes (one forward stream, as Q6_K's high bits):
 *                 byte i of row r holds in bit t that of vector 4c + t's low nibble (weight 64c + 8t + i),
 *                 in bit 4 + t its high nibble's (64c + 32 + 8t + i), so each is one shift of the
 *                 chunk's vector and an and-or into the nibble.
 *   [1280, 1408)  d, -dmin and the scale bytes of rows 0..7, as Q4_K's [1024, 1152).
 * A sub-block's int16 sum is at most 4 x 2 x 31 x 127 = 31496, still exact.
 *
 * Q6_K the same way (quant/gguf_interleave.py _pack_q6_k), 1680 bytes per group's super-block (8 x 210):
 *   [0, 1536)     8 chunks of 3 vectors: chunk p holds low-nibble vectors 2p and 2p + 1, then high-bit
 *                 vector p (one forward stream: with the high bits in a region of their own, two
 *                 streams a block, Q6_K x8 read a third as fast from memory as from L3).
 *                 Low-nibble vector u, row r, byte i: low nibble = the low four bits of weight 8u + i,
 *                 high nibble = those of weight 128 + 8u + i. High-bit vector p, row r, byte i: the top
 *                 two bits of weights 16p + i, 128 + 16p + i, 16p + 8 + i and 136 + 16p + i (bits 0-1,
 *                 2-3, 4-5, 6-7): with vectors 2p and 2p + 1, sub-blocks p and 8 + p
 *   [1536, 1664)  the scales (int8): vector q (32 bytes), byte 4r + t = row r's scale 4q + t
 *   [1664, 1680)  d of rows 0..7 (fp16)
 * A sub-block's 16 products sum in int16 (4 per lane, <= 4 x 63 x 127 = 32004) before its scale. */
#ifndef BRISK_Q4K_X8_H
#define BRISK_Q4K_X8_H

#include "int8_dot.h"

#define X8_ROWS 8
#define X8_BYTES 1152 /* one group's super-block */
#define Q5X8_BYTES 1408 /* Q5_K's */
#define Q5X8_HEAD 1280 /* where its d, -dmin and scales start (Q4_K's: 1024) */
#define Q6X8_BYTES 1680 /* Q6_K's */
#ifndef X8_PREFETCH
#define X8_PREFETCH 4608 /* bytes ahead of the super-block being read (4 of them) */
#endif

/* A product of many activation rows (prefill) goes through its weight's groups X8_PASS_ROWS rows at a
 * time and, for each such pass, through the activations x8_act_rows rows at a time: a block's codes
 * (~X8_ACT_BYTES) stay in the core's first caches while the pass's groups read them, and the pass's
 * weights in L2 while the blocks go by. Every group reading every activation row went to L3 for each
 * group once the rows outgrew L2 (1-3 MiB at K = 2048-5632 and 512 rows). A row's sums keep their
 * order: its bits do not depend on the blocks. */
#ifndef X8_PASS_ROWS
#define X8_PASS_ROWS 64
#endif
#ifndef X8_ACT_BYTES
#define X8_ACT_BYTES (32 * 1024)
#endif
BK_INLINE int x8_act_rows(int M, int64_t row_bytes) {
    int64_t mb = X8_ACT_BYTES / (row_bytes > 0 ? row_bytes : 1);
    mb = mb < 16 ? 16 : mb;
    return mb < M ? (int)mb : M;
}

typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef uint8_t u8x32s __attribute__((vector_size(32)));

/* 8 activation bytes in every 64-bit lane */
BK_INLINE i8x64 bcast8(const int8_t *p) {
#if defined(__AVX512F__)
    uint64_t u;
    memcpy(&u, p, 8);
    return (i8x64)_mm512_set1_epi64((long long)u);
#else /* (a vector splat of a uint64 crashes GCC 12's AVX2 build) */
    i8x64 v;
    for (int i = 0; i < 64; i += 8) memcpy((int8_t *)&v + i, p, 8);
    return v;
#endif
}

BK_INLINE bk_v8 half8(const uint8_t *p) {
#if defined(__F16C__)
    return (bk_v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    bk_v8 v;
    for (int i = 0; i < 8; i++) v[i] = bk_fp16(p + 2 * i);
    return v;
#endif
}

/* One group's super-block, decoded once for every activation row */
typedef struct {
    i16x32 s[8];   /* sub-block j's scales: int16 lanes 4r..4r+3 hold row r's */
    i16x32 m0, m1; /* minimums 0..3 and 4..7: lane 4r + t holds row r's minimum t (or 4 + t) */
    v16 d, nm;     /* lanes 2r, 2r + 1: row r's d and -dmin */
} x8_head;

#define SPREAD(v, j) __builtin_shufflevector(v, v, j, j, j, j, 4 + j, 4 + j, 4 + j, 4 + j, 8 + j, 8 + j, 8 + j, 8 + j, \
    12 + j, 12 + j, 12 + j, 12 + j, 16 + j, 16 + j, 16 + j, 16 + j, 20 + j, 20 + j, 20 + j, 20 + j, 24 + j, 24 + j, \
    24 + j, 24 + j, 28 + j, 28 + j, 28 + j, 28 + j)

/* hd: the super-block's d, -dmin and scales (Q4_K: g + 1024, Q5_K: g + Q5X8_HEAD) */
BK_INLINE void x8_read(const uint8_t *hd, x8_head *h) {
    u8x32s A, B, C; /* lanes 4r + i: row r's scale bytes i, 4 + i, 8 + i */
    memcpy(&A, hd + 32, 32), memcpy(&B, hd + 64, 32), memcpy(&C, hd + 96, 32);
    /* Q4_K's six-bit packing: scales 0..3 and minimums 0..3 in the low bits of bytes 0..3 / 4..7;
     * scales and minimums 4..7: low four bits in byte 8..11's nibbles, top two in bytes 0..7's top bits */
    i16x32 lo = __builtin_convertvector(A & 63, i16x32), hi = __builtin_convertvector((C & 15) | ((A >> 6) << 4), i16x32);
    h->s[0] = SPREAD(lo, 0), h->s[1] = SPREAD(lo, 1), h->s[2] = SPREAD(lo, 2), h->s[3] = SPREAD(lo, 3);
    h->s[4] = SPREAD(hi, 0), h->s[5] = SPREAD(hi, 1), h->s[6] = SPREAD(hi, 2), h->s[7] = SPREAD(hi, 3);
    h->m0 = __builtin_convertvector(B & 63, i16x32);
    h->m1 = __builtin_convertvector((C >> 4) | ((B >> 6) << 4), i16x32);
    bk_v8 d = half8(hd), m = half8(hd + 16);
    h->d = __builtin_shufflevector(d, d, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    h->nm = __builtin_shufflevector(m, m, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
}

/* The float epilogue of Q4_K's and Q5_K's x8 sums (a: the scaled code sums), one for every batch */
BK_INLINE v16 x8_finish(vi16 a, const x8_head *h, const int16_t *xm, v16 s, v16 f) {
    /* lane 2r + e of mn: row r's minimums 2e, 2e + 1, 4 + 2e, 5 + 2e times their sub-blocks' sums */
    vi16 mn = madd(h->m0, (i16x32)bcast8((const int8_t *)xm)) + madd(h->m1, (i16x32)bcast8((const int8_t *)(xm + 4)));
    /* written as multiply-adds so that no copy is left to -ffp-contract (see fma16) */
    v16 t = fma16(__builtin_convertvector(a, v16), h->d, (v16){0});
    t = fma16(__builtin_convertvector(mn, v16), h->nm, t);
    return fma16(t, s, f);
}

/* f += a group's super-block times one activation row (x: its 256 codes in order; xm: its 8 sums of
 * 32 codes; s: its scale). Lanes 2r, 2r + 1 of f are row r's (two halves of its code positions). */
BK_INLINE v16 x8_accumulate(const uint8_t *g, const x8_head *h, const int8_t *x, const int16_t *xm, v16 s, v16 f) {
    vi16 a = {0};
    for (int c = 0; c < 4; c++) { /* sub-blocks 2c and 2c + 1 */
        i16x32 lo = {0}, hi = {0};
        for (int t = 0; t < 4; t++) {
            u8x64 v = load_u8x64(g + 64 * (4 * c + t));
            lo += maddubs(v & 15, bcast8(x + 64 * c + 8 * t));
            hi += maddubs(high_nibbles(v), bcast8(x + 64 * c + 32 + 8 * t));
        }
        a = madd_add(madd_add(a, lo, h->s[2 * c]), hi, h->s[2 * c + 1]);
    }
    return x8_finish(a, h, xm, s, f);
}

/* Q5_K's code vector t of chunk p (c: 320 bytes), low and high nibbles with their fifth bits from the
 * chunk's last vector. 16-bit shifts of at most 4 bring no bit into bit 4 from the other byte; one
 * lane type, so the and-ors fuse (vpternlog). */
#define Q5X8_CODES(p, t, l5, h5)                                                                             \
    u16x32v vw = (u16x32v)load_u8x64((p) + 64 * (t)), qw = (u16x32v)load_u8x64((p) + 256);                   \
    u8x64 l5 = (u8x64)((vw & 0x0F0F) | ((qw << (4 - (t))) & 0x1010)), h5 = (u8x64)(((vw >> 4) & 0x0F0F) | ((qw >> (t)) & 0x1010))

/* The same for Q5_K: each code vector's nibbles with their fifth bits from the chunk's last vector */
BK_INLINE v16 q5x8_accumulate(const uint8_t *g, const x8_head *h, const int8_t *x, const int16_t *xm, v16 s, v16 f) {
    vi16 a = {0};
    for (int c = 0; c < 4; c++) {
        const uint8_t *p = g + 320 * c;
        i16x32 lo = {0}, hi = {0};
        for (int t = 0; t < 4; t++) {
            Q5X8_CODES(p, t, l5, h5);
            lo += maddubs(l5, bcast8(x + 64 * c + 8 * t));
            hi += maddubs(h5, bcast8(x + 64 * c + 32 + 8 * t));
        }
        a = madd_add(madd_add(a, lo, h->s[2 * c]), hi, h->s[2 * c + 1]);
    }
    return x8_finish(a, h, xm, s, f);
}

/* Q6_K: one group's super-block, decoded once for every activation row */
typedef struct {
    i16x32 sc[16]; /* sub-block j's scale: int16 lanes 4r..4r+3 hold row r's */
    i16x32 scq[4]; /* lane 4r + t: row r's scale 4q + t */
    v16 d;         /* lanes 2r, 2r + 1: row r's d */
} q6x8_head;

BK_INLINE void q6x8_read(const uint8_t *g, q6x8_head *h) {
    for (int q = 0; q < 4; q++) {
        i8x32 v;
        memcpy(&v, g + 1536 + 32 * q, 32);
        i16x32 w = __builtin_convertvector(v, i16x32);
        h->scq[q] = w;
        h->sc[4 * q] = SPREAD(w, 0), h->sc[4 * q + 1] = SPREAD(w, 1), h->sc[4 * q + 2] = SPREAD(w, 2);
        h->sc[4 * q + 3] = SPREAD(w, 3);
    }
    bk_v8 d = half8(g + 1664);
    h->d = __builtin_shufflevector(d, d, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
}

/* f += a group's Q6_K super-block times one activation row (x: its 256 codes in order; xs: its 16
 * sums of 16 codes; s: its scale). Lanes 2r, 2r + 1 of f are row r's. */
/* Q6_K's codes for sub-blocks p and 8 + p (chunk p): lo's two vectors, then hi's */
#define Q6X8_CODES(g, p, alo, blo, ahi, bhi)                                                                          \
    u8x64 A = load_u8x64((g) + 192 * (p)), B = load_u8x64((g) + 192 * (p) + 64), Q = load_u8x64((g) + 192 * (p) + 128); \
    u8x64 alo = (A & 15) | (u8x64)(((u16x32v)Q << 4) & 0x3030), ahi = high_nibbles(A) | (u8x64)(((u16x32v)Q << 2) & 0x3030); \
    u8x64 blo = (B & 15) | (Q & 0x30), bhi = high_nibbles(B) | (u8x64)(((u16x32v)Q >> 2) & 0x3030)

/* sum_j scale_j x_j (x_j: sub-block j's activation sum, xs): Q6_K's and Q3_K's code offsets' share,
 * in units of the offset (32, 4) */
BK_INLINE vi16 x8_offset_sums(const i16x32 *scq, const int16_t *xs) {
    vi16 c = madd(scq[0], (i16x32)bcast8((const int8_t *)xs));
    for (int q = 1; q < 4; q++) c = madd_add(c, scq[q], (i16x32)bcast8((const int8_t *)(xs + 4 * q)));
    return c;
}

/* the codes are q + 32: take 32 sum_j scale_j x_j (x_j: sub-block j's activation sum) off */
BK_INLINE v16 q6x8_finish(vi16 a, const q6x8_head *h, const int16_t *xs, v16 s, v16 f) {
    a -= x8_offset_sums(h->scq, xs) << 5;
    return fma16(fma16(__builtin_convertvector(a, v16), h->d, (v16){0}), s, f);
}

BK_INLINE v16 q6x8_accumulate(const uint8_t *g, const q6x8_head *h, const int8_t *x, const int16_t *xs, v16 s, v16 f) {
    vi16 a = {0};
    for (int p = 0; p < 8; p++) { /* sub-blocks p and 8 + p */
        Q6X8_CODES(g, p, alo, blo, ahi, bhi);
        i16x32 lo = maddubs(alo, bcast8(x + 16 * p)) + maddubs(blo, bcast8(x + 16 * p + 8));
        i16x32 hi = maddubs(ahi, bcast8(x + 128 + 16 * p)) + maddubs(bhi, bcast8(x + 136 + 16 * p));
        a = madd_add(madd_add(a, lo, h->sc[p]), hi, h->sc[8 + p]);
    }
    return q6x8_finish(a, h, xs, s, f);
}

/* A group's super-block's codes decoded once for all of a pass's activation rows (prefill, several
 * rows). Their codes take 2-4 instructions per vector to unpack; redone for every activation row, that
 * was as much work as the products (Q4_K's, one instruction, pays from about 8 rows).
 * Q6_K's, Q3_K's and Q2_K's sub-block j is two code vectors against activations 16j..16j+7 and
 * 16j+8..16j+15 (x8_codes_dot); Q4_K's and Q5_K's keep x8_accumulate's order (x8_codes_dot_k). */
typedef struct {
    u8x64 c[32]; /* c[2j], c[2j + 1]: sub-block j's codes */
} x8_codes;

BK_INLINE void q6x8_decode(const uint8_t *g, x8_codes *o) {
    for (int p = 0; p < 8; p++) {
        Q6X8_CODES(g, p, alo, blo, ahi, bhi);
        o->c[2 * p] = alo, o->c[2 * p + 1] = blo, o->c[16 + 2 * p] = ahi, o->c[17 + 2 * p] = bhi;
    }
}

/* the 16 sub-blocks' products with one activation row, each times its scale (sc[j]: int16 lanes 4r..4r+3
 * hold row r's), summed: the same integers as the accumulate functions (their int16 sums are the same
 * pairs, and int32 sums are the same in any order) */
BK_INLINE vi16 x8_codes_dot(const x8_codes *o, const int8_t *x, const i16x32 *sc) {
    vi16 a = {0};
    for (int j = 0; j < 16; j++)
        a = madd_add(a, maddubs(o->c[2 * j], bcast8(x + 16 * j)) + maddubs(o->c[2 * j + 1], bcast8(x + 16 * j + 8)), sc[j]);
    return a;
}

/* Q5_K's codes in x8_accumulate's order: c[8c + t] the low nibbles of chunk c's vector t (sub-block
 * 2c, activations 64c + 8t..), c[8c + 4 + t] the high ones (2c + 1, 64c + 32 + 8t..) */
BK_INLINE void q5x8_decode(const uint8_t *g, x8_codes *o) {
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 4; t++) {
            Q5X8_CODES(g + 320 * c, t, l5, h5);
            o->c[8 * c + t] = l5, o->c[8 * c + 4 + t] = h5;
        }
}

/* the same for Q4_K's nibbles */
BK_INLINE void q4x8_decode(const uint8_t *g, x8_codes *o) {
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 4; t++) {
            u8x64 v = load_u8x64(g + 64 * (4 * c + t));
            o->c[8 * c + t] = v & 15, o->c[8 * c + 4 + t] = high_nibbles(v);
        }
}

/* x8_accumulate's sums over q5x8_decode's codes: the same int16 sums in the same order */
BK_INLINE vi16 x8_codes_dot_k(const x8_codes *o, const int8_t *x, const x8_head *h) {
    vi16 a = {0};
    for (int c = 0; c < 4; c++) {
        i16x32 lo = {0}, hi = {0};
        for (int t = 0; t < 4; t++) {
            lo += maddubs(o->c[8 * c + t], bcast8(x + 64 * c + 8 * t));
            hi += maddubs(o->c[8 * c + 4 + t], bcast8(x + 64 * c + 32 + 8 * t));
        }
        a = madd_add(madd_add(a, lo, h->s[2 * c]), hi, h->s[2 * c + 1]);
    }
    return a;
}

/* Row r's d, dmin and scale bytes back in a Q4_K/Q5_K block's first 16 (hd: the group's head) */
BK_INLINE void x8_head_bytes(const uint8_t *hd, int r, uint8_t *out) {
    memcpy(out, hd + 2 * r, 2);
    memcpy(out + 2, hd + 16 + 2 * r, 2);
    out[3] ^= 0x80; /* back to +dmin */
    for (int i = 0; i < 4; i++) out[4 + i] = hd[32 + 4 * r + i], out[8 + i] = hd[64 + 4 * r + i], out[12 + i] = hd[96 + 4 * r + i];
}

/* Row n's super-block sb back in the file's 144 bytes (dequantizing a row: embedding lookups, tiles) */
BK_INLINE const uint8_t *x8_block(const bk_weight *w, int n, int sb, uint8_t *out) {
    int ns = w->K / 256, whole = w->N / X8_ROWS * X8_ROWS;
    if (n >= whole) /* a group is 8 rows' bytes: the rows after the last one sit where the file has them */
        return w->data + (int64_t)n * w->row_bytes + sb * 144;
    const uint8_t *g = w->data + ((int64_t)(n / X8_ROWS) * ns + sb) * X8_BYTES;
    int r = n % X8_ROWS;
    for (int u = 0; u < 16; u++) memcpy(out + 16 + 8 * u, g + 64 * u + 8 * r, 8);
    x8_head_bytes(g + 1024, r, out);
    return out;
}

/* The same for Q5_K (176 bytes) */
BK_INLINE const uint8_t *q5x8_block(const bk_weight *w, int n, int sb, uint8_t *out) {
    int ns = w->K / 256, whole = w->N / X8_ROWS * X8_ROWS;
    if (n >= whole) return w->data + (int64_t)n * w->row_bytes + sb * 176;
    const uint8_t *g = w->data + ((int64_t)(n / X8_ROWS) * ns + sb) * Q5X8_BYTES;
    int r = n % X8_ROWS;
    x8_head_bytes(g + Q5X8_HEAD, r, out);
    memset(out + 16, 0, 32);
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 4; t++) {
            memcpy(out + 48 + 32 * c + 8 * t, g + 320 * c + 64 * t + 8 * r, 8);
            for (int i = 0; i < 8; i++) { /* qh byte 8t + i: bits 2c, 2c + 1 */
                uint8_t q = g[320 * c + 256 + 8 * r + i];
                out[16 + 8 * t + i] |= (uint8_t)(((q >> t) & 1) << (2 * c) | ((q >> (4 + t)) & 1) << (2 * c + 1));
            }
        }
    return out;
}

/* The same for Q6_K (210 bytes) */
BK_INLINE const uint8_t *q6x8_block(const bk_weight *w, int n, int sb, uint8_t *out) {
    int ns = w->K / 256, whole = w->N / X8_ROWS * X8_ROWS;
    if (n >= whole) return w->data + (int64_t)n * w->row_bytes + sb * 210;
    const uint8_t *g = w->data + ((int64_t)(n / X8_ROWS) * ns + sb) * Q6X8_BYTES;
    int r = n % X8_ROWS;
    uint8_t code[256];
    for (int u = 0; u < 16; u++)
        for (int i = 0; i < 8; i++) {
            uint8_t b = g[192 * (u / 2) + 64 * (u % 2) + 8 * r + i];
            code[8 * u + i] = b & 15, code[128 + 8 * u + i] = b >> 4;
        }
    for (int p = 0; p < 8; p++)
        for (int i = 0; i < 8; i++) {
            uint8_t b = g[192 * p + 128 + 8 * r + i];
            code[16 * p + i] |= (b & 3) << 4, code[128 + 16 * p + i] |= (b >> 2 & 3) << 4;
            code[16 * p + 8 + i] |= (b >> 4 & 3) << 4, code[136 + 16 * p + i] |= (b >> 6) << 4;
        }
    for (int h = 0; h < 2; h++) /* the file's ql / qh (dq_q6_k's order) */
        for (int l = 0; l < 32; l++) {
            const uint8_t *c = code + 128 * h;
            out[64 * h + l] = (c[l] & 15) | (c[64 + l] & 15) << 4;
            out[64 * h + 32 + l] = (c[32 + l] & 15) | (c[96 + l] & 15) << 4;
            out[128 + 32 * h + l] = (c[l] >> 4) | (c[32 + l] >> 4) << 2 | (c[64 + l] >> 4) << 4 | (c[96 + l] >> 4) << 6;
        }
    for (int q = 0; q < 4; q++)
        for (int t = 0; t < 4; t++) out[192 + 4 * q + t] = g[1536 + 32 * q + 4 * r + t];
    memcpy(out + 208, g + 1664 + 2 * r, 2);
    return out;
}

#endif
