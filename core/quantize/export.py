"""The output folder in the format the ecosystem reads: which format module writes the linears,
the quantization_config that names it, and the folder assembled from the finished blocks (the
embeddings, norms and lm_head stay float, as GPTQModel and AutoAWQ leave them, unless --embedding int8
asks for brisk's int8 table: quant/embedding_format.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ...quant import embedding_format
from .. import hf_export
from ..arch import by_name
from .options import QuantOptions
from .resume import load_layer


def choose_format(opts: QuantOptions, dtype: torch.dtype):
    """The format module (quant/*_format.py) and the quantization_config for config.json."""
    if opts.method == "gptq":
        from ...quant import gptq_format as fmt

        return fmt, fmt.quantization_config(bits=opts.bits, group_size=opts.group_size, sym=opts.sym,
                                            desc_act=opts.act_order, damp=opts.damp,
                                            dynamic={p: {"bits": b, **({"sym": True} if b == 8 else {})}
                                                     for p, b in opts.dynamic or ()})
    if opts.method == "awq":
        from ...quant import awq_format as fmt

        return fmt, fmt.quantization_config(bits=opts.bits, group_size=opts.group_size)
    from ...quant import bnb_format as fmt

    return fmt, fmt.quantization_config(opts.method, double_quant=bool(opts.double_quant), blocksize=64,
                                        compute_dtype=str(dtype).removeprefix("torch."), skip_modules=["lm_head"])


def assemble(net, cfg, ckpt, config, qcfg, opts, dtype, partial: Path, max_shard_bytes: int,
             table: dict | None = None) -> None:
    """partial/output: config.json (+ quantization_config), shards, tokenizer, generation config.
    table: the 8-bit embedding's tensors (embedding_format.quantize_table), else the table is written 16-bit."""
    dest = partial / "output"
    if dest.exists():
        shutil.rmtree(dest)  # from a run that died while writing
    dest.mkdir()
    tensors = dict(table) if table is not None else {"model.embed_tokens.weight": net.model.embed_tokens.weight.to(dtype)}
    for i in range(cfg.n_layers):
        tensors.update(load_layer(partial, i))
    tensors["model.norm.weight"] = net.model.norm.weight.to(dtype)
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = net.lm_head.weight.to(dtype)
    hf_export.write_shards(dest, by_name(cfg.arch).export_tensors(tensors), max_shard_bytes)
    extra = {embedding_format.CONFIG_KEY: embedding_format.config_entry()} if table is not None else {}
    hf_export.write_json(dest / "config.json", {**config, "quantization_config": qcfg, **extra})
    if opts.method == "gptq":  # the older AutoGPTQ loaders read it from here
        hf_export.write_json(dest / "quantize_config.json", qcfg)
    hf_export.write_tokenizer(ckpt, dest)
    hf_export.write_generation_config(ckpt, dest)
