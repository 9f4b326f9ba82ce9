"""The transformer: every architecture of core/arch in one implementation, switched by ModelConfig
flags (q/k norms and biases, sandwich norms, GeGLU, sliding windows, partial rotary, mixtures of
experts, gpt-oss's attention sinks and clamped SwiGLU). Module and parameter names follow Hugging Face's Llama and Qwen3-MoE ones, so their
state dicts load as they are (each architecture module maps its own names onto these).

Plain torch modules: one forward for every use. The caller says where the tokens sit (their
positions) and hands a KV object (core/kv), which stores each layer's keys and values and runs
its attention: a contiguous cache, a paged one, or none. Faster kernels for a device (BLAS
matmuls, fused Triton ops, quantized layers) are swapped in from outside by the loader's passes
(kernel_passes.py), never chosen in here.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv.base import KV, tree_positions

LAST = slice(-1, None)  # logit_rows for prefill: only the last position's logits


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written out: on the CPU this is fewer dispatches than F.rms_norm's decomposition.
        xf = x.float()
        y = xf * (xf * xf).sum(-1, keepdim=True).mul_(1.0 / x.shape[-1]).add_(self.eps).rsqrt_()
        if self.offset == 0.0:  # Llama casts back before scaling, Gemma after
            return self.weight * y.to(x.dtype)
        return (y * (self.offset + self.weight.float())).to(x.dtype)


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict | None, max_len: int = 0) -> torch.Tensor:
    # float(): config.json may give an integer, and torch cannot take one past int64 (2**64)
    inv = 1.0 / float(theta) ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    if scaling and scaling.get("rope_type") == "longrope":
        # Phi-3: per-frequency factors, the long ones when the context passes the pretrained one
        # (as llama.cpp picks them by context; transformers by the sequence's length)
        long = max_len > scaling["original_max_position_embeddings"]
        return (inv / torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)).float()
    if scaling and scaling.get("rope_type") == "yarn":
        # YaRN: high frequencies (many turns within the pretrained context) kept, low ones divided
        # by the factor, a linear ramp over the dimensions in between
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

        def dim_of(turns):  # the dimension whose frequency turns `turns` times over old_len
            return rot_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = dim_of(scaling.get("beta_fast", 32.0)), dim_of(scaling.get("beta_slow", 1.0))
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rot_dim - 1)
        ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        return (inv / factor * ramp + inv * (1 - ramp)).float()
    if scaling:  # llama3: stretch low frequencies, keep high ones, blend in between
        factor, lo, hi = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen - lo) / (hi - lo)).clamp(0, 1)
        inv = (1 - smooth) * inv / factor + smooth * inv
    return inv.float()


def rope_tables(inv_freq: torch.Tensor, max_len: int, scale: float = 1.0,
                start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [max_len - start, D] at positions start..max_len."""
    t = torch.arange(start, max_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # rotate-half layout, as HF stores q/k
    # The first half of sin carries rotate-half's minus sign, so rope is roll + 2 mul + add.
    # scale: longrope's attention factor, which multiplies both tables.
    cos, sin = emb.cos(), torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
    return (cos, sin) if scale == 1.0 else (cos * scale, sin * scale)


class RopeTables:
    """A model's rope tables (cos, sin) [max_len, D] each, global then (Gemma) local. On the CPU they
    live in anonymous memory and their rows are computed as positions reach them (ready): a short
    answer reads a few rows of tables sized for the whole context (Gemma 3: 16 MiB at 4096).
    Computed a stretch at a time or all at once, the rows are the same bits (tests/test_load_memory.py)."""

    ROWS = 256  # rows computed at a time, as positions reach them

    def __init__(self, sources: list[tuple[torch.Tensor, float]], max_len: int, device, dtype: torch.dtype):
        device = torch.device(device)
        self.sources, self.max_len = sources, max_len  # (inv_freq, scale) per table
        if device.type != "cpu":  # read by kernels and captured graphs: all rows now
            self.tables = [(c.to(device, dtype), s.to(device, dtype))
                           for c, s in (rope_tables(inv, max_len, scale) for inv, scale in sources)]
            self.rows = max_len
            return
        from .anonymous_memory import anonymous_bytes

        width, size = sources[0][0].numel() * 2, torch.empty((), dtype=dtype).element_size()
        self.tables = [tuple(anonymous_bytes(max_len * width * size).view(dtype).view(max_len, width)
                             for _ in range(2)) for _ in sources]
        self.rows = 0  # rows computed so far

    def ready(self, end: int) -> None:
        """Compute the rows below `end` not yet computed (a stretch of ROWS at least)."""
        if end <= self.rows:
            return
        start, end = self.rows, min(self.max_len, -(-end // self.ROWS) * self.ROWS)
        for (c, s), (inv, scale) in zip(self.tables, self.sources):
            cos, sin = rope_tables(inv, end, scale, start)
            c[start:end].copy_(cos)
            s[start:end].copy_(sin)
        self.rows = end  # after the rows are written: another thread that sees it reads them


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos/sin: [T, D]. rotate_half(x) = (-x2, x1) = roll(x) * (-1, +1).
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.scale = layer, cfg.attn_scale
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attn_sinks else None
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_offset)
        self.window = cfg.sliding_window if cfg.layer_types[layer] == "sliding" else None
        self.rot = cfg.rotary_dim  # rope turns the first `rot` dimensions of each head, the rest pass

    def forward(self, x, cos, sin, kv: KV):
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        y = kv.attend(self.layer, q, k, v, self.window, self.scale, self.sinks)  # [B, T, H, D]
        return self.o_proj(y.reshape(B, T, -1))

    def project(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def rotate(self, x, cos, sin):
        if self.rot != self.head_dim:
            return torch.cat([apply_rope(x[..., :self.rot], cos, sin), x[..., self.rot:]], dim=-1)
        return apply_rope(x, cos, sin)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn_dim: int | None = None, bias: bool = False):
        super().__init__()
        ffn_dim = ffn_dim or cfg.ffn_dim
        self.gate_proj = nn.Linear(cfg.dim, ffn_dim, bias=bias)
        self.up_proj = nn.Linear(cfg.dim, ffn_dim, bias=bias)
        self.down_proj = nn.Linear(ffn_dim, cfg.dim, bias=bias)
        self.act, self.limit, self.alpha = cfg.act, cfg.swiglu_limit, cfg.swiglu_alpha

    def forward(self, x):
        return self.down_proj(self.activate(self.gate_proj(x), self.up_proj(x)))

    def activate(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The gated activation of gate and up projections."""
        if self.act == "swiglu_clamp":  # gpt-oss: both halves clamped, a sharper sigmoid, up shifted by 1
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
            return g * torch.sigmoid(g * self.alpha) * (u + 1)
        g = F.gelu(g, approximate="tanh") if self.act == "gelu_tanh" else F.silu(g)
        return g * u


class Router(nn.Linear):
    """An MoE layer's router, dim -> experts: never quantized (a token's choice of experts must not
    move with the weights' rounding); a device pass may still give it a faster float kernel."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.dim, cfg.n_experts, bias=cfg.router_bias)


class MoE(nn.Module):
    """A mixture of experts: each token's output is the weighted sum of its top-k experts' MLPs.

    Only the experts some token chose run, each on its tokens alone, so a step reads the active
    experts' weights and no others. A token's weights and its experts' sum (added in expert order)
    depend on that token alone, never on which other tokens share the pass; the expert products do
    as much as any product over a varying number of rows (the native kernels give each row the
    same bits)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg, cfg.expert_ffn_dim, cfg.expert_bias) for _ in range(cfg.n_experts))
        self.top_k, self.renormalize = cfg.n_experts_used, cfg.norm_topk_prob
        self.softmax_of_top = cfg.routing == "topk_softmax"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] float32, experts [N, k]) of rows x [N, dim]: softmax, then the top k
        (or gpt-oss's top k logits, then their softmax)."""
        logits = self.gate(x).float()
        if self.softmax_of_top:
            top, experts = logits.topk(self.top_k, dim=-1)
            return top.softmax(dim=-1), experts
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if x.shape[0] == 1:  # a decode step: its k experts straight, the same adds in the same order
            chosen, slots = experts[0].sort()
            for e, slot in zip(chosen.tolist(), slots.tolist()):
                out += self.experts[e](x).float() * weights[:, slot, None]
            return out.to(x.dtype).reshape(shape)
        for e in experts.unique().tolist():  # ascending: each token adds its experts in the same order
            rows, slot = (experts == e).nonzero(as_tuple=True)
            y = self.experts[e](x.index_select(0, rows)).float()
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out.to(x.dtype).reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        # In Llama this norm feeds the MLP; in Gemma it normalizes the attention output.
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.local_rope = cfg.rope_local_theta is not None and cfg.layer_types[layer] == "sliding"

    def forward(self, x, rope, kv: KV):
        """rope: the (cos, sin) tables at the tokens' positions, global and (Gemma) local."""
        a = self.self_attn(self.input_layernorm(x), *rope[self.local_rope], kv)
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
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope_factors: torch.Tensor | None = None  # GGUF llama3 models store these as a tensor

    def setup_rope(self, max_len: int, device) -> None:
        """Precompute cos/sin tables; call after weights are loaded (they are not in the checkpoint)."""
        cfg = self.cfg
        inv = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, max_len)
        if self.rope_factors is not None:
            inv = inv / self.rope_factors.float().cpu()
        scale = (cfg.rope_scaling or {}).get("attention_factor", 1.0)
        sources = [(inv, scale)]
        if cfg.rope_local_theta is not None:
            sources.append((rope_inv_freq(cfg.rotary_dim, cfg.rope_local_theta, None), 1.0))
        dtype = self.model.norm.weight.dtype  # norms stay float when the embedding is quantized
        self.rope_tables = RopeTables(sources, max_len, device, dtype)
        self.rope = self.rope_tables.tables
        self.max_len = max_len

    def rope_at(self, positions: int | torch.Tensor, T: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The rope tables [T, D] at positions start.. (int) or at a tensor's positions."""
        if torch.is_tensor(positions):
            if self.rope_tables.rows < self.max_len and positions.numel():
                self.rope_tables.ready(int(positions.max()) + 1)
            return [(c.index_select(0, positions), s.index_select(0, positions)) for c, s in self.rope]
        self.rope_tables.ready(positions + T)
        return [(c[positions:positions + T], s[positions:positions + T]) for c, s in self.rope]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def blocks(self, x: torch.Tensor, start: int | torch.Tensor, kv: KV, tree: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, dim] through every block (a device pass may run them all at once)."""
        T = x.shape[1]
        rope = self.rope_at(start if tree is None else tree_positions(start, tree), T)
        for layer in self.model.layers:
            x = layer(x, rope, kv)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits_of(self.model.norm(x))

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of final-norm hidden states."""
        logits = self.lm_head(hidden)
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits

    def forward(self, tokens: torch.Tensor, start: int | torch.Tensor, kv: KV, tree: torch.Tensor | None = None,
                logit_rows: slice | torch.Tensor | None = None, return_hidden: bool = False):
        """Logits for tokens [B, T] at positions start..start+T-1 (start an int), or at the positions
        of a tensor [T]; `kv` stores their keys and values and runs attention (see core/kv).

        tree [T, T] (with an int start): the tokens are a tree of candidates in the T slots after
        start, token i at position start + depth(i), seeing its ancestors only.
        logit_rows: which positions' logits to compute (LAST for prefill; None: all).
        return_hidden: return (logits, hidden), hidden the final norm's output [B, rows, dim] of
        the same rows, what the output head reads (draft heads predict from it).
        """
        kv.begin(start, tokens.shape[1], tree)
        x = self.blocks(self.embed(tokens), start, kv, tree)
        if logit_rows is not None:
            x = x[:, logit_rows]
        if not return_hidden:
            return self.head(x)
        hidden = self.model.norm(x)
        return self.logits_of(hidden), hidden
