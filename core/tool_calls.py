"""Tool calls in a model's own words: which format its chat template teaches, and how calls are
read back from an answer (decoded with its special tokens, which some formats are made of).

Formats, as each family's template asks for them:
- hermes (Qwen 2.5/3, Hermes, SmolLM3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- llama3 (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}` (after an
  optional <|python_tag|>)
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}`
- harmony (gpt-oss): messages on channels; a call is one addressed `to=functions.NAME`, the answer
  is the `final` channel's message
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .errors import InvalidValue

MAX_TOOLS = 128  # OpenAI's limit
MAX_CALLS = 8  # parallel calls in one answer when a call is required (a named function: one)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


def _call(obj, args_key: str = "arguments") -> ToolCall | None:
    """A call from a decoded {"name", args_key} object, None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_prefix(text: str):
    """The JSON value text starts with (after spaces) and where it ends; (None, 0) when none."""
    s = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(s)
    except ValueError:
        return None, 0
    return value, len(text) - len(s) + end


def checked_tools(tools) -> list[dict]:
    """OpenAI's `tools`: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}, names unique; returned as given (the chat template renders them)."""
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise InvalidValue("tools", tools, f"must be a list of 1 to {MAX_TOOLS} tools")
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise InvalidValue(f"tools[{i}]", t, 'must be {"type": "function", "function": {"name": ...}}')
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidValue(f"tools[{i}].function.name", name, "must be 1-64 letters, digits, _ . or -")
        if name in names:
            raise InvalidValue(f"tools[{i}].function.name", name, "is given twice")
        names.add(name)
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise InvalidValue(f"tools[{i}].function.parameters", params, "must be a JSON schema (an object)")
    return tools


def checked_choice(choice, tools: list[dict] | None):
    """OpenAI's `tool_choice`: "none", "auto", "required" or {"type": "function", "function":
    {"name"}} naming one of the tools; returned as "none" | "auto" | "required" | the name."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise InvalidValue("tool_choice", choice, "needs tools")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise InvalidValue("tool_choice", choice, 'must be "none", "auto", "required" or {"type": "function", '
                                                  '"function": {"name": ...}}')
    if name not in {t["function"]["name"] for t in tools or ()}:
        raise InvalidValue("tool_choice", name, "names no tool of the request")
    return name


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def _json(schema: dict) -> str:
    """A schema as Lark's %json takes it, bounded as brisk bounds every schema (grammar.bounded)."""
    from .grammar import bounded

    return json.dumps(bounded(schema))


def _call_schema(tool: dict, args_key: str = "arguments") -> dict:
    f = tool["function"]
    return {"type": "object", "properties": {"name": {"const": f["name"]}, args_key: _parameters(tool)},
            "required": ["name", args_key], "additionalProperties": False}


def _lark_text(text: str, specials: dict[str, int]) -> str:
    """A piece of a Lark rule that produces text: its special token where the vocabulary has one
    (models write those, never their spelling), else the literal."""
    return f"<[{specials[text]}]>" if text in specials else json.dumps(text)


class ToolFormat:
    name = ""
    start = ""  # the text that opens a call; what comes before it is the answer's content

    def call_grammar(self, tools: list[dict], specials: dict[str, int], most: int = MAX_CALLS) -> str:
        """A Lark grammar (llguidance's, with %json) whose every sentence is 1 to `most` calls of
        these tools; specials: special token text -> id."""
        raise NotImplementedError

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the content, the calls) of an answer's text; text that does not parse stays content."""
        raise NotImplementedError

    def call_start(self, text: str) -> int:
        """Where a call may begin in a partial answer (len(text) when nowhere): content before it
        can be streamed; a tail that might grow into the opening text is held back."""
        i = text.find(self.start)
        if i >= 0:
            return i
        for n in range(min(len(self.start) - 1, len(text)), 0, -1):
            if text.endswith(self.start[:n]):
                return len(text) - n
        return len(text)


class Hermes(ToolFormat):
    name, start = "hermes", "<tool_call>"

    def call_grammar(self, tools, specials, most=MAX_CALLS):
        schema = _json({"anyOf": [_call_schema(t) for t in tools]})
        more = f' ("\\n" call){{0,{most - 1}}}' if most > 1 else ""
        return (f'start: call{more}\ncall: {_lark_text("<tool_call>", specials)} "\\n" %json {schema} '
                f'"\\n" {_lark_text("</tool_call>", specials)}\n')
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def split(self, text):
        calls, kept, last = [], [], 0
        for m in self._block.finditer(text):
            value, _ = _json_prefix(m.group(1))
            call = _call(value)
            if call is None:
                continue
            kept.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        kept.append(text[last:])
        return "".join(kept).strip() if calls else text, calls


class Llama3(ToolFormat):
    name, start = "llama3", "<|python_tag|>"

    def call_grammar(self, tools, specials, most=MAX_CALLS):  # one call: the answer is the call
        return f'start: %json {_json({"anyOf": [_call_schema(t, "parameters") for t in tools]})}\n'

    def split(self, text):
        body = text.strip().removeprefix(self.start).strip()
        calls, rest = [], body
        while rest:
            value, end = _json_prefix(rest)
            call = _call(value, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            rest = rest[end:].lstrip().removeprefix(";").lstrip()
        return ("", calls) if calls else (text, [])

    def call_start(self, text):
        stripped = text.lstrip()
        if stripped.startswith("{") or stripped.startswith(self.start):  # the answer is a call
            return 0
        return super().call_start(text)


class Mistral(ToolFormat):
    name, start = "mistral", "[TOOL_CALLS]"

    def call_grammar(self, tools, specials, most=MAX_CALLS):
        schema = {"type": "array", "items": {"anyOf": [_call_schema(t) for t in tools]}, "minItems": 1,
                  "maxItems": most}
        return f'start: {_lark_text("[TOOL_CALLS]", specials)} %json {_json(schema)}\n'

    def split(self, text):
        i = text.find(self.start)
        if i < 0:
            return text, []
        content, rest, calls = text[:i].strip(), text[i + len(self.start):], []
        value, _ = _json_prefix(rest)
        if isinstance(value, list):  # [{"name", "arguments"}, ...]
            calls = [_call(v) for v in value]
        else:  # name[ARGS]{...}, repeated after [TOOL_CALLS]
            for part in rest.split(self.start):
                name, sep, args = part.partition("[ARGS]")
                value, _ = _json_prefix(args)
                calls.append(_call({"name": name.strip(), "arguments": value}) if sep else None)
        if not calls or any(c is None for c in calls):
            return text, []
        # Mistral's templates take back only ids of 9 letters or digits
        return content, [ToolCall(c.name, c.arguments, uuid.uuid4().hex[:9]) for c in calls]


class Harmony(ToolFormat):
    """gpt-oss: `<|channel|>NAME[ to=functions.F][<|constrain|>json]<|message|>TEXT<|end|>`
    (the recipient may also precede the channel); calls end with <|call|>, the answer with
    <|return|> or the end of the text."""
    name, start = "harmony", "<|channel|>"
    _message = re.compile(r"((?:(?!<\|message\|>).)*?)<\|message\|>(.*?)(?=<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>|$)",
                          re.S)

    def split(self, text):
        if "<|message|>" not in text:
            return text, []
        final, calls = [], []
        for m in self._message.finditer(text):
            header, body = m.group(1), m.group(2)
            to = re.search(r"to=functions\.([^\s<]+)", header)
            channel = re.search(r"<\|channel\|>\s*(\w+)", header)
            if to:
                value, _ = _json_prefix(body)
                call = _call({"name": to.group(1), "arguments": value})
                if call is not None:
                    calls.append(call)
            elif channel and channel.group(1) == "final":
                final.append(body)
        return "".join(final).strip(), calls

    def reasoning(self, text: str) -> str:
        """The analysis channel's messages: the model's reasoning, not its answer."""
        return "".join(m.group(2) for m in self._message.finditer(text)
                       if re.search(r"<\|channel\|>\s*analysis", m.group(1))).strip()

    def call_start(self, text):
        return 0  # everything is a message on some channel: read the whole answer

    def call_grammar(self, tools, specials, most=MAX_CALLS):  # one call per message
        calls = []
        for t in tools:
            f = t["function"]
            params = _json(_parameters(t))
            calls.append(f'{_lark_text("<|channel|>", specials)} "commentary to=functions.{f["name"]} " '
                         f'{_lark_text("<|constrain|>", specials)} "json" {_lark_text("<|message|>", specials)} '
                         f'%json {params}')
        return "start: " + " | ".join(f"({c})" for c in calls) + "\n"


def tool_format(chat_template: str | None) -> ToolFormat | None:
    """The format a chat template teaches (None: it renders no tools)."""
    t = chat_template or ""
    if "to=functions" in t or ("<|channel|>" in t and "tools" in t):
        return Harmony()
    if "<tool_call>" in t:
        return Hermes()
    if "[TOOL_CALLS]" in t:
        return Mistral()
    if "tools" in t and ("<|python_tag|>" in t or "ipython" in t or '"parameters"' in t):
        return Llama3()
    return None
