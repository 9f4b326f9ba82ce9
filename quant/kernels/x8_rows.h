/* The K-quants' products with their rows interleaved 8 at a time (layout BK_X8): one function over
 * q4k_x8.h's kernels (Q4_K, Q5_K, Q6_K) and q3k_x8.h's (Q3_K, Q2_K), dispatched by type. */
#ifndef BRISK_X8_ROWS_H
#define BRISK_X8_ROWS_H

#include <stdint.h>

#include "bk_weight.h"
#include "gguf_types.h"
#include "int8_dot.h"
#include "q3k_x8.h"
#include "q4k_x8.h"

/* Rows n0..n1 of a BK_X8 weight times M rows of 8-bit activations, y[m * ldy + n]. A group partly
 * inside n0..n1 (a thread's chunk edge) is computed whole and only its rows inside stored. acc: M
 * vectors of scratch (M > 1). */
BK_INLINE void x8_rows(const bk_weight *w, int type, int n0, int n1, int M, const bk_xq *x, float *y, int64_t ldy,
                       v16 *acc) {
    int ns = w->K / 256, whole = w->N / X8_ROWS * X8_ROWS;
    int bytes = X8_ROWS * bk_block_bytes(type); /* a group's super-block: 8 rows' */
    int64_t group_bytes = (int64_t)ns * bytes;
    x8_codes codes[1]; /* (M > 1) a super-block's decoded codes, reused by every activation row */
    int mb = x8_act_rows(M, w->K);
    for (int gp = n0 / X8_ROWS * X8_ROWS; gp < n1 && gp < whole; gp += X8_PASS_ROWS)
    for (int m_lo = 0; m_lo < M; m_lo += mb)
    for (int g0 = gp, m_hi = m_lo + mb < M ? m_lo + mb : M; g0 < gp + X8_PASS_ROWS && g0 < n1 && g0 < whole; g0 += X8_ROWS) {
        const uint8_t *grp = w->data + (int64_t)(g0 / X8_ROWS) * group_bytes;
        v16 f1 = {0}, *f = M == 1 ? &f1 : acc;
        for (int mi = m_lo; mi < m_hi && M > 1; mi++) acc[mi] = (v16){0};
        for (int sb = 0; sb < ns; sb++) {
            const uint8_t *g = grp + (int64_t)sb * bytes;
            for (int o = 0; o < bytes; o += 64) __builtin_prefetch(g + X8_PREFETCH + o);
            if (type == BK_Q2_K) {
                q2x8_head h;
                q2x8_read(g + 512, &h);
                if (M > 1) {
                    q2x8_decode(g, codes);
                    for (int mi = m_lo; mi < m_hi; mi++) {
                        int64_t at = (int64_t)mi * ns + sb;
                        f[mi] = q2x8_finish(x8_codes_dot(codes, x->q8 + at * 256, h.sc), &h, x->xs8 + at * 16,
                                            splat16(x->s8[at]), f[mi]);
                    }
                } else
                    f[0] = q2x8_accumulate(g, &h, x->q8 + sb * 256, x->xs8 + sb * 16, splat16(x->s8[sb]), f[0]);
            } else if (type == BK_Q3_K || type == BK_Q6_K) {
                q6x8_head h;
                if (type == BK_Q3_K) q3x8_read(g + 768, &h);
                else q6x8_read(g, &h);
                if (M > 1) {
                    if (type == BK_Q3_K) q3x8_decode(g, codes);
                    else q6x8_decode(g, codes);
                    for (int mi = m_lo; mi < m_hi; mi++) {
                        int64_t at = (int64_t)mi * ns + sb;
                        vi16 a = x8_codes_dot(codes, x->q8 + at * 256, h.sc);
                        f[mi] = type == BK_Q3_K ? q3x8_finish(a, &h, x->xs8 + at * 16, splat16(x->s8[at]), f[mi])
                                                : q6x8_finish(a, &h, x->xs8 + at * 16, splat16(x->s8[at]), f[mi]);
                    }
                } else if (type == BK_Q3_K)
                    f[0] = q3x8_accumulate(g, &h, x->q8 + sb * 256, x->xs8 + sb * 16, splat16(x->s8[sb]), f[0]);
                else
                    f[0] = q6x8_accumulate(g, &h, x->q8 + sb * 256, x->xs8 + sb * 16, splat16(x->s8[sb]), f[0]);
            } else { /* Q4_K, Q5_K */
                const int q5 = type == BK_Q5_K;
                x8_head h;
                x8_read(g + (q5 ? Q5X8_HEAD : 1024), &h);
                if (M >= (q5 ? 2 : 8)) { /* (Q4_K's nibbles unpack in one instruction: decoding them once pays
                                          * from ~8 rows, and costs below that) */
                    if (q5) q5x8_decode(g, codes);
                    else q4x8_decode(g, codes);
                    for (int mi = m_lo; mi < m_hi; mi++) {
                        int64_t at = (int64_t)mi * ns + sb;
                        f[mi] = x8_finish(x8_codes_dot_k(codes, x->q8 + at * 256, &h), &h, x->xm8 + at * 16 + 8,
                                          splat16(x->s8[at]), f[mi]);
                    }
                } else if (q5)
                    f[0] = q5x8_accumulate(g, &h, x->q8 + sb * 256, x->xm8 + sb * 16 + 8, splat16(x->s8[sb]), f[0]);
                else
                    for (int mi = m_lo; mi < m_hi; mi++) { /* (Q4_K: up to 7 rows) */
                        int64_t at = (int64_t)mi * ns + sb;
                        f[mi] = x8_accumulate(g, &h, x->q8 + at * 256, x->xm8 + at * 16 + 8, splat16(x->s8[at]), f[mi]);
                    }
            }
        }
        for (int mi = m_lo; mi < m_hi; mi++)
            for (int r = 0; r < X8_ROWS; r++)
                if (g0 + r >= n0 && g0 + r < n1) y[(int64_t)mi * ldy + g0 + r] = f[mi][2 * r] + f[mi][2 * r + 1];
    }
    if (n1 > whole) { /* the rows after the last group: in the file's layout, where the file has them */
        bk_weight tail = *w;
        tail.layout = 0;
        int a = n0 > whole ? n0 : whole;
        int8_tile_rows(&tail, type, a, n1, M, x, y, ldy, acc);
    }
}

#endif
