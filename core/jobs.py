"""Requests from user input: a JSON object with a prompt or chat messages and optional sampling
fields (a line of `generate --batch`, the body of a server request), checked field by field.
Also the summary of a finished batch (throughput, latency percentiles, KV pool use)."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import BriskError, FileError, InvalidValue, PromptTooLong
from .sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduler's stack (torch) loads when a request is made, not with the checks
    from .batching import Request

SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                   "repetition_penalty": float, "seed": int, "presence_penalty": float, "frequency_penalty": float}
# what a `generate --batch` line may hold; anything else is most likely a typo ("temprature")
BATCH_KEYS = {"prompt", "messages", "raw", "system", "id", "max_tokens", "stop", "logit_bias", *SAMPLING_FIELDS}


def unknown_keys(obj: dict) -> list[str]:
    return sorted(k for k in obj if k not in BATCH_KEYS and k != "_line")


def _typed(obj: dict, key: str, kind, default=None):
    """obj[key] as `kind` (int or float; bool is neither), default when absent or null."""
    v = obj.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)):
        raise InvalidValue(key, v, f"must be {'an integer' if kind is int else 'a number'}")
    if kind is float and not math.isfinite(v):
        raise InvalidValue(key, v, "must be finite")
    return kind(v)


def logit_bias(value, vocab_size: int) -> dict:
    """OpenAI's logit_bias, {"token id": bias} (JSON keys are strings), with int keys, each within
    the model's vocabulary (SamplingParams.validate checks the biases and their number)."""
    if not isinstance(value, dict):
        raise InvalidValue("logit_bias", value, "must be an object mapping token ids to biases")
    out = {}
    for key, bias in value.items():
        try:
            t = int(key)
        except (TypeError, ValueError):
            raise InvalidValue("logit_bias", key, "keys must be token ids (integers)") from None
        if not 0 <= t < vocab_size:
            raise InvalidValue("logit_bias", key, f"token ids must be in [0, {vocab_size})")
        out[t] = bias
    return out


def text_content(content, name: str = "content") -> str:
    """A message's content: a string, or OpenAI's list of parts of which only text is supported.
    name: the field, for the error."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise InvalidValue(name, [p.get("type") for p in content], "may hold only text parts")
        return "".join(p["text"] for p in content)
    raise InvalidValue(name, content, "must be a string or a list of text parts")


def messages_of(obj: dict) -> list[dict]:
    """The conversation as chat templates take it: an assistant's tool calls with their arguments
    as objects (templates write them with tojson), tool results with the id of their call."""
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidValue("messages", msgs, "must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise InvalidValue(f"messages[{i}]", m, "must be an object with a role and a content")
        if m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise InvalidValue(f"messages[{i}].role", m.get("role"), "must be system, user, assistant or tool")
        role = "system" if m["role"] == "developer" else m["role"]
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content")
        msg = {"role": role, "content": "" if content is None and calls else
               text_content(content, f"messages[{i}].content")}
        if calls:
            msg["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise InvalidValue(f"messages[{i}].{key}", m[key], "must be a string")
                    msg[key] = m[key]
        out.append(msg)
    return out


def _tool_calls(calls, name: str) -> list[dict]:
    if not isinstance(calls, list):
        raise InvalidValue(name, calls, "must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise InvalidValue(f"{name}[{j}]", c, 'must be {"type": "function", "function": {"name", "arguments"}}')
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise InvalidValue(f"{name}[{j}].function.arguments", args, "must be a JSON object") from None
        if not isinstance(args, dict):
            raise InvalidValue(f"{name}[{j}].function.arguments", args, "must be a JSON object")
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def token_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidValue("prompt", bad, f"token ids must be in [0, {vocab_size})")
    return list(ids)


def prompt_ids(llm, obj: dict, template_prompt: bool = True, system: str | None = None,
               tools: list[dict] | None = None) -> list[int]:
    """Token ids for obj's "messages" (through the chat template) or "prompt" (through it too when
    template_prompt and the model has one, like `brisk generate`; as is when obj says "raw")."""
    tok = llm.tokenizer
    if "messages" in obj:
        if "prompt" in obj:
            raise BriskError("give 'prompt' or 'messages', not both")
        if not tok.has_chat_template:
            raise BriskError(f"{llm.name} has no chat template; send a 'prompt' instead of 'messages'")
        text = tok.apply_chat_template(messages_of(obj), add_generation_prompt=True, tools=tools)
        return tok.encode(text, add_special=False)
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return token_ids(prompt, llm.config.vocab_size)  # already tokens: used exactly as given
    if not isinstance(prompt, str):
        raise InvalidValue("prompt", prompt, "must be a string (or give messages instead)")
    raw = obj.get("raw", not template_prompt)
    if not isinstance(raw, bool):
        raise InvalidValue("raw", raw, "must be true or false")
    sys_msg = obj.get("system", system)
    if sys_msg is not None and not isinstance(sys_msg, str):
        raise InvalidValue("system", sys_msg, "must be a string")
    return llm.prompt_ids(prompt, raw=raw, system=sys_msg)


# Every generated token is matched against every stop string: bounded, so one request cannot slow
# the engine's step for all the others (OpenAI takes up to 4).
MAX_STOPS, MAX_STOP_CHARS = 16, 1000


def stop_strings(obj: dict, default=()) -> tuple[str, ...]:
    stop = obj.get("stop")
    if stop is None:
        return tuple(default)
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidValue("stop", stop, "must be a string or a list of strings")
    if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise BriskError(f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each")
    return tuple(stop)


def request_from(llm, obj: dict, sampling: SamplingParams, max_tokens: int, stop=(),
                 template_prompt: bool = True, system: str | None = None, max_tokens_key="max_tokens",
                 logprobs: int | None = None, prompt_logprobs: int | None = None, grammar=None,
                 tools: list[dict] | None = None) -> Request:
    """A scheduler Request from a JSON object; fields absent from it take the given defaults.
    A prompt that does not fit llm's context is refused here, before any engine sees it.
    logprobs, prompt_logprobs, grammar: Request's (with prompt_logprobs, max_tokens may be 0);
    tools: rendered by the chat template."""
    from .batching import Request

    if not isinstance(obj, dict):
        raise BriskError("each request must be a JSON object")
    fields = {k: _typed(obj, k, kind) for k, kind in SAMPLING_FIELDS.items() if obj.get(k) is not None}
    n = _typed(obj, max_tokens_key, int, max_tokens)
    if n < (0 if prompt_logprobs is not None else 1):
        raise InvalidValue(max_tokens_key, n, "must be >= 1")
    if obj.get("logit_bias") is not None:
        fields["logit_bias"] = logit_bias(obj["logit_bias"], llm.config.vocab_size)
    sampling = replace(sampling, **fields).validate()
    ids = prompt_ids(llm, obj, template_prompt, system, tools)
    if len(ids) >= llm.ctx:  # as the engine would refuse it: no room left to generate
        raise PromptTooLong(len(ids), llm.ctx)
    return Request(ids, sampling, n, stop_strings(obj, stop), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                   grammar=grammar)


def response_grammar(llm, value, field: str = "response_format"):
    """OpenAI's response_format as a compiled grammar: None for text, any JSON object for
    {"type": "json_object"}, the schema of {"type": "json_schema", "json_schema": {"schema": ...}}."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise InvalidValue(field, value, 'must be {"type": "text" | "json_object" | "json_schema", ...}')
    source = None
    if kind == "json_schema":
        spec = value.get("json_schema")
        source = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(source, dict):
            raise InvalidValue(field, spec, 'needs "json_schema": {"name": ..., "schema": {...}}')
    from .grammar import Vocabulary

    return Vocabulary.of(llm.tokenizer, llm.config.vocab_size).compile(kind, source, field)


def read_jsonl(path: Path) -> list[dict]:
    """The objects of a JSONL file (blank lines skipped); errors name the line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise FileError(f"cannot read ({getattr(e, 'strerror', None) or e})", path) from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise FileError(f"not JSON ({e})", path, i) from None
        if not isinstance(obj, dict):
            raise FileError("expected a JSON object", path, i)
        out.append({"_line": i, **obj})
    if not out:
        raise FileError("no requests", path)
    return out


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def summary(seqs, wall_s: float, engine) -> dict:
    lat = [s.latency_s for s in seqs]
    gen = sum(len(s.result.tokens) for s in seqs)
    st, pool = engine.stats, engine.kv
    return {"requests": len(seqs), "wall_s": round(wall_s, 3), "requests_per_s": round(len(seqs) / wall_s, 3),
            "generated_tokens": gen, "generated_tok_s": round(gen / wall_s, 2),
            "prompt_tokens": sum(s.result.prompt_tokens for s in seqs),
            "shared_prefix_tokens": st.shared_tokens, "preemptions": st.preemptions,
            "latency_mean_s": round(sum(lat) / len(lat), 3), "latency_p95_s": round(percentile(lat, 95), 3),
            "kv_pool_bytes": pool.nbytes, "kv_peak_used_bytes": st.peak_blocks * pool.block_bytes,
            "kv_peak_needed_bytes": st.peak_tokens * pool.block_bytes // pool.block_size}
