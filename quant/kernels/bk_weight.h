/* One weight matrix as brisk's kernels see it (shared by brisk_kernels.c and tiles.c). */
#ifndef BRISK_BK_WEIGHT_H
#define BRISK_BK_WEIGHT_H

#include <stdint.h>

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
    const float *row_scales;        /* BK_I8R: [N] */
} bk_weight;

#define TILE 4 /* weight rows dequantized and multiplied together */

#endif
