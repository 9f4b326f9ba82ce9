/* One weight matrix as brisk's kernels see it (shared by brisk_kernels.c and tiles.c). */
#ifndef BRISK_BK_WEIGHT_H
#define BRISK_BK_WEIGHT_H

#include <stddef.h>
#include <stdint.h>

#include "gguf_types.h"

/* brisk's own formats beside GGUF's type ids */
enum {
    BK_I4G = 1000, /* int4 groups: codes uint8 [N, K/2] (column 2i low nibble, 2i+1 high), bf16 scale s and
                      zero z per group of `group` columns: w = (q - 8) s + z */
    BK_I8R = 1001, /* int8 rows: codes int8 [N, K], one float scale per row: w = q s */
};

typedef struct {
    int type;
    int N, K, group;
    const uint8_t *data; /* blocks or codes, row n at data + n * row_bytes */
    int64_t row_bytes;
    const uint16_t *scales, *zeros; /* BK_I4G: bf16 [N, K / group] */
    union {                         /* one pointer: 64 bytes a weight (a 72-byte one cost SmolLM2's decode 3-6%) */
        const float *row_scales;    /* BK_I8R: [N] */
        void *columns;              /* 8-bit activation types (K-quants): bk_columns_new's cache of dequantized
                                       columns (the exact outlier inputs' products, brisk_kernels.c), shared by
                                       every copy of the struct */
    };
    int layout;                     /* 0: rows as the format stores them; BK_X8: Q2_K..Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or MXFP4 rows interleaved by 8 (q4k_x8.h, q3k_x8.h, q8_x8.h) */
} bk_weight;

#define BK_X8 8

#define TILE 4 /* weight rows dequantized and multiplied together */
#define BK_CHUNK 512 /* columns of a tile dequantized at a time: 4 x 512 floats (8 KB) stay in L1 */

/* The columns tiles.c dequantizes at a time for this weight: whole blocks or groups, and whole
 * vectors of 16 floats, about `want` of them (at most K). */
BK_INLINE int bk_chunk_near(const bk_weight *w, int want) {
    int unit = w->type == BK_I4G ? w->group : w->type == BK_I8R || w->type == BK_F32 ? 16 : bk_block_weights(w->type), u = unit;
    while (u % 16) u += unit;
    u = u >= want ? u : want / u * u;
    return u < w->K ? u : w->K;
}

BK_INLINE int bk_chunk(const bk_weight *w) { return bk_chunk_near(w, BK_CHUNK); }

/* Floats of scratch a thread needs for tiles.c's products with M activation rows. */
BK_INLINE size_t bk_tile_floats(const bk_weight *w, int M) { return (size_t)TILE * (bk_chunk(w) + 16) + (size_t)M * TILE * (16 + 1); }

#endif
