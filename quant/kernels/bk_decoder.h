/* A model's transformer blocks as decoder.c runs them (every core/arch architecture: the Llama
 * family, Gemma 3, Qwen3, Phi-3 with its partial rotary, and the mixtures of experts, gpt-oss's
 * sinks, biases and clamped SwiGLU among them). */
#ifndef BRISK_BK_DECODER_H
#define BRISK_BK_DECODER_H

#include <stdint.h>

#include "bk_weight.h"

typedef struct { /* the same for every block */
    int dim, n_heads, n_kv, head_dim, ffn;
    float eps, attn_scale;
    int qk_norm;  /* RMSNorm each q and k head (Gemma 3) */
    int sandwich; /* Gemma's norms of the attention and MLP outputs */
    int act;      /* the gate's activation: BK_SILU, BK_GELU (tanh) or BK_SWIGLU_CLAMP (gpt-oss) */
    /* mixtures of experts: experts a token is routed to, whether their weights are renormalized
     * to sum to 1, an expert's feed-forward width */
    int n_used, norm_topk, expert_ffn;
    int rope_dim;     /* rope turns each head's first rope_dim dimensions (the tables' width), the rest pass */
    int topk_softmax; /* routing: the top n_used logits, then a softmax over them (gpt-oss), else
                       * a softmax over all, then the top n_used (norm_topk applies) */
    /* BK_SWIGLU_CLAMP: g = min(g, limit), u = clamp(u, -limit, limit), g sigmoid(alpha g) (u + 1) */
    float swiglu_limit, swiglu_alpha;
} bk_arch;

enum { BK_SILU = 0, BK_GELU = 1, BK_SWIGLU_CLAMP = 2 };

typedef struct {
    bk_weight qkv[3], o, gate_up[2], down; /* q/k/v and gate/up: one call each */
    const float *q_bias, *k_bias, *v_bias, *o_bias; /* or NULL */
    /* RMSNorm weights as multiplied (Gemma's 1 + w already added): attn_in, post_attn, and with
     * sandwich pre_ffn, post_ffn; q_norm, k_norm with qk_norm */
    const float *attn_in, *post_attn, *pre_ffn, *post_ffn, *q_norm, *k_norm;
    const float *cos, *sin; /* rope tables [positions, head_dim], sin signed as model.py makes it */
    int window;             /* sliding window length, 0: full attention */
    const float *sinks;     /* or NULL: [n_heads] logits, one more key per head whose value is zero */
    /* an MoE layer (n_experts > 0) in place of gate_up/down: the router [n_experts, dim] (float32)
     * and each expert's gate, up and down, 3 weights an expert */
    int n_experts;
    const bk_weight *router, *experts;
    /* or NULL: the router's bias [n_experts]; each expert's gate, up and down biases, expert e's
     * at expert_bias + e (2 expert_ffn + dim) in that order */
    const float *router_bias, *expert_bias;
} bk_layer;

/* How a cache stores the head_dim values of one (position, head): float32; IEEE half; bfloat16;
 * GGUF's Q8_0 blocks of 32 values (an fp16 scale d, then 32 int8 q: value = d q). Written
 * converted, converted back to float32 on read. */
enum { BK_KV_F32 = 0, BK_KV_F16 = 1, BK_KV_BF16 = 2, BK_KV_Q8_0 = 3 };

/* Where position p of a row's sequence keeps its K (and V) in a layer's cache, head h:
 *   base + table[p / block_size] * block_stride + (p % block_size) * pos_stride + h * head_stride
 * (bytes), table being the row's block table. A contiguous cache [batch, kv_heads, max_len, D] is
 * one block of max_len positions per sequence; a paged pool [blocks, block_size, kv_heads, D] is
 * token-major. */
typedef struct {
    void *const *k, *const *v; /* per layer: the cache's base */
    const int32_t *tables;     /* every row's block table, concatenated */
    int block_size;
    int64_t block_stride, pos_stride, head_stride;
    int type; /* BK_KV_*: the stored values' type */
} bk_cache;

/* Tensor parallelism on one host (core/tp_shm.py's segment): this rank's partial outputs of o and
 * down summed over the ranks (bk_tp_all_reduce). The segment: world counters `line` bytes apart (a
 * rank's collective count, then its pid), then at `data` two banks of world slots of `slot` bytes. */
typedef struct {
    char *base;
    int64_t *seq; /* collectives so far: shared with the Python side, which runs the others */
    int rank, world;
    int64_t line, data, slot;
    double check, timeout; /* seconds between checks that the peers live; the longest wait */
} bk_tp;

/* x[0 .. n) (float32) summed over the ranks in place, slot 0 + slot 1 + ... in rank order: 0, or
 * BK_TP_GONE (a peer ended) or BK_TP_TIMEOUT */
enum { BK_TP_GONE = -3, BK_TP_TIMEOUT = -4 };
int bk_tp_all_reduce(const bk_tp *tp, float *x, int64_t n);

#endif
