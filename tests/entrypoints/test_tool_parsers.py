"""Tool-call parsers on output strings in each format: single and parallel calls, text before
and after, malformed calls (-> plain content), and streams in random chunk sizes whose deltas
rebuild exactly the non-streamed result."""
from __future__ import annotations

import json
import random
import textwrap
from types import SimpleNamespace

import pytest

from pagedllm.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    partial_json, stable_json_prefix)
from pagedllm.entrypoints.openai.tool_parsers.forced_tool_parser import (NamedToolParser,
                                                                        RequiredToolParser)

WEATHER = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
NESTED = {"name": "John Doe", "age": 37, "score": -1.5e-3, "address": {"city": "São Paulo",
          "zip": None}, "tags": ["a", "b \"quoted\"", "c\\d"], "active": True,
          "note": "line1\nline2 \u2603 😀"}

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_CE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _j(x) -> str:
    return json.dumps(x, ensure_ascii=False)


def _qwen3_call(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else _j(v)}\n</parameter>\n"
                     for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _ds_call(name: str, args: dict) -> str:
    return f"{DS_CB}function{DS_SEP}{name}\n```json\n{_j(args)}\n```{DS_CE}"


# (parser, output text, expected calls [(name, arguments)], expected content)
CASES = [
    # hermes: Qwen 2.5 / Hermes style
    ("hermes", f'<tool_call>\n{{"name": "get_current_weather", "arguments": {_j(WEATHER)}}}\n'
               "</tool_call>", [("get_current_weather", WEATHER)], None),
    ("hermes", "I'll check both cities for you.\n<tool_call>\n"
               f'{{"name": "get_current_weather", "arguments": {_j(WEATHER)}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "register_user", "arguments": '
               f"{_j(NESTED)}}}\n</tool_call>",
     [("get_current_weather", WEATHER), ("register_user", NESTED)],
     "I'll check both cities for you."),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.',
     [("get_time", {})], "\nDone."),
    ("hermes", '<tool_call>{"arguments": {"x": [1, 2, {"y": "z"}]}, "name": "f"}</tool_call>',
     [("f", {"x": [1, 2, {"y": "z"}]})], None),
    # an output that ended inside the last block: the call still counts when its JSON is whole
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"n": 12345}}', [("f", {"n": 12345})],
     None),
    ("hermes", "The weather is sunny, 22 °C. No tool needed: <tool> is not a call.\n", [],
     "The weather is sunny, 22 °C. No tool needed: <tool> is not a call.\n"),
    # llama3_json
    ("llama3_json", f'{{"name": "get_current_weather", "parameters": {_j(WEATHER)}}}',
     [("get_current_weather", WEATHER)], None),
    ("llama3_json", f'<|python_tag|>{{"name": "get_current_weather", "parameters": '
                    f'{_j(WEATHER)}}}; {{"name": "register_user", "arguments": {_j(NESTED)}}}',
     [("get_current_weather", WEATHER), ("register_user", NESTED)], None),
    ("llama3_json", "Sure! The capital of France is Paris.", [],
     "Sure! The capital of France is Paris."),
    # mistral, both tokenizer formats
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_current_weather", "arguments": {_j(WEATHER)}}}, '
                f'{{"name": "register_user", "arguments": {_j(NESTED)}}}]',
     [("get_current_weather", WEATHER), ("register_user", NESTED)], None),
    ("mistral", f"Let me look that up.[TOOL_CALLS]get_current_weather[ARGS]{_j(WEATHER)}"
                f"[TOOL_CALLS]register_user[ARGS]{_j(NESTED)}",
     [("get_current_weather", WEATHER), ("register_user", NESTED)], "Let me look that up."),
    ("mistral", "No tools here.", [], "No tools here."),
    # pythonic
    ("pythonic", "[get_weather(city='San Francisco', metric=\"celsius\")]",
     [("get_weather", {"city": "San Francisco", "metric": "celsius"})], None),
    ("pythonic", "[get_weather(city='Paris, FR', days=3), register_user(name='John Doe', age=37,"
                 " address={'city': 'São Paulo', 'zip': None}, tags=['a', 'b) c'], active=True),"
                 " ping()]",
     [("get_weather", {"city": "Paris, FR", "days": 3}),
      ("register_user", {"name": "John Doe", "age": 37, "address": {"city": "São Paulo",
                                                                    "zip": None},
                         "tags": ["a", "b) c"], "active": True}),
      ("ping", {})], None),
    ("llama4_pythonic", "<|python_start|>[get_weather(city='Oslo')]<|python_end|>",
     [("get_weather", {"city": "Oslo"})], None),
    ("pythonic", "I cannot call [tools] right now.", [], "I cannot call [tools] right now."),
    # qwen3_coder (typed by the tools below)
    ("qwen3_coder", "Checking.\n" + _qwen3_call("get_current_weather", {
        "city": "New York, NY", "days": 3, "unit": "celsius", "detailed": True,
        "options": {"a": [1, 2]}}),
     [("get_current_weather", {"city": "New York, NY", "days": 3, "unit": "celsius",
                               "detailed": True, "options": {"a": [1, 2]}})], "Checking."),
    ("qwen3_xml", _qwen3_call("get_current_weather", {"city": "Lyon\nFrance", "days": 2})
     + "\n" + _qwen3_call("ping", {}),
     [("get_current_weather", {"city": "Lyon\nFrance", "days": 2}), ("ping", {})], None),
    # deepseek_v3 (and the V3.1 form)
    ("deepseek_v3", "Looking it up." + DS_BEGIN + _ds_call("get_current_weather", WEATHER)
     + _ds_call("register_user", NESTED) + DS_END,
     [("get_current_weather", WEATHER), ("register_user", NESTED)], "Looking it up."),
    ("deepseek_v31", DS_BEGIN + f"{DS_CB}get_current_weather{DS_SEP}{_j(WEATHER)}{DS_CE}"
     + DS_END, [("get_current_weather", WEATHER)], None),
]

MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'),
    ("hermes", "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),
    ("hermes", 'Text <tool_call>\n{"name": "f", "arguments": {"a": "unterminated}'),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1} trailing'),
    ("llama3_json", '{"answer": 42}'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": tru}}]'),
    ("mistral", "[TOOL_CALLS]get_weather"),
    ("pythonic", "[get_weather('Paris')]"),
    ("pythonic", "[get_weather(city=open('x'))]"),
    ("pythonic", "[get_weather(city='Paris'"),
    ("qwen3_coder", "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"),
    ("deepseek_v3", DS_BEGIN + f"{DS_CB}function{DS_SEP}f\n```json\n{{bad}}\n```{DS_CE}" + DS_END),
]

TOOLS = [
    {"type": "function", "function": {"name": "get_current_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "detailed": {"type": "boolean"}, "options": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}},
]


def make_parser(name: str):
    p = ToolParserManager.get_tool_parser(name)(None)
    p.set_tools(TOOLS)
    return p


def chunks(text: str, rng: random.Random, max_len: int) -> list[str]:
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, max_len)
        out.append(text[i:i + k])
        i += k
    return out


def stream(parser, text: str, pieces: list[str], max_calls=None):
    """Feed ``pieces`` through a ToolCallStreamer; rebuild (content, calls, fragment list)."""
    st = ToolCallStreamer(parser, max_calls)
    content = ""
    calls: dict[int, dict] = {}
    frags = []
    acc = ""
    for k, piece in enumerate(pieces):
        acc += piece
        c, deltas = st.update(acc, final=k == len(pieces) - 1)
        content += c
        for d in deltas:
            dd = d.to_dict()
            frags.append(dd)
            slot = calls.setdefault(dd["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in dd:
                assert slot["id"] is None, "id sent twice"
                slot["id"] = dd["id"]
                assert dd["type"] == "function" and dd["function"]["name"]
                slot["name"] = dd["function"]["name"]
            else:
                assert "name" not in dd["function"]
            slot["arguments"] += dd["function"].get("arguments", "")
    assert acc == text
    return content, [calls[i] for i in sorted(calls)], frags, st


@pytest.mark.parametrize("name,text,expected,content", CASES)
def test_extract(name, text, expected, content):
    info = make_parser(name).extract_tool_calls(text)
    assert info.tools_called == bool(expected)
    got = [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    assert got == expected
    assert info.content == (content if expected else text)
    for c in info.tool_calls:
        assert c.type == "function" and c.id
        # arguments are JSON text of an object, serialised without ASCII escapes
        assert c.function.arguments == _j(json.loads(c.function.arguments))
    if name == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in info.tool_calls)


@pytest.mark.parametrize("name,text,expected,content", CASES)
def test_stream_rebuilds_non_streamed(name, text, expected, content):
    ref = make_parser(name).extract_tool_calls(text)
    ref_calls = [(c.function.name, c.function.arguments) for c in ref.tool_calls]
    sizes = [1, 2, 3, 7, 50]
    for seed in range(6):
        rng = random.Random(seed)
        pieces = chunks(text, rng, sizes[seed % len(sizes)]) if seed < 5 else [text]
        got_content, calls, frags, st = stream(make_parser(name), text, pieces)
        assert [(c["name"], c["arguments"]) for c in calls] == ref_calls, (seed, frags)
        assert got_content == (ref.content or ""), seed
        assert st.tools_called == ref.tools_called
        if seed == 0 and any(len(a) > 30 for _, a in ref_calls) and "pythonic" not in name:
            # one character at a time: JSON-like arguments arrive as they are generated, in
            # many fragments (pythonic ones arrive whole, once each call's ")" is seen)
            n_arg_frags = sum(1 for f in frags if f["function"].get("arguments"))
            assert n_arg_frags > 5 * len(ref_calls)


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_is_content(name, text):
    info = make_parser(name).extract_tool_calls(text)
    assert not info.tools_called and info.tool_calls == [] and info.content == text
    for seed in range(4):
        # never a crash; the stream ends with the same content when no call was reported
        content, calls, _, _ = stream(make_parser(name), text,
                                      chunks(text, random.Random(seed), 1 + seed * 3))
        if not calls:
            assert content == text


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_a_call_cut_short_is_not_sent_again_as_content(name):
    """An output that ends inside a call already streamed (max_tokens): the stream keeps the
    fragments it sent and does not send the call's raw text again as content at the end."""
    full = next(t for n, t, exp, _ in CASES if n == name and exp)
    ref = make_parser(name).extract_tool_calls(full)
    args = ref.tool_calls[0].function.arguments
    cut = full[: full.index(args[: len(args) // 2]) + len(args) // 2] if args[: len(args) // 2] in full else None
    if cut is None:  # the arguments are not verbatim in the text (re-serialised): cut mid-text
        cut = full[: len(full) * 2 // 3]
    for seed in range(4):
        content, calls, _, st = stream(make_parser(name), cut, chunks(cut, random.Random(seed), 1 + seed * 4))
        if st.tools_called:
            assert content.strip() == (ref.content or "").strip()[: len(content.strip())], (seed, content)
            assert "{" not in content and "[TOOL_CALLS]" not in content and "<tool_call>" not in content, content
            assert calls[0]["name"] == ref.tool_calls[0].function.name


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = CASES[1][1]
    content, calls, _, st = stream(make_parser("hermes"), text,
                                   chunks(text, random.Random(0), 4), max_calls=1)
    assert [c["name"] for c in calls] == ["get_current_weather"]
    assert json.loads(calls[0]["arguments"]) == WEATHER


def test_content_is_held_back_while_it_may_be_a_marker():
    st = ToolCallStreamer(make_parser("hermes"))
    assert st.update("Hello <tool_c")[0] == "Hello"
    assert st.update('Hello <tool_call>{"name": "f"')[0] == ""
    c, deltas = st.update('Hello <tool_call>{"name": "f", "arguments": {"q": "ab')
    assert [d.to_dict() for d in deltas] == [
        {"index": 0, "function": {"arguments": '{"q": "ab'}}]


def test_first_fragment_has_id_type_and_name():
    st = ToolCallStreamer(make_parser("hermes"))
    _, deltas = st.update('<tool_call>{"name": "get_time", "arguments": {"tz": "C')
    d = deltas[0].to_dict()
    assert d["index"] == 0 and d["type"] == "function" and d["id"].startswith("chatcmpl-tool-")
    assert d["function"] == {"name": "get_time", "arguments": ""}
    assert deltas[1].to_dict() == {"index": 0, "function": {"arguments": '{"tz": "C'}}


def test_qwen3_coder_streams_string_parameters_as_they_grow():
    p = make_parser("qwen3_coder")
    st = ToolCallStreamer(p)
    text = "<tool_call>\n<function=get_current_weather>\n<parameter=days>\n1"
    first = [d.to_dict() for d in st.update(text)[1]]
    assert first[0]["function"] == {"name": "get_current_weather", "arguments": ""}
    assert "".join(d["function"].get("arguments", "") for d in first) == "{"  # days unfinished
    text += "2\n</parameter>\n<parameter=city>\nNew Yo"
    (d,) = st.update(text)[1]
    assert d.to_dict()["function"]["arguments"] == '"days": 12, "city": "New Yo'


@pytest.mark.parametrize("value", [
    {"a": [1, {"b": "é\"x"}], "n": -3.25, "s": "😀 end", "t": None, "u": False},
    {"a": 12, "b": "x\\", "c": {"d": [], "e": {}}, "f": 1e-7, "g": "\u0000\t}]\""},
    [{"name": "f", "parameters": {"q": "ab"}}, {"name": "g", "parameters": {}}],
])
def test_stable_prefix_of_every_cut_is_a_prefix_of_the_final_text(value):
    for raw in (_j(value), json.dumps(value, indent=2)):
        final = _j(json.loads(raw))
        last = ""
        for cut in range(len(raw) + 1):
            v = partial_json(raw[:cut])
            prefix = stable_json_prefix(v) if v is not None else ""
            assert final.startswith(prefix), (raw[:cut], prefix)
            assert len(prefix) >= len(last) or last.startswith(prefix)
            last = prefix
        assert stable_json_prefix(json.loads(raw)) == final.rstrip('"]}')


def test_forced_parsers():
    req = RequiredToolParser(None)
    text = ('[{"name": "get_current_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "ping", "parameters": {}}]')
    info = req.extract_tool_calls(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_current_weather", {"city": "Paris"}), ("ping", {})]
    _, calls, _, _ = stream(RequiredToolParser(None), text, chunks(text, random.Random(1), 3))
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in info.tool_calls]
    named = NamedToolParser(None, "get_current_weather")
    raw = '{ "city" : "Paris" }'
    info = named.extract_tool_calls(raw)
    assert info.tool_calls[0].function.arguments == raw  # the output text, exactly
    _, calls, _, _ = stream(NamedToolParser(None, "get_current_weather"), raw,
                            chunks(raw, random.Random(2), 2))
    assert calls == [{"id": calls[0]["id"], "name": "get_current_weather", "arguments": raw}]


def test_adjust_request_keeps_special_tokens_only_for_special_markers():
    tok = SimpleNamespace(all_special_tokens=["[TOOL_CALLS]", "</s>"], added_tokens_decoder={})
    req = SimpleNamespace(skip_special_tokens=True, tools=None)
    ToolParserManager.get_tool_parser("mistral")(tok).adjust_request(req)
    assert req.skip_special_tokens is False
    req = SimpleNamespace(skip_special_tokens=True, tools=None)
    ToolParserManager.get_tool_parser("hermes")(tok).adjust_request(req)
    assert req.skip_special_tokens is True


def test_registry_and_plugin(tmp_path):
    assert {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml", "qwen3_coder",
            "deepseek_v3"} <= set(ToolParserManager.list_registered())
    with pytest.raises(KeyError, match="available: .*hermes"):
        ToolParserManager.get_tool_parser("nope")
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(textwrap.dedent('''
        from pagedllm.entrypoints.openai.tool_parsers import (ToolParse, ToolParser,
                                                              ToolParserManager)
        from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import call_from_object
        import json

        @ToolParserManager.register_module("my_call_prefix")
        class MyParser(ToolParser):
            def parse(self, text, final):
                if not text.startswith("CALL "):
                    return ToolParse(text if final or not "CALL ".startswith(text) else "", [])
                return ToolParse("", [call_from_object(json.loads(text[5:]))])
    '''))
    ToolParserManager.import_tool_parser(str(plugin))
    p = ToolParserManager.get_tool_parser("my_call_prefix")(None)
    info = p.extract_tool_calls('CALL {"name": "x", "arguments": {"k": 1}}')
    assert info.tool_calls[0].function.name == "x"
    with pytest.raises(ValueError, match="no such file"):
        ToolParserManager.import_tool_parser(str(tmp_path / "missing.py"))
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="boom"):
        ToolParserManager.import_tool_parser(str(bad))


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "deepseek_v3"])
def test_long_arguments_stream_exactly(name):
    """Past 1 KiB a growing call is re-parsed only every 1/32 of growth: the fragments get
    coarser but still rebuild the exact arguments, and still arrive in many pieces."""
    args = {"path": "notes.md", "content": "lorem ipsum \"dolor\" sit amet\n" * 400,
            "lines": list(range(300))}
    text = {"hermes": f'<tool_call>\n{{"name": "write", "arguments": {_j(args)}}}\n</tool_call>',
            "llama3_json": f'{{"name": "write", "parameters": {_j(args)}}}',
            "mistral": f'[TOOL_CALLS][{{"name": "write", "arguments": {_j(args)}}}]',
            "deepseek_v3": DS_BEGIN + _ds_call("write", args) + DS_END}[name]
    _, calls, frags, _ = stream(make_parser(name), text, chunks(text, random.Random(3), 6))
    assert [(c["name"], c["arguments"]) for c in calls] == [("write", _j(args))]
    assert sum(1 for f in frags if f["function"].get("arguments")) > 50
