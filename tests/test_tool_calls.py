"""Tool calls: the format each family's chat template teaches is recognised (on the real
templates llama.cpp ships), calls are read back from answers in that format (Hermes/Qwen, Llama 3,
Mistral, gpt-oss's harmony), tools and tool results render through the template, and the server
answers OpenAI's tool-calling round trip: a required or named call always parses (grammar-held,
even on a random-weight model), streamed as deltas equal to the whole answer, then the tool's
result and a final answer. Malformed tools and unknown names are 400s."""
from __future__ import annotations

import json

import pytest

from brisk.core import LLM
from brisk.core.errors import InvalidValue
from brisk.core.tool_calls import Harmony, Hermes, Llama3, Mistral, checked_choice, checked_tools, tool_format

from llama_cpp import SOURCE

pytestmark = pytest.mark.usefixtures("one_thread")
TEMPLATES = SOURCE / "models" / "templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
    "additionalProperties": False}}}


def template(name: str) -> str:
    path = TEMPLATES / name
    if not path.is_file():
        pytest.skip(f"{path} is missing (make test fetches llama.cpp's templates)")
    return path.read_text()


@pytest.mark.parametrize("name,fmt", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"), ("Qwen-Qwen3-0.6B.jinja", "hermes"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"), ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3"), ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
    ("openai-gpt-oss-120b.jinja", "harmony"), ("google-gemma-2-2b-it.jinja", None),
])
def test_formats_are_recognised_from_real_templates(name, fmt):
    found = tool_format(template(name))
    assert (found.name if found else None) == fmt


def test_reading_calls_in_each_format():
    c, calls = Hermes().split('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                              '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                              '"{\\"zone\\": \\"CET\\"}"}\n</tool_call>')
    assert c == "Let me check." and [(x.name, json.loads(x.arguments)) for x in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]
    assert Hermes().split('<tool_call>\n{"name": "f", "arguments": {}}')[1][0].name == "f"  # ended by EOS
    assert Hermes().split("<tool_call> not json </tool_call>") == ("<tool_call> not json </tool_call>", [])
    c, calls = Llama3().split('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}')
    assert c == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] == "Oslo"
    assert Llama3().split("The answer is {not a call}") == ("The answer is {not a call}", [])
    c, calls = Mistral().split('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
                               '{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}]')
    assert [x.name for x in calls] == ["get_time", "get_weather"]
    assert Mistral().split('[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}')[1][0].arguments == '{"zone": "UTC"}'
    text = ("<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Lima", "days": 1}')
    c, calls = Harmony().split(text)
    assert c == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Lima", "days": 1}
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    assert Harmony().split(answer) == ("It is 4.", []) and Harmony().reasoning(answer) == "Easy."
    assert len({x.id for x in calls + Hermes().split('<tool_call>{"name": "a", "arguments": {}}</tool_call>')[1]}) \
        == len(calls) + 1  # ids are unique


def test_checked_tools_and_choice():
    assert checked_tools([WEATHER]) == [WEATHER]
    for bad in ([], [{"type": "function"}], [{"type": "function", "function": {"name": "has space"}}],
                [WEATHER, WEATHER], "tools", [{"type": "function", "function": {"name": "f", "parameters": 3}}]):
        with pytest.raises(InvalidValue):
            checked_tools(bad)
    assert checked_choice(None, [WEATHER]) == "auto" and checked_choice(None, None) == "none"
    assert checked_choice({"type": "function", "function": {"name": "get_weather"}}, [WEATHER]) == "get_weather"
    with pytest.raises(InvalidValue, match="names no tool"):
        checked_choice({"type": "function", "function": {"name": "nope"}}, [WEATHER])
    with pytest.raises(InvalidValue):
        checked_choice("sometimes", [WEATHER])


def test_tools_and_tool_results_render_through_the_template(tiny_llama_dir):
    llm = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32")
    tok = llm.tokenizer
    tok.chat_template, tok._template = template("Qwen-Qwen2.5-7B-Instruct.jinja"), None
    from brisk.core.jobs import messages_of

    msgs = messages_of({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    text = tok.apply_chat_template(msgs, tools=[WEATHER])
    assert '"name": "get_weather"' in text and "The weather in a city" in text  # the tool list
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in text  # the call, as an object
    assert "<tool_response>\nsunny\n</tool_response>" in text


# ---------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def long_tiny_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with room for a real template's tool list (its 300-token vocabulary spells
    them in many tokens)."""
    import shutil

    folder = tmp_path_factory.mktemp("long_tiny") / "m"
    shutil.copytree(tiny_llama_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 4096}))
    return folder


@pytest.fixture(scope="module", params=["Qwen-Qwen2.5-7B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja",
                                        "mistralai-Mistral-Nemo-Instruct-2407.jinja", "openai-gpt-oss-120b.jinja"])
def tool_server(request, long_tiny_dir):
    from test_serve import Server

    llm = LLM.load(str(long_tiny_dir), device="cpu", dtype="float32", ctx=4096)
    llm.tokenizer.chat_template, llm.tokenizer._template = template(request.param), None
    s = Server(llm)
    yield s
    s.close()


def test_required_and_named_calls_parse_and_round_trip(tool_server):
    client = tool_server.client
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=1500, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time")
    assert call.id.startswith("call_") or (call.id.isalnum() and len(call.id) == 9)  # Mistral's ids: 9 characters
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city", "days"} if call.function.name == "get_weather" else {"zone"} | set(args))
    named = client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER, TIME], max_tokens=1500,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=0)
    assert [c.function.name for c in named.choices[0].message.tool_calls or ()] == ["get_time"], named.choices[0]
    # streamed: the same call, as tool_calls deltas
    chunks = list(client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER, TIME], max_tokens=1500,
                                                 tool_choice="required", temperature=0, stream=True))
    deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the round trip: the call and its result go back, the model answers
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER, TIME], tool_choice="none",
                                           max_tokens=12, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": "x"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_malformed_tool_requests_are_400s(tool_server, extra, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | extra
    status, out = tool_server.raw("POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == param, out
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert tool_server.raw("POST", "/v1/chat/completions", ok)[0] == 200


def test_a_template_without_tools_refuses_them(tiny):
    from test_serve import Server

    s = Server(tiny)
    try:
        status, out = s.raw("POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "tools": [WEATHER],
                                                             "messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and out["error"]["param"] == "tools" and "does not render tools" in out["error"]["message"]
    finally:
        s.close()
