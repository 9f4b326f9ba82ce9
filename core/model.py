"""The transformer: the Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) and Gemma 3 in one
implementation, switched by ModelConfig flags. Module and parameter names follow Hugging Face's,
so HF state dicts load as they are.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import blas, fused, paged_attention_kernel
from .config import ModelConfig
from .kv_cache import KVCache
from .paged_cache import BlockPool, PagedStep
from ..quant.linear import concat_linears


class Linear(nn.Linear):
    """nn.Linear that sends single-row fp32 CPU inputs to NumPy's BLAS (see blas.py for why)."""

    _np = (None, None)  # (weight, its NumPy view), made on first use: weights load after init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if blas.usable(self.weight) and not x.requires_grad and x.numel() == x.shape[-1]:
            if self._np[0] is not self.weight:  # object.__setattr__: not a registered parameter
                object.__setattr__(self, "_np", (self.weight, self.weight.detach().numpy()))
            y = blas.gemv(x, self._np[1])
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.usable(x):
            return fused.rms_norm(x, self.weight, self.eps, self.offset)
        # Written out: on the CPU this is fewer dispatches than F.rms_norm's decomposition.
        xf = x.float()
        y = xf * (xf * xf).sum(-1, keepdim=True).mul_(1.0 / x.shape[-1]).add_(self.eps).rsqrt_()
        if self.offset == 0.0:  # Llama casts back before scaling, Gemma after
            return self.weight * y.to(x.dtype)
        return (y * (self.offset + self.weight.float())).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling:  # llama3: stretch low frequencies, keep high ones, blend in between
        factor, lo, hi = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen - lo) / (hi - lo)).clamp(0, 1)
        inv = (1 - smooth) * inv / factor + smooth * inv
    return inv.float()


def rope_tables(inv_freq: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # rotate-half layout, as HF stores q/k
    # The first half of sin carries rotate-half's minus sign, so rope is roll + 2 mul + add.
    return emb.cos(), torch.cat([-freqs.sin(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos/sin: [T, D]. rotate_half(x) = (-x2, x1) = roll(x) * (-1, +1).
    if fused.usable(x) and x.dim() == 4:
        return fused.rope(x, cos, signed_sin)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def decode_attention(q, k, v, scale, mask=None):
    """One query token against the cache, grouped-query heads folded into the batch of a bmm.
    mask: None, or bool [1, keys] (a graph-captured step attends over a fixed-size key range).

    On the CPU this is about 3x cheaper than SDPA's flash kernel for a single query.
    """
    B, H, _, D = q.shape
    KV = k.shape[1]
    qg = q.view(B * KV, H // KV, D)  # the query heads that share one KV head
    scores = torch.bmm(qg, k.reshape(B * KV, -1, D).transpose(1, 2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    y = torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), v.reshape(B * KV, -1, D))
    return y.view(B, H, 1, D)


def paged_attention(q, k, v, step: PagedStep, layer: int, window: int | None, scale: float):
    """Attention for a batched step over the paged pool. q [N, H, D] and k/v [N, KV, D] are the
    step's new tokens (already rotated); k/v are written to their slots first.

    Decode rows (one query each) run the Triton paged-attention kernel on CUDA, which reads the
    blocks in place; elsewhere they gather their block tables into [rows, keys, KV, D] and run as
    one masked bmm per KV head. Prefill chunks run one SDPA each over their gathered blocks.
    """
    N, H, D = q.shape
    KV = k.shape[1]
    kc, vc = step.pool.k[layer], step.pool.v[layer]  # [blocks, block_size, KV, D]
    kc.view(-1, KV, D).index_copy_(0, step.slots, k)
    vc.view(-1, KV, D).index_copy_(0, step.slots, v)
    out = torch.empty_like(q)
    nd, G = step.n_decode, H // KV
    if nd and q.is_cuda and paged_attention_kernel.available():
        paged_attention_kernel.paged_decode_attention(q[:nd], kc, vc, step.decode_blocks, step.decode_lens,
                                                      scale, window, out=out[:nd])
    elif nd:
        keys, values = step.gather(kc), step.gather(vc, second=True)  # [rows, keys, KV, D]
        mask = step.decode_mask(window, q.dtype)
        for h in range(KV):  # a strided [rows, keys, D] slice per KV head: no copy for bmm
            heads = slice(h * G, (h + 1) * G)
            scores = torch.baddbmm(mask, q[:nd, heads], keys[:, :, h].transpose(1, 2), alpha=scale)
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out[:nd, heads] = torch.bmm(probs, values[:, :, h])
    for i, (s, T, _, blocks) in enumerate(step.prefills):
        keys = kc.index_select(0, blocks).flatten(0, 1).transpose(0, 1)[None]  # [1, KV, keys, D]
        values = vc.index_select(0, blocks).flatten(0, 1).transpose(0, 1)[None]
        y = F.scaled_dot_product_attention(q[s:s + T].transpose(0, 1)[None], keys, values,
                                           attn_mask=step.prefill_mask(i, window), scale=scale,
                                           enable_gqa=KV != H)
        out[s:s + T] = y[0].transpose(0, 1)
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_offset)
        self.sliding = cfg.layer_types[layer] == "sliding"

    def forward(self, x, cos, sin, cache: KVCache, start, mask):
        """start: the first token's position (int), or a tensor of the tokens' positions for a
        step of fixed shapes (CUDA graphs): the cache then returns `mask`'s number of keys."""
        if isinstance(cache, PagedStep):
            return self.forward_paged(x, cos, sin, cache)
        B, T, _ = x.shape
        q, k, v = self._project(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if torch.is_tensor(start):
            k, v = cache.write_at(self.layer, start, k, v, mask[0].shape[-1])
        else:
            k, v = cache.write(self.layer, start, k, v)
        if mask is None and self.sliding and k.shape[2] > self.cfg.sliding_window:
            # Single-token decode: the window is just the last `sliding_window` keys.
            k, v = k[:, :, -self.cfg.sliding_window:], v[:, :, -self.cfg.sliding_window:]
        elif mask is not None:
            mask = mask[self.sliding]
        if T == 1 and torch.is_tensor(start) and q.is_cuda and paged_attention_kernel.available():
            y = self._static_decode_attention(q, cache, start)
        elif T == 1 and (mask is not None or q.device.type == "cpu"):
            y = decode_attention(q, k, v, self.cfg.attn_scale, mask)
        else:
            # mask None: causal from position 0, SDPA's flash kernel on a GPU (it takes no mask)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                               scale=self.cfg.attn_scale, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def _project(self, x):
        """q, k, v: one matmul when fuse_projections() joined the three layers."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        fused = self.__dict__.get("_qkv")
        if fused is not None and fused[1] == parts:
            return fused[0](x).split(fused[2], dim=-1)
        return tuple(p(x) for p in parts)

    def _static_decode_attention(self, q, cache: KVCache, pos):
        """One query per sequence over the static cache through the paged-attention kernel: each
        sequence's cache is one block of max_len slots, read only up to its position."""
        B = q.shape[0]
        kc = cache.k[self.layer].transpose(1, 2)  # [B, max_len, KV, D]: a view, no copy
        vc = cache.v[self.layer].transpose(1, 2)
        window = self.cfg.sliding_window if self.sliding else None
        pos = pos.expand(B) if pos.numel() == 1 else pos
        y = paged_attention_kernel.paged_decode_attention(q[:, :, 0], kc, vc, cache.block_table, pos, self.cfg.attn_scale,
                                                          window, lengths_add=1)
        return y[:, :, None]  # [B, H, 1, D]

    def forward_paged(self, x, cos, sin, step: PagedStep):
        """x [1, N, dim]: the flattened tokens of a batched step; cos/sin [N, D], per token."""
        N = x.shape[1]
        q, k, v = self._project(x)
        q = q.reshape(N, self.n_heads, self.head_dim)
        k = k.reshape(N, self.n_kv, self.head_dim)
        v = v.reshape(N, self.n_kv, self.head_dim)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos[:, None], sin[:, None]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        window = self.cfg.sliding_window if self.sliding else None
        y = paged_attention(q, k, v, step, self.layer, window, self.cfg.attn_scale)
        return self.o_proj(y.view(1, N, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.gelu = cfg.act == "gelu_tanh"

    def forward(self, x):
        joined = self.__dict__.get("_gate_up")
        if joined is not None and joined[1] == (self.gate_proj, self.up_proj) and fused.usable(x):
            return self.down_proj(fused.gated_halves(joined[0](x), self.gelu))
        g = self.gate_proj(x)
        if fused.usable(g):
            return self.down_proj(fused.gated(g, self.up_proj(x), self.gelu))
        g = F.gelu(g, approximate="tanh") if self.gelu else F.silu(g)
        return self.down_proj(g * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn, self.mlp = Attention(cfg, layer), MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        # In Llama this norm feeds the MLP; in Gemma it normalizes the attention output.
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.local_rope = cfg.rope_local_theta is not None and cfg.layer_types[layer] == "sliding"

    def forward(self, x, rope, cache, start, mask):
        cos, sin = rope[self.local_rope]
        a = self.self_attn(self.input_layernorm(x), cos, sin, cache, start, mask)
        if not self.sandwich:
            h = x + a
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # _weight skips the random init: on the meta device normal_() costs a second of imports.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope_factors: torch.Tensor | None = None  # GGUF llama3 models store these as a tensor

    def setup_rope(self, max_len: int, device) -> None:
        """Precompute cos/sin tables; call after weights are loaded (they are not in the checkpoint)."""
        cfg = self.cfg
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if self.rope_factors is not None:
            inv = inv / self.rope_factors.float().cpu()
        tables = [rope_tables(inv, max_len)]
        if cfg.rope_local_theta is not None:
            tables.append(rope_tables(rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, None), max_len))
        dtype = self.model.norm.weight.dtype  # norms stay float when the embedding is quantized
        self.rope = [(c.to(device, dtype), s.to(device, dtype)) for c, s in tables]
        self.max_len = max_len

    def fuse_projections(self) -> None:
        """Join q/k/v and gate/up into one matmul each where their kinds allow (on CUDA, where a
        launch per layer costs; quant.linear.concat_linears). The joined layer is held outside
        the module tree (state dicts do not change) and used only while the originals are the
        ones it was built from."""
        for block in self.model.layers:
            a, m = block.self_attn, block.mlp
            parts = (a.q_proj, a.k_proj, a.v_proj)
            if (j := concat_linears(list(parts))) is not None:
                a.__dict__["_qkv"] = (j, parts, [p.out_features for p in parts])
            parts = (m.gate_proj, m.up_proj)
            if (j := concat_linears(list(parts))) is not None:
                m.__dict__["_gate_up"] = (j, parts)

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> KVCache:
        w = self.model.norm.weight
        return KVCache(self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim,
                       max_len or self.max_len, w.dtype, w.device, batch)

    def new_pool(self, n_blocks: int, block_size: int) -> BlockPool:
        w = self.model.norm.weight
        return BlockPool(self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim, n_blocks, block_size,
                         w.dtype, w.device)

    def decoding(self):
        """Context around a run of single-token steps: the place for per-run decode setup
        (none is needed at present; the CPU matmul path is chosen per call, see blas.py)."""
        return contextlib.nullcontext()

    def _masks(self, start, T: int, device, keys: int | None = None):
        """Boolean [T, keys] masks (full, sliding), keys = start + T by default; None for
        single-token decode. start may be a tensor of positions [T] (a fixed-shape step). On a GPU
        a prompt from position 0 that fits the window gets (None, None): plain causal, which
        SDPA runs with its flash kernel (it takes no explicit mask)."""
        window = self.cfg.sliding_window
        if torch.is_tensor(start):
            q = start[:, None]
        elif T == 1:
            return None
        elif start == 0 and torch.device(device).type == "cuda" and (not window or T <= window):
            return None, None
        else:
            q = torch.arange(start, start + T, device=device)[:, None]
        k = torch.arange(start + T if keys is None else keys, device=device)[None, :]
        full = k <= q
        sliding = full & (k > q - window) if window else full
        return full, sliding

    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int | torch.Tensor | None = None,
                last_only: bool = False, keys: int | None = None) -> torch.Tensor:
        """Run tokens [B, T] at positions start.. (default: the cache's length); returns logits.

        The cache is written and advanced. last_only skips the vocab projection for all
        but the last position, which is what prefill needs.
        For CUDA graphs, start may instead be a tensor of the T positions and `keys` a fixed
        number of cache positions to attend over (masked past each token's position); all shapes
        are then fixed, and the caller advances cache.length.
        """
        start = cache.length if start is None else start
        T = tokens.shape[1]
        fixed = torch.is_tensor(start)
        if (keys if fixed else start + T) > cache.max_len:
            raise ValueError(f"sequence of {keys if fixed else start + T} tokens exceeds the cache ({cache.max_len})")
        x = self.model.embed_tokens(tokens)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        if fixed:
            rope = [(c.index_select(0, start), s.index_select(0, start)) for c, s in self.rope]
        else:
            rope = [(c[start:start + T], s[start:start + T]) for c, s in self.rope]
        mask = self._masks(start, T, tokens.device, keys)
        for layer in self.model.layers:
            x = layer(x, rope, cache, start, mask)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.model.norm(x))
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        if not fixed:
            cache.length = start + T
        return logits

    def forward_batch(self, step: PagedStep) -> torch.Tensor:
        """One step of continuous batching: every row's new tokens in one call, K/V in the paged
        pool. Returns logits [M, vocab] for step.logit_rows, in the order of the step's rows."""
        x = self.model.embed_tokens(step.tokens[None])  # [1, N, dim]: the layers see one long row
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        rope = [(c[step.positions], s[step.positions]) for c, s in self.rope]
        for layer in self.model.layers:
            x = layer(x, rope, step, None, None)
        logits = self.lm_head(self.model.norm(x[0, step.logit_rows]))
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits
