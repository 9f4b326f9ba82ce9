"""The fused decode-step kernels (core/fused.py) against the eager ops they replace, under Triton's
interpreter on the CPU (conftest.py) or on CUDA."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the CUDA kernels' tests need it)")

from brisk.core import fused  # noqa: E402
from brisk.core.model import RMSNorm, apply_rope, rope_inv_freq, rope_tables  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 96])
def test_rms_norm(offset, dtype, D):
    norm = RMSNorm(D, 1e-6, offset)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(dtype)
    x = torch.randn(2, 5, D).to(dtype)
    ref = norm(x)  # the eager path (CPU tensors)
    y = fused.rms_norm(x.to(DEV), norm.weight.to(DEV), 1e-6, offset).cpu()
    assert y.dtype == ref.dtype and y.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_any_strides(dtype):
    B, T, H, D = 2, 3, 4, 32
    cos, sin = rope_tables(rope_inv_freq(D, 10000.0, None), 16)
    cos, sin = cos[5:5 + T].to(dtype), sin[5:5 + T].to(dtype)
    x = torch.randn(B, T, H, D).to(dtype).transpose(1, 2)  # [B, H, T, D] as the model makes it
    ref = apply_rope(x, cos, sin)
    y = fused.rope(x.to(DEV), cos.to(DEV), sin.to(DEV)).cpu()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("gelu", [False, True])
def test_gated(gelu):
    g, u = torch.randn(3, 1000) * 3, torch.randn(3, 1000)
    act = torch.nn.functional.gelu(g, approximate="tanh") if gelu else torch.nn.functional.silu(g)
    y = fused.gated(g.to(DEV), u.to(DEV), gelu).cpu()
    torch.testing.assert_close(y, act * u, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gelu", [False, True])
def test_gated_halves(gelu):
    gu = torch.randn(3, 2, 600) * 3
    g, u = gu[..., :300], gu[..., 300:]
    act = torch.nn.functional.gelu(g, approximate="tanh") if gelu else torch.nn.functional.silu(g)
    y = fused.gated_halves(gu.to(DEV), gelu).cpu()
    torch.testing.assert_close(y, act * u, rtol=1e-5, atol=1e-5)


def test_joined_projections_give_the_same_logits(tiny_llama_dir, tiny_qwen2_dir):
    """The fused-kernel pass (q/k/v, gate/up in one matmul each; Qwen2 has q/k/v biases; Triton
    norms, rope and activation): same logits, same state dict."""
    from brisk.core import LLM
    from brisk.core.kernel_passes import use_fused_kernels
    from brisk.quant.linear import Int8Linear, concat_linears

    for path in (tiny_llama_dir, tiny_qwen2_dir):
        llm = LLM.load(str(path), device=str(DEV), dtype="float32")
        ids = list(range(3, 30))
        ref, keys = llm.logits(ids), set(llm.model.state_dict())
        use_fused_kernels(llm.model)
        assert "_qkv" in llm.model.model.layers[0].self_attn.__dict__
        torch.testing.assert_close(llm.logits(ids), ref, rtol=1e-5, atol=1e-5)
        assert set(llm.model.state_dict()) == keys
    layers = [Int8Linear.from_float(torch.nn.Linear(64, n)) for n in (32, 16)]
    x = torch.randn(2, 64)
    want = [m(x) for m in layers]
    joined = concat_linears(layers)
    torch.testing.assert_close(joined(x), torch.cat(want, -1))
    torch.testing.assert_close([m(x) for m in layers], want)  # the originals (now views) still work


def test_fused_pass_keeps_unfused_activations(tiny_gpt_oss_dir):
    """gpt-oss's experts (clamped SwiGLU, no fused kernel, gate/up not joined) under the fused
    pass give the plain MLP's output (on an H100 they raised a TypeError instead)."""
    from brisk.core import LLM
    from brisk.core.kernel_passes import FusedMLP, use_fused_kernels
    from brisk.core.model import MLP

    llm = LLM.load(str(tiny_gpt_oss_dir), device=str(DEV), dtype="float32")
    use_fused_kernels(llm.model)
    expert = llm.model.model.layers[0].mlp.experts[0]
    assert type(expert) is FusedMLP and expert.act == "swiglu_clamp"
    x = torch.randn(3, llm.config.dim, device=DEV)
    torch.testing.assert_close(expert(x), MLP.forward(expert, x))
