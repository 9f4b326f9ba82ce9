"""LLM.load's options checked by their values alone, without torch: a wrong --device, --dtype,
--quantize or --threads, or a model that is not there, fails at once, before the stack that loads
the model is imported (core/device.py and core/llm.py raise the same errors from here)."""
from __future__ import annotations

from .errors import InvalidValue
from .model_path import is_hub_id, resolve_local

QUANTIZE_CHOICES = ("auto", "none", "int8", "int4", "nf4")
DTYPE_NAMES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
# The KV cache's types (kv/kv_type.py builds its table from these), in the order of bk_cache.type's
# ids (quant/kernels/bk_decoder.h)
KV_TYPE_NAMES = ("f32", "f16", "bf16", "q8_0")
KV_TYPE_CHOICES = ("auto", *KV_TYPE_NAMES)


def check_device(name: str) -> None:
    if name not in ("auto", "cpu") and not name.startswith("cuda"):
        raise InvalidValue("device", name, "must be auto, cpu or cuda")


def check_dtype(name: str) -> None:
    if name != "auto" and name not in DTYPE_NAMES:
        raise InvalidValue("dtype", name, "must be auto, float32, bfloat16 or float16")


def check_quantize(name: str) -> None:
    if name not in QUANTIZE_CHOICES:
        raise InvalidValue("quantize", name, "", template=f"{{option}} {name!r}: use one of {', '.join(QUANTIZE_CHOICES)}")


def check_kv_type(value: str) -> str:
    """The --kv-type value as named (lower case), or InvalidValue naming the choices."""
    name = str(value).strip().lower()
    if name not in KV_TYPE_CHOICES:
        raise InvalidValue("kv_type", value, "", template=f"{{option}} {value!r}: use one of {', '.join(KV_TYPE_CHOICES)}")
    return name


def check_threads(n: int | None) -> None:
    if n is not None and n < 1:
        raise InvalidValue("threads", n, "must be at least 1")


def check_tp(tp: int) -> None:
    """--tp N: a rank count."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise InvalidValue("tp", tp, "must be a whole number of ranks, at least 1")


def check_load_options(model: str | None, device: str = "auto", dtype: str = "auto", quantize: str = "auto",
                       threads: int | None = None, tp: int = 1) -> None:
    """Everything LLM.load and --threads would refuse by value; a local model's path must exist (a hub
    id is left to the load, which looks in the cache and then downloads)."""
    check_device(device)
    check_dtype(dtype)
    check_quantize(quantize)
    check_threads(threads)
    check_tp(tp)
    if model is None or not is_hub_id(model):
        resolve_local(model)
