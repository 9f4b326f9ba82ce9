"""LLM: a loaded model, its tokenizer and where it runs. The entry point of the Python API."""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from . import progress
from .checkpoint import Checkpoint, load_checkpoint
from .config import DEFAULT_CTX
from .device import cpu_threads, pick_device, pick_dtype, share_cpu_threads, use_one_thread_pool
from .errors import BriskError, FileError, InvalidValue, PromptTooLong
from .kernel_passes import apply_device_kernels
from .load_options import QUANTIZE_CHOICES, check_quantize, check_tp  # noqa: F401  (QUANTIZE_CHOICES: also imported from here)
from .kv import ContiguousKV
from .kv import kv_type as kv_types
from .kv.kv_type import KVType
from .model import MoE, Router, Transformer
from ..quant import gguf_blocks, native
from ..quant.gguf_linear import GGUFLinear
from ..quant.linear import Int4Linear, Int8Linear, QuantEmbedding, QuantLinear, quantize_linear, replace_modules


@dataclass
class LoadInfo:
    seconds: float
    param_bytes: int
    file_bytes: int
    step_bytes: int  # the weight bytes a decode step reads: all but the experts a token is not routed to


class LLM:
    def __init__(self, model: Transformer, tokenizer, ckpt: Checkpoint, device: torch.device,
                 dtype: torch.dtype, ctx: int, load_info: LoadInfo, kv_type: KVType | None = None):
        self.model, self.tokenizer, self.checkpoint = model, tokenizer, ckpt
        self.config = model.cfg
        self.device, self.dtype, self.ctx, self.load_info = device, dtype, ctx, load_info
        self.kv_type = kv_type or kv_types.of_dtype(dtype)  # how its caches store K and V (--kv-type)
        self.name = ckpt.name
        self.quantization = describe_quantization(model)
        self.eos_ids = set(tokenizer.eos_ids)  # includes generation_config.json's eos_token_id
        tokenizer.fit_rows(self.config.vocab_size, ckpt.name)

    @classmethod
    def load(cls, model: str | None = None, device: str = "auto", dtype: str = "auto",
             ctx: int | None = None, quantize: str = "auto", kv_type: str = "auto", tp: int = 1) -> "LLM":
        """quantize: "auto" runs a checkpoint as it is stored (a GGUF's Q4_0/Q4_1/Q4_K/Q8_0 weights stay
        quantized, a GPTQ/AWQ/bitsandbytes checkpoint stays in its format, a float one stays float);
        "none" widens everything to `dtype`; int8/int4/nf4 quantize float layers at load.
        kv_type: how caches store K and V, auto | f32 | f16 | bf16 | q8_0 (core/kv/kv_type.py).
        tp: ranks of tensor parallelism (core/tensor_parallel.py); on a rank other than 0 (a
        follower, or torchrun's RANK > 0) this runs rank 0's passes and exits, never returning."""
        check_quantize(quantize)
        kv_types.check_kv_type(kv_type)
        check_tp(tp)
        t0 = time.perf_counter()
        dev = pick_device(device)
        dt = pick_dtype(dtype, dev)
        kv = kv_types.resolve(kv_type, dt, dev)
        # int8/int4 keep a GGUF's blocks too: the layers already of that width stay as they are, the
        # others are converted one layer at a time (never the whole model in float)
        # under --tp a GGUF's kept blocks stay in the file's layout: each rank interleaves its shard only
        ckpt = load_checkpoint(model, keep_quantized=quantize in ("auto", "int8", "int4"),
                               native_blocks=dev.type == "cpu" and native.available(), interleave=tp == 1)
        if ckpt.quant_config and quantize != "auto":
            raise BriskError(f"{ckpt.name} is already quantized ({ckpt.quant_config.get('quant_method', '?')}); "
                             "--quantize applies to float and GGUF checkpoints")
        kv.check_head_dim(ckpt.config.head_dim)
        group = None
        if tp > 1:
            from . import tensor_parallel

            tensor_parallel.check_load(ckpt, tp, quantize)
            if dev.type == "cpu":  # the ranks on this host (torchrun's local ones) share its cores
                share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", tp)))
            group = tensor_parallel.start(tp, dict(model=model, device=device, dtype=dtype, ctx=ctx,
                                                   quantize=quantize, kv_type=kv_type, tp=tp, threads=cpu_threads()))
            if dev.type == "cuda":
                dev = torch.device("cuda", torch.cuda.current_device())
        cut = tensor_parallel.cut_checkpoint(ckpt, group) if group is not None else set()
        net = build_model(ckpt, dev, dt)
        if group is not None:
            tensor_parallel.shard(net, group, quantize, cut)
        if quantize in ("int8", "int4", "nf4"):
            quantize_at_load(net, quantize, embedding_from_head=group is None)
        if group is not None:
            tensor_parallel.connect(net)
        apply_device_kernels(net, dev)  # last: after every layer has its final kind
        if dev.type == "cpu":
            use_one_thread_pool(any(getattr(m, "native", False) for m in net.modules()))
        ctx = min(ctx or DEFAULT_CTX, ckpt.config.max_seq_len)
        if ctx < 16:
            raise InvalidValue("ctx", ctx, "", template=f"{{option}} {ctx}: too small")
        net.setup_rope(ctx, dev)
        held = model_bytes(net)
        info = LoadInfo(time.perf_counter() - t0, held, ckpt.file_bytes, held - idle_expert_bytes(net))
        ckpt.tensors, ckpt.modules = {}, {}  # the model owns the weights now (a TP rank: its shard alone)
        if group is not None and group.rank != 0:
            tensor_parallel.follow_and_exit(net, ckpt.config.head_dim)
        return cls(net, ckpt.tokenizer, ckpt, dev, dt, ctx, info, kv)

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> ContiguousKV:
        cfg, w = self.config, self.model.model.norm.weight  # the activations' dtype and device
        return ContiguousKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_len or self.ctx, w.dtype, w.device,
                            batch, self.kv_type)

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits for every position of ids, from a fresh cache (tests, eval)."""
        return self.model(torch.tensor([ids], device=self.device), 0, self.new_cache(max(len(ids), 1)))[0].float()


    # ------------------------------------------------------------ convenience API

    def prompt_ids(self, prompt: str, raw: bool = False, system: str | None = None) -> list[int]:
        """Token ids for a one-shot prompt: through the chat template unless raw or there is none."""
        if not prompt.strip():
            raise BriskError("the prompt is empty")
        tok = self.tokenizer
        if system is not None and (raw or not tok.has_chat_template):  # it would be dropped without a word
            raise BriskError("a system message needs the chat template: " +
                             ("--raw leaves it out" if raw else f"{self.name} has none (a base model?)"))
        if raw or not tok.has_chat_template:
            return self._encode_within_context(prompt, True, "prompt")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self._encode_within_context(tok.apply_chat_template(messages, add_generation_prompt=True), False,
                                           "prompt as the chat template renders it")

    def _encode_within_context(self, text: str, add_special: bool, what: str) -> list[int]:
        """The text's ids. Text far longer than the context (a 50 MB file) is not tokenized whole,
        which takes gigabytes: when its head alone fills the context, it is refused as too long."""
        head = self.ctx * MAX_CHARS_PER_TOKEN
        if len(text) > head:
            ids = self.tokenizer.encode(text[:head], add_special=add_special)
            if len(ids) >= self.ctx:
                raise PromptTooLong(len(ids), self.ctx, what=f"{what} ({len(text)} characters; its first {head} alone)")
        return self.tokenizer.encode(text, add_special=add_special)

    def stream(self, prompt: str, sampling=None, max_tokens: int = 256, stop=(), raw: bool = False,
               session=None):
        """Yield the answer's text pieces; the GenerationResult is in session.last afterwards."""
        from .generate import Session
        from .sampling import SamplingParams

        session = session or Session(self)
        yield from session.stream(self.prompt_ids(prompt, raw), sampling or SamplingParams(), max_tokens, stop)

    def generate(self, prompt: str, sampling=None, max_tokens: int = 256, stop=(), raw: bool = False):
        from .generate import Session

        session = Session(self)
        for _ in self.stream(prompt, sampling, max_tokens, stop, raw, session):
            pass
        return session.last

# More characters than any vocabulary's tokens hold on average: text beyond ctx times this cannot fit
MAX_CHARS_PER_TOKEN = 64


def build_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> Transformer:
    """Build on the meta device, then hand each tensor over once (no second full copy).
    Layers the checkpoint stores quantized (GGUF blocks, GPTQ/AWQ/bitsandbytes tensors) are put in
    place as quantized modules first; the float rest loads as an ordinary state dict."""
    cfg = ckpt.config
    with torch.device("meta"):
        net = Transformer(cfg)
    tensors = ckpt.tensors
    _place_quantized(net, ckpt)
    if "embed_layer" in ckpt.extra:  # an untied quantized table: lookups dequantize the rows they need
        net.model.embed_tokens = QuantEmbedding(ckpt.extra.pop("embed_layer"), dtype, owner=True)
    elif cfg.tie_embeddings or ("lm_head.weight" not in tensors and not isinstance(net.lm_head, QuantLinear)):
        if not cfg.tie_embeddings and ckpt.kind == "hf":  # transformers would start a random head
            raise FileError("checkpoint lacks lm_head.weight, and config.json says tie_word_embeddings: false", ckpt.name)
        if isinstance(net.lm_head, QuantLinear):  # tied and quantized: look embeddings up in the head
            net.model.embed_tokens = QuantEmbedding(net.lm_head, dtype)
        elif "model.embed_tokens.weight" not in tensors:
            raise FileError("checkpoint has no embedding weights", ckpt.name)
        else:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    targets = net.state_dict()
    expected = {k for k, v in targets.items() if v.is_meta}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise FileError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[0]}", ckpt.name)
    state = {}
    converted: dict[int, torch.Tensor] = {}
    for k in expected:
        # Popped: each source is freed once converted (a float32 copy is not held next to the
        # model until the load ends). Sources all exist before the loop, so ids cannot collide.
        t = tensors.pop(k)
        if targets[k].is_floating_point() and not t.is_floating_point():  # integers would be taken as the weights
            raise FileError(f"tensor {k} is {str(t.dtype).removeprefix('torch.')}, not a floating-point type", ckpt.name)
        key = id(t)
        if key not in converted:  # tied weights stay shared
            converted[key] = t.to(device=device, dtype=dtype)
        state[k] = converted[key]
        del t
    if tensors:  # what the architecture does not read: a sign of the wrong config or a mixed folder
        names = sorted(tensors)
        warnings.warn(f"{ckpt.name}: {len(names)} tensors are not used by {cfg.arch}: {', '.join(names[:5])}"
                      f"{', ...' if len(names) > 5 else ''}")
    try:
        net.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        raise FileError(f"weights do not match config.json ({str(e).splitlines()[-1].strip()})", ckpt.name) from None
    if "rope_freqs" in ckpt.extra:
        net.rope_factors = ckpt.extra["rope_freqs"]
    if cfg.tie_embeddings and not isinstance(net.lm_head, QuantLinear):
        net.lm_head.weight = net.model.embed_tokens.weight
    for m in net.modules():
        if isinstance(m, QuantLinear):
            m.to(device)
    _exact_top_logits(net)
    return net.eval().requires_grad_(False)


def _exact_top_logits(net: Transformer) -> None:
    """A quantized output layer recomputes its top logits in float32 (QuantLinear.refine)."""
    if isinstance(net.lm_head, QuantLinear):
        net.lm_head.refine_top = 64


def _place_quantized(net: Transformer, ckpt: Checkpoint) -> None:
    modules = dict(ckpt.modules)
    if ckpt.quant_config:
        from ..quant.formats import FormatError, load_quantized_linears

        try:
            load_quantized_linears(net, ckpt.tensors, ckpt.quant_config)
        except FormatError as e:
            raise FileError(str(e), ckpt.name) from None
    replace_modules(net, lambda name, m: modules.get(name))


def quantize_at_load(net: Transformer, method: str, embedding_from_head: bool = True) -> None:
    """--quantize int8|int4|nf4: every linear layer to that format, in place. Float layers are
    quantized; for int8/int4, layers a GGUF stored at the other width go through float one at a
    time, and those already of the format stay. The output layer is quantized too (a fifth of a
    small model's bytes); when it is tied to the embedding, lookups then read the quantized head
    (which keeps its int4 codes for that) and the float table is dropped. embedding_from_head
    False: the embedding is left as it is (a tensor-parallel shard's head holds part of the vocabulary)."""
    if method == "nf4":
        from ..quant.bnb_format import NF4Linear

        # the head stays float (no NF4 kernel on the CPU), and MoE routers always do
        replace_modules(net, lambda name, m: NF4Linear.from_float(m) if name != "lm_head" and _quantizable(m) else None)
        return
    tied = net.cfg.tie_embeddings and embedding_from_head
    want = Int4Linear if method == "int4" else Int8Linear

    def convert(name, m):
        if isinstance(m, want) or not _quantizable(m):
            return None
        if isinstance(m, GGUFLinear) and gguf_blocks.fits(m.qtype, m.in_features):
            # a GGUF's 4-bit blocks carry over into int4 exactly (Q8_0 into int8 per row), no float copy
            layer = gguf_blocks.to_layer(m.file_blocks().numpy(), m.out_features, m.in_features, m.qtype)
            if isinstance(layer, want):
                if tied and name == "lm_head" and isinstance(layer, Int4Linear):
                    layer.keep_codes = True
                return layer
        source = SimpleNamespace(weight=m.dequantize(torch.float32), bias=m.bias) if isinstance(m, QuantLinear) else m
        layer = quantize_linear(source, method, 32, keep_codes=tied and name == "lm_head")
        return None if layer is source else layer  # a layer the method cannot take stays as it is

    total = sum(_quantizable(m) for m in net.modules())
    done = 0

    def counted(name, m):
        nonlocal done
        if not _quantizable(m):
            return None
        layer = convert(name, m)
        done += 1
        progress.report(f"quantizing to {method}", done, total)
        return layer

    replace_modules(net, counted)
    if tied and isinstance(net.lm_head, QuantLinear):
        net.model.embed_tokens = QuantEmbedding(net.lm_head, net.model.norm.weight.dtype)
    _exact_top_logits(net)


def _quantizable(m: nn.Module) -> bool:
    """A linear layer --quantize converts: every one but an MoE router."""
    return isinstance(m, (nn.Linear, QuantLinear)) and not isinstance(m, Router)


def model_bytes(net: torch.nn.Module) -> int:
    """Bytes of weights held: parameters and persistent buffers (quantized codes, scales), each once."""
    seen, total = set(), 0
    for t in list(net.parameters()) + [b for _, b in net.named_buffers() if b is not None]:
        if t.is_meta or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def idle_expert_bytes(net: Transformer) -> int:
    """The expert weights a decode step does not read (those of the experts not routed to)."""
    cfg = net.cfg
    experts = sum(model_bytes(m.experts) for m in net.modules() if isinstance(m, MoE))
    return round(experts * (1 - cfg.n_experts_used / cfg.n_experts)) if cfg.n_experts else 0


def describe_quantization(net: torch.nn.Module) -> str:
    """A short word for tables: "none", or the weight formats in use, e.g. "int4+int8", "gptq-4bit"."""
    kinds = sorted({_format_word(m) for m in net.modules() if isinstance(m, QuantLinear)})
    return "+".join(kinds) if kinds else "none"


def _format_word(layer: QuantLinear) -> str:
    name = type(layer).__name__
    if name in ("GPTQLinear", "AWQLinear"):
        return f"{name[:-6].lower()}-{layer.bits}bit"
    if name == "NF4Linear":
        return layer.quant_type
    if name == "GGUFLinear":
        return layer.type_name.lower()
    return name.removesuffix("Linear").lower()  # Int4Linear -> int4, Int8Linear -> int8
