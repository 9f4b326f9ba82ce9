"""The kinds of BriskError: core messages name options as the Python API and JSON requests do
(never as flags), each kind carries what a front end needs, and the command line spells options
as its flags. (The server's codes: test_serve.py; the command line's lines: test_cli.py.)"""
from __future__ import annotations

import struct

import pytest

from brisk.core import arch, calibration, device, evaluate
from brisk.core.checkpoint import load_checkpoint
from brisk.core.errors import BriskError, FileError, InvalidValue, PromptTooLong, UnsupportedFormat
from brisk.core.gguf_file import open_gguf
from brisk.core.sampling import SamplingParams


def test_invalid_value_names_the_option_not_the_flag():
    with pytest.raises(InvalidValue) as info:
        SamplingParams(temperature=-1).validate()
    e = info.value
    assert isinstance(e, BriskError) and (e.name, e.value, e.rule) == ("temperature", -1, "must be >= 0")
    assert str(e) == "temperature must be >= 0, got -1"
    assert e.flag == "--temperature" and e.cli_message() == "--temperature must be >= 0, got -1"
    top_p = InvalidValue("top_p", 2.0, "must be in (0, 1]")
    assert str(top_p) == "top_p must be in (0, 1], got 2.0"
    assert top_p.cli_message() == "--top-p must be in (0, 1], got 2.0"
    long = str(InvalidValue("stop", "x" * 1000, "must be short"))
    assert "..." in long and len(long) < 80  # a long value is cut short


class _Tok:  # calibration_batch's tokenizer: one token a character
    add_bos, bos_id = False, None

    def encode(self, text, add_special=True):
        return [ord(c) for c in text]


@pytest.mark.parametrize("call, name", [
    (lambda: SamplingParams(top_k=-1).validate(), "top_k"),
    (lambda: SamplingParams(top_p=0).validate(), "top_p"),
    (lambda: SamplingParams(min_p=1).validate(), "min_p"),
    (lambda: SamplingParams(repetition_penalty=0).validate(), "repetition_penalty"),
    (lambda: device.pick_device("tpu"), "device"),
    (lambda: device.pick_dtype("float8", device.pick_device("cpu")), "dtype"),
    (lambda: evaluate.windows(10, 1, 1), "ctx"),
    (lambda: evaluate.windows(10, 4, 5), "stride"),
    (lambda: calibration.calibration_batch(_Tok(), ["abc"], 0, 8), "samples"),
    (lambda: calibration.calibration_batch(_Tok(), ["abc"], 1, 1), "seq_len"),
    (lambda: calibration.calibration_batch(_Tok(), ["abc"], 1, 64), "seq_len"),
])
def test_core_messages_have_no_flags(call, name):
    with pytest.raises(InvalidValue) as info:
        call()
    e = info.value
    assert e.name == name and "--" not in str(e) and name in str(e)
    assert e.flag in e.cli_message() and e.cli_message() == e.render(e.flag)


def test_a_template_places_the_option_mid_sentence():
    with pytest.raises(InvalidValue) as info:
        calibration.calibration_batch(_Tok(), ["abc"], 1, 64)
    assert str(info.value) == ("the calibration text has 5 tokens, fewer than seq_len 64: "
                               "give more text or a smaller seq_len")
    assert "fewer than --seq-len 64" in info.value.cli_message()


def test_prompt_too_long_carries_its_sizes():
    e = PromptTooLong(300, 64, limit=256)
    assert (e.tokens, e.context, e.limit) == (300, 64, 256) and isinstance(e, BriskError)
    assert str(e) == ("the prompt is 300 tokens but the context is 64 "
                      "(shorten it or load the model with a longer context, up to the model's 256)")
    assert e.cli_message() == ("the prompt is 300 tokens but the context is 64 "
                               "(shorten it or raise --ctx, up to the model's 256)")
    assert str(PromptTooLong(300, 256, limit=256)) == "the prompt is 300 tokens but the context is 256"  # at the limit
    assert str(PromptTooLong(9, 8, what="message")).startswith("the message is 9 tokens")


def test_file_errors_name_the_file(tmp_path):
    assert str(FileError("no requests", "b.jsonl")) == "b.jsonl: no requests"
    assert str(FileError("not JSON", "b.jsonl", 3)) == "b.jsonl:3: not JSON"
    with pytest.raises(FileError) as info:
        load_checkpoint(str(tmp_path / "nope.gguf"))
    assert info.value.path == str(tmp_path / "nope.gguf") and "no such file" in str(info.value)
    with pytest.raises(FileError) as info:
        calibration.load_texts(tmp_path / "calib.txt")
    assert info.value.path == tmp_path / "calib.txt" and "--" not in str(info.value)


def test_unsupported_formats_are_file_errors(tmp_path):
    with pytest.raises(UnsupportedFormat, match="unsupported architecture 'mamba'"):
        arch.from_hf_config({"model_type": "mamba"})
    future = tmp_path / "future.gguf"
    future.write_bytes(b"GGUF" + struct.pack("<IQQ", 4, 0, 0))
    with pytest.raises(UnsupportedFormat, match="version 4") as info:
        open_gguf(future)
    assert isinstance(info.value, FileError) and info.value.path == future
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + struct.pack("<I", 3))
    with pytest.raises(FileError, match="corrupt or truncated") as info:
        open_gguf(corrupt)
    assert not isinstance(info.value, UnsupportedFormat)


def test_an_emulated_half_dtype_on_the_cpu_is_said(monkeypatch):
    """bfloat16 decoded 5x slower than float32 on an AVX2 CPU without native bf16, without a word."""
    import warnings

    import torch

    from brisk.core import device

    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: False)
    with pytest.warns(UserWarning, match="emulated"):
        assert device.pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert device.pick_dtype("float32", torch.device("cpu")) == torch.float32
        assert device.pick_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(device, "cpu_has_fast_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        device.pick_dtype("bfloat16", torch.device("cpu"))
