"""A CPU model's blocks in one native call per forward pass (quant/kernels/decoder.c).

With brisk's native kernels doing the products, what is left of an eager decode step is ~20 small
torch ops per block (norms, rope, cache writes, attention, residuals, the gate), a few microseconds
of dispatch each: on SmolLM2-135M about as long as the products. decoder.c does all of a block
in C, row by row; this module describes the model to it once (weights, norms, rope tables) and, per
pass, where the rows sit (positions) and where each sequence keeps its K/V (a contiguous cache or a
paged pool, read in place).

A row's result does not depend on the other rows of the pass, so decode steps, speculative
verification (chains and trees), prefill chunks and batched steps all give a token the same bits.
Passes it does not take (a cache indexed by tensor positions, a tree on a paged or batched cache)
run the torch blocks.
"""
from __future__ import annotations

import ctypes

import torch

from .kv import ContiguousKV, PagedStep
from .model import MoE
from ..quant import native


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ffn(model) -> int:
    """The MLP's width as the weights have it (a tensor-parallel rank's part of cfg.ffn_dim)."""
    mlp = model.model.layers[0].mlp
    return model.cfg.ffn_dim if isinstance(mlp, MoE) else mlp.gate_proj.out_features


class NativeDecoder:
    """The structs decoder.c reads for one model (and the tensors they point into, kept alive)."""

    def __init__(self, model, tp=None):
        """tp: a tensor-parallel rank's collectives (tp_shm.Segment), its model a shard (heads and
        MLP width its own, cfg's heads already the rank's)."""
        cfg = model.cfg
        self.tp = tp
        self.arch = native.Arch(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, _ffn(model), cfg.norm_eps,
                                cfg.attn_scale, cfg.qk_norm, cfg.sandwich_norm, native.Arch.ACTS[cfg.act],
                                cfg.n_experts_used, cfg.norm_topk_prob, cfg.expert_ffn_dim, cfg.rotary_dim,
                                cfg.routing == "topk_softmax", cfg.swiglu_limit, cfg.swiglu_alpha)
        self.rope = model.rope  # the tables the structs point into (setup_rope replaces the list)
        self.rope_tables = model.rope_tables  # their rows are computed as positions reach them
        self.n_layers = cfg.n_layers
        self.layers = (native.Layer * cfg.n_layers)()
        self.keep: list = []
        for i, block in enumerate(model.model.layers):
            a, m, L = block.self_attn, block.mlp, self.layers[i]
            for j, p in enumerate((a.q_proj, a.k_proj, a.v_proj)):
                L.qkv[j] = self._weight(p)
            L.o = self._weight(a.o_proj)
            if isinstance(m, MoE):  # the router, then each expert's gate, up and down
                router = native.Weight * 1
                experts = native.Weight * (3 * len(m.experts))
                L.router = self._array(router(self._weight(m.gate)))
                L.experts = self._array(experts(*[self._weight(p) for e in m.experts
                                                  for p in (e.gate_proj, e.up_proj, e.down_proj)]))
                L.n_experts = len(m.experts)
                L.router_bias = self._floats(m.gate.bias)
                L.expert_bias = self._expert_biases(m)
            else:
                L.down = self._weight(m.down_proj)
                L.gate_up[0], L.gate_up[1] = self._weight(m.gate_proj), self._weight(m.up_proj)
            L.q_bias, L.k_bias, L.v_bias, L.o_bias = (self._floats(p.bias) for p in
                                                      (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
            L.sinks = self._floats(a.sinks)
            L.attn_in, L.post_attn = self._norm(block.input_layernorm), self._norm(block.post_attention_layernorm)
            if cfg.sandwich_norm:
                L.pre_ffn = self._norm(block.pre_feedforward_layernorm)
                L.post_ffn = self._norm(block.post_feedforward_layernorm)
            if cfg.qk_norm:
                L.q_norm, L.k_norm = self._norm(a.q_norm), self._norm(a.k_norm)
            cos, sin = model.rope[block.local_rope]
            L.cos, L.sin = cos.data_ptr(), sin.data_ptr()
            L.window = a.window or 0
        self.positions = self.rope[0][0].shape[0]
        # float weights: longer passes (prefill) run the torch blocks, on torch's faster sgemm
        self.max_rows = native.F32_MAX_ROWS if any(L.qkv[0].type == native.F32 for L in self.layers) else None

    @classmethod
    def takes(cls, model, need_rope: bool = True) -> bool:
        """Whether every block of `model` can run natively: products on native kernels, float32
        rope tables on the CPU (need_rope: once setup_rope made them), shapes in whole vectors."""
        cfg = model.cfg
        if not native.available() or any(n % 16 for n in (cfg.dim, cfg.head_dim, _ffn(model))) or cfg.head_dim > 512:
            return False
        if cfg.expert_ffn_dim % 16:
            return False
        if need_rope and (getattr(model, "rope", None) is None or model.rope[0][0].dtype != torch.float32
                          or model.rope[0][0].device.type != "cpu"):
            return False
        for block in model.model.layers:
            a, m = block.self_attn, block.mlp
            mlps = m.experts if isinstance(m, MoE) else [m]
            extra = [m.gate] if isinstance(m, MoE) else []
            for p in [a.q_proj, a.k_proj, a.v_proj, a.o_proj, *extra,
                      *(q for e in mlps for q in (e.gate_proj, e.up_proj, e.down_proj))]:
                if not getattr(p, "native", False) or not hasattr(p, "_native"):
                    return False
        return True

    def _weight(self, layer) -> native.Weight:
        nw = layer._native()
        self.keep.append(nw)
        return nw.desc

    def _array(self, descs) -> int:
        """A ctypes array of weight descriptions, kept alive, as the pointer a bk_layer holds."""
        self.keep.append(descs)
        return ctypes.addressof(descs)

    def _floats(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach().float().contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def _expert_biases(self, moe) -> int | None:
        """Every expert's gate, up and down biases in one array, expert by expert (bk_layer's
        expert_bias; a missing one as zeros), or None where no expert has any."""
        parts = [(p.bias, p.out_features) for e in moe.experts for p in (e.gate_proj, e.up_proj, e.down_proj)]
        if all(b is None for b, _ in parts):
            return None
        return self._floats(torch.cat([torch.zeros(n) if b is None else b.detach().float().reshape(-1)
                                       for b, n in parts]))

    def _norm(self, norm) -> int:
        return self._floats(norm.weight.detach().float() + norm.offset)  # Gemma's (1 + w), as multiplied

    # ------------------------------------------------------------------ a pass
    def run(self, x: torch.Tensor, start, kv, tree) -> torch.Tensor | None:
        """x [B, T, dim] through every block (in place), or None where this pass is not one it takes."""
        if x.dtype != torch.float32:
            return None
        B, T, _ = x.shape
        if self.max_rows is not None and B * T > self.max_rows:
            return None
        if tree is not None:
            if not isinstance(kv, ContiguousKV) or not isinstance(start, int) or B != 1 or self._contiguous(kv) is None:
                return None
            cache, pos, table = self._tree(kv, start, tree)
        elif isinstance(kv, ContiguousKV) and isinstance(start, int):
            cache = self._contiguous(kv)
            if cache is None:
                return None
            pos = torch.arange(start, start + T, dtype=torch.int32).repeat(B)
            table = torch.arange(B, dtype=torch.int32).repeat_interleave(T)
        elif isinstance(kv, PagedStep) and B == 1 and kv.kv.k.shape[0] == self.n_layers \
                and self._fits(kv.kv.k[0], kv.kv.type, token_major=True):
            cache, pos, table = self._paged(kv)
        else:
            return None
        end = int(pos.max()) + 1
        if end > self.positions:
            return None  # past the rope tables: the torch blocks say so
        self.rope_tables.ready(end)
        x = x.contiguous()
        rc = native.library().bk_decoder(self.arch, self.layers, self.n_layers, cache, B * T, pos.data_ptr(),
                                         table.data_ptr(), x.data_ptr(), self.tp and self.tp.desc, native.level())
        if rc in (native.TP.GONE, native.TP.TIMEOUT) and self.tp:
            raise self.tp.failure(rc)
        if rc:
            raise RuntimeError(f"native decoder failed ({'out of memory' if rc == -2 else 'shapes'})")
        return x

    def _fits(self, k: torch.Tensor, kind, token_major: bool = False) -> bool:
        """Whether a layer's cache tensor holds this model's K/V as stored by `kind` (a KVType)
        ([.., KV, len, D], or [.., len, KV, D] token-major)."""
        heads = k.shape[-2] if token_major else k.shape[-3]
        return k.dtype == kind.storage and k.device.type == "cpu" and k.is_contiguous() and \
            heads == self.arch.n_kv and k.shape[-1] == kind.row_width(self.arch.head_dim)

    def _contiguous(self, kv: ContiguousKV) -> native.Cache | None:
        """A contiguous cache's description, made once per cache: one block of max_len per sequence."""
        made = kv.__dict__.get("_native_cache")
        if made is None:
            k0 = kv.k[0]  # [B, KV, max_len, D as stored]
            if len(kv.k) != self.n_layers or not self._fits(k0, kv.type) or \
                    not all(t.is_contiguous() for t in kv.k + kv.v):
                return None  # not this model's cache as decoder.c reads it: the torch blocks run
            ks = (ctypes.c_void_p * len(kv.k))(*[t.data_ptr() for t in kv.k])
            vs = (ctypes.c_void_p * len(kv.v))(*[t.data_ptr() for t in kv.v])
            tables = torch.arange(k0.shape[0], dtype=torch.int32)
            _, n_kv, max_len, W = k0.shape
            row = W * k0.element_size()  # bytes of one (position, head)
            c = native.Cache(ctypes.addressof(ks), ctypes.addressof(vs), tables.data_ptr(), max_len,
                             n_kv * max_len * row, row, max_len * row, kv.type.native)
            made = kv.__dict__["_native_cache"] = (c, ks, vs, tables)
        return made[0]

    def _tree(self, kv: ContiguousKV, start: int, tree: torch.Tensor):
        """A tree step on a contiguous cache as decoder.c's block tables, one slot per block: row i
        (at position start + depth) reads positions 0..start-1 from their own slots and each later
        position p from the slot of its ancestor at depth p - start. Its attention then runs over
        exactly the keys a chain of its path would see, in the same order: the same bits as decoding
        that path token by token (which is what keeps greedy tree speculation exact)."""
        _, ks, vs, _ = kv.__dict__["_native_cache"]
        T = tree.shape[0]
        tree = tree.cpu()
        depth = tree.sum(1) - 1
        # each row's ancestors (itself included) in index order, which is depth order: a parent
        # comes before its children; the columns past a row's depth are never read
        order = torch.where(tree, torch.arange(T), T).sort(dim=1).values[:, :int(depth.max()) + 1]
        width = start + order.shape[1]
        tables = torch.empty(T, width, dtype=torch.int32)
        tables[:, :start] = torch.arange(start, dtype=torch.int32)
        tables[:, start:] = start + order.clamp(max=T - 1)
        _, n_kv, max_len, W = kv.k[0].shape
        row = W * kv.k[0].element_size()
        c = native.Cache(ctypes.addressof(ks), ctypes.addressof(vs), tables.data_ptr(), 1, row, 0, max_len * row,
                         kv.type.native)
        c._keep = tables  # noqa: SLF001 (alive as long as the struct)
        pos = (start + depth).to(torch.int32)
        return c, pos, torch.arange(T, dtype=torch.int32) * width

    def _paged(self, step: PagedStep):
        """A paged step's rows: their block tables (decode rows' padded ones, then each prefill's)."""
        pool = step.kv
        L, _, bs, n_kv, W = pool.k.shape
        row = W * pool.k.element_size()  # bytes of one (position, head)
        made = pool.__dict__.get("_native_cache")
        if made is None:
            ks = (ctypes.c_void_p * L)(*[pool.k[i].data_ptr() for i in range(L)])
            vs = (ctypes.c_void_p * L)(*[pool.v[i].data_ptr() for i in range(L)])
            made = pool.__dict__["_native_cache"] = (ks, vs)
        ks, vs = made
        parts, table = [], torch.empty(step.tokens.shape[0], dtype=torch.int32)
        n = 0
        if step.n_decode:
            width = step.decode_blocks.shape[1]
            parts.append(step.decode_blocks.reshape(-1))
            table[:step.n_decode] = torch.arange(step.n_decode, dtype=torch.int32) * width
            n = step.n_decode * width
        for s, T, _, blocks in step.prefills:
            parts.append(blocks)
            table[s:s + T] = n
            n += len(blocks)
        tables = torch.cat(parts).to(torch.int32).contiguous()
        c = native.Cache(ctypes.addressof(ks), ctypes.addressof(vs), tables.data_ptr(), bs, bs * n_kv * row,
                         n_kv * row, row, pool.type.native)
        c._keep = tables  # noqa: SLF001 (alive as long as the struct)
        return c, step.positions.to(torch.int32), table
