"""Tool calling without a server (issue 19): the Hermes parser (``tool_choice`` auto), the
parsers of grammar-forced calls, streaming deltas, the tool modes and their grammars, and the
conversation the chat template receives (Hermes-style tool prompt for templates without tool
support, such as SmolLM2's; ``tools`` passed to templates that render them). One test runs the
default model (SmolLM2) with a forced call, through its real tokenizer."""
from __future__ import annotations

import json

import jsonschema
import pytest

from llmkit.entrypoints.openai.errors import OpenAIError
from llmkit.entrypoints.openai.protocol import ChatCompletionRequest
from llmkit.entrypoints.openai.serving import _chat_message
from llmkit.entrypoints.openai.tool_parsers import (TOOL_PARSERS, HermesToolParser,
                                                    NamedFunctionParser,
                                                    RequiredToolCallsParser,
                                                    check_tool_call_parser)
from llmkit.entrypoints.openai.tool_parsers.streaming import ToolCallStreamer
from llmkit.entrypoints.openai.chat_prompt import (TOOL_PROMPT, template_messages,
                                                   template_supports_tools, tool_use)
from llmkit.structured_output.xgrammar_backend import XgrammarBackend

from helpers.tool_specs import SCHEMA_OF, TOOLS

# SmolLM2-135M-Instruct's chat template (from its GGUF): it knows no tools and concatenates
# message['content'], so an assistant turn with content None breaks it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
# A template that renders tools itself (reads `tools` and the calls' arguments as objects).
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}({{ c.function.arguments.city }})"
    "{% endfor %}{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}")

HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Paris", "days": 2, "note": "a \\"}\\" brace"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "search", "arguments": {"query": "rain"}}\n</tool_call>')
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "user", "content": "Thanks!"}]


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": HISTORY, **kw})


def stream_through(parser, text: str, step: int = 1) -> tuple[str, dict[int, dict]]:
    """Feed ``text`` in pieces; rebuild content and calls from the deltas as a client does."""
    st = ToolCallStreamer(parser)
    content, calls = "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        delta = st.feed(piece, k == len(pieces) - 1)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["function"]["name"]
                calls[d["index"]] = {"name": d["function"]["name"], "args": ""}
            calls[d["index"]]["args"] += d["function"].get("arguments", "")
    return content, calls


# --------------------------------------------------------------------------- parsers

def test_hermes_parses_calls_and_content():
    out = HermesToolParser().parse(HERMES_TEXT, final=True)
    assert out.content == "Let me check.\n"
    assert [c.name for c in out.tool_calls] == ["get_weather", "search"]
    assert json.loads(out.tool_calls[0].arguments) == {"city": "Paris", "days": 2,
                                                       "note": 'a "}" brace'}


@pytest.mark.parametrize("text", [
    "Just text, no calls.",
    'Text <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut short
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
])
def test_hermes_without_valid_calls_is_all_content(text):
    out = HermesToolParser().parse(text, final=True)
    assert out.content == text and out.tool_calls == []


@pytest.mark.parametrize("step", [1, 3, 7])
def test_hermes_streams_the_same_calls(step):
    content, calls = stream_through(HermesToolParser(), HERMES_TEXT, step)
    final = HermesToolParser().parse(HERMES_TEXT, final=True)
    assert content == final.content
    assert [c["name"] for c in calls.values()] == [c.name for c in final.tool_calls]
    for c, f in zip(calls.values(), final.tool_calls):
        assert json.loads(c["args"]) == json.loads(f.arguments)


def test_hermes_holds_back_a_possible_tag_then_releases_it():
    parser = HermesToolParser()
    assert parser.parse("The answer <tool_c", final=False).content == "The answer "
    content, calls = stream_through(parser, "The answer <tool_c is no tag")
    assert content == "The answer <tool_c is no tag" and not calls


REQUIRED_TEXT = ('<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}'
                 '\n</tool_call>')


def test_forced_parsers_and_their_streams():
    out = RequiredToolCallsParser().parse(REQUIRED_TEXT, final=True)
    assert out.content is None and [c.name for c in out.tool_calls] == ["search", "get_weather"]
    content, calls = stream_through(RequiredToolCallsParser(), REQUIRED_TEXT)
    assert content == "" and [json.loads(c["args"]) for c in calls.values()] == [
        {"query": "x"}, {"city": "Rome", "days": 3}]
    named = NamedFunctionParser("search")
    assert named.parse(' {"query": "y"}', final=True).tool_calls[0].arguments == '{"query": "y"}'
    content, calls = stream_through(named, '{"query": "y"}')
    assert calls == {0: {"name": "search", "args": '{"query": "y"}'}}


@pytest.mark.parametrize("cut", [len(REQUIRED_TEXT) - 30, len(REQUIRED_TEXT) - 14])
def test_a_cut_call_is_kept_with_its_arguments_so_far(cut):
    """max_tokens cuts the second call: the complete response and the stream both hold it with
    the argument text written so far (issue 31: the stream sent it, the response dropped it)."""
    text = REQUIRED_TEXT[:cut]
    so_far = text[text.rindex('"arguments": ') + len('"arguments": '):]
    final = RequiredToolCallsParser().parse(text, final=True).tool_calls
    assert [(c.name, c.arguments) for c in final] == [("search", '{"query": "x"}'),
                                                      ("get_weather", so_far)]
    _, streamed = stream_through(RequiredToolCallsParser(), text)
    assert [(c["name"], c["args"]) for c in streamed.values()] == [
        ("search", '{"query": "x"}'), ("get_weather", so_far)]
    use = tool_use(request(tools=TOOLS, tool_choice="required"), HermesToolParser())
    msg, reason = _chat_message(text, "length", use)
    assert reason == "length" and [c.function.arguments for c in msg.tool_calls] == [
        '{"query": "x"}', so_far]
    # a named function's arguments cut short: the same in both
    named = NamedFunctionParser("search")
    assert named.parse('{"query": "y', final=True).tool_calls[0].arguments == '{"query": "y'
    assert stream_through(named, '{"query": "y')[1] == {0: {"name": "search",
                                                            "args": '{"query": "y'}}


def test_finish_reason_is_tool_calls_only_for_complete_calls():
    use = tool_use(request(tools=TOOLS), HermesToolParser())
    msg, reason = _chat_message(HERMES_TEXT, "stop", use)
    assert reason == "tool_calls" and len(msg.tool_calls) == 2
    msg, reason = _chat_message("plain answer", "stop", use)
    assert reason == "stop" and msg.content == "plain answer" and not msg.tool_calls
    msg, reason = _chat_message(HERMES_TEXT, "length", use)
    assert reason == "length"


def test_parser_names():
    assert "hermes" in TOOL_PARSERS.names()
    check_tool_call_parser("auto")
    with pytest.raises(ValueError, match="server.tool_call_parser: got 'nope'"):
        check_tool_call_parser("nope")


# --------------------------------------------------------------------------- modes, grammars

def test_tool_modes_and_forced_grammars(accepts):
    auto = tool_use(request(tools=TOOLS), HermesToolParser())
    assert auto.mode == "auto" and auto.structured_outputs is None and auto.in_prompt
    assert tool_use(request(), HermesToolParser()).mode == "none"
    none = tool_use(request(tools=TOOLS, tool_choice="none"), HermesToolParser())
    assert none.parser is None and not none.in_prompt
    one = tool_use(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
                   HermesToolParser())
    XgrammarBackend.validate(one.structured_outputs)
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n</tool_call>'
    assert accepts(one, call, then_eos=True)
    assert not accepts(one, call + "\n" + call)  # one call only
    assert not accepts(one, call.replace('{"query": "q"}', '{"city": "Rome"}'))  # its schema
    named = tool_use(request(tools=TOOLS, tool_choice={"type": "function",
                                                         "function": {"name": "get_weather"}}),
                     HermesToolParser())
    assert named.structured_outputs.json == SCHEMA_OF["get_weather"]
    for bad in ({"tool_choice": "required"},
                {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
                {"tools": TOOLS + TOOLS[:1]}):
        with pytest.raises(OpenAIError) as e:
            tool_use(request(**bad), HermesToolParser())
        assert e.value.status == 400


def test_required_grammar_shares_defs(accepts):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}},
                            "required": ["x"]}}}}}]
    use = tool_use(request(tools=tools, tool_choice="required"), HermesToolParser())
    XgrammarBackend.validate(use.structured_outputs)
    assert accepts(use, '<tool_call>\n{"name": "f", "arguments": {"p": {"x": 1}}}\n</tool_call>',
                   then_eos=True)
    assert not accepts(use, '<tool_call>\n{"name": "f", "arguments": {"p": {"y": 1}}}')


@pytest.mark.parametrize("any_whitespace", [True, False])
def test_parallel_required_calls_may_end_after_any_call(accepts, any_whitespace):
    """Issue 31: with parallel_tool_calls the grammar lets the output end (its stop token)
    after the first complete call and after any later one, never inside a call; a call that
    breaks its function's schema is refused."""
    use = tool_use(request(tools=TOOLS, tool_choice="required"), HermesToolParser(),
                   any_whitespace=any_whitespace)
    XgrammarBackend.validate(use.structured_outputs)
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' \
            '\n</tool_call>'
    second = '<tool_call>\n{"name": "search", "arguments": {"query": "rain"}}\n</tool_call>'
    assert accepts(use, first, then_eos=True)
    assert accepts(use, first + "\n" + second, then_eos=True)
    assert accepts(use, first + "\n" + second + "\n" + first, then_eos=True)
    assert not accepts(use, first[:-3], then_eos=True)  # no end inside a call
    assert not accepts(use, "", then_eos=True)  # at least one call
    assert not accepts(use, first.replace("Paris", "Lyon"))
    # the model's own whitespace only where the engine allows it
    spaced = first.replace('{"city"', '{\n  "city"')
    assert accepts(use, spaced) == any_whitespace
    parsed = RequiredToolCallsParser().parse(first + "\n" + second, final=True).tool_calls
    for c in parsed:
        jsonschema.validate(json.loads(c.arguments), SCHEMA_OF[c.name])


@pytest.fixture(scope="module")
def accepts(tiny_tokenizer):
    """``accepts(use, text, then_eos=False)``: xgrammar's matcher on the tool grammar accepts
    ``text`` (as a prefix), and with ``then_eos`` the stop token may follow and ends it."""
    import xgrammar as xgr

    from llmkit.structured_output import structured_output_key

    backend = XgrammarBackend(tokenizer=tiny_tokenizer, vocab_size=len(tiny_tokenizer))
    eos = tiny_tokenizer.eos_token_id

    def check(use, text: str, then_eos: bool = False) -> bool:
        matcher = xgr.GrammarMatcher(backend.compile(
            structured_output_key(use.structured_outputs)))
        if not matcher.accept_string(text):
            return False
        return not then_eos or (matcher.accept_token(eos) and matcher.is_terminated())

    return check


# --------------------------------------------------------------------------- the prompt

def test_template_without_tool_support_gets_the_hermes_prompt(tiny_tokenizer):
    assert not template_supports_tools(SMOLLM2_TEMPLATE)
    req = request(tools=TOOLS)
    messages, kwargs = template_messages(req, tool_use(req, HermesToolParser()), native=False)
    assert kwargs == {}
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert '"name": "get_weather"' in messages[0]["content"]
    assert TOOL_PROMPT.splitlines()[0] in messages[0]["content"]
    assistant = messages[2]
    assert assistant["content"].startswith("<tool_call>\n{")
    assert json.loads(assistant["content"].split("\n")[1]) == {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 1}}
    assert messages[3] == {"role": "user",
                           "content": '<tool_response>\n{"temperature": 21}\n</tool_response>'}
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True,
                                              chat_template=SMOLLM2_TEMPLATE)
    assert "You are a helpful AI assistant named SmolLM" not in text  # ours is the system turn
    assert "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")
    # tool_choice none: no tools in the prompt, the history still renders
    req = request(tools=TOOLS, tool_choice="none")
    messages, _ = template_messages(req, tool_use(req, HermesToolParser()), native=False)
    assert all("<tools>" not in m["content"] for m in messages)
    tiny_tokenizer.apply_chat_template(messages, tokenize=False, chat_template=SMOLLM2_TEMPLATE)


def test_template_with_tool_support_receives_tools(tiny_tokenizer):
    assert template_supports_tools(TOOLS_TEMPLATE)
    req = request(tools=TOOLS)
    messages, kwargs = template_messages(req, tool_use(req, HermesToolParser()), native=True)
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False,
                                              chat_template=TOOLS_TEMPLATE, **kwargs)
    assert text.startswith("TOOLS get_weather;search;")
    assert "CALL get_weather(Paris)" in text and "FOR call_1" in text


# --------------------------------------------------------------------------- the default model

@pytest.mark.real_model
def test_default_model_forced_tool_call_validates(smollm2_gguf):
    """SmolLM2's own tokenizer (GGUF, 49k tokens) through xgrammar: a required tool call with
    the Hermes-style prompt; its arguments validate."""
    from llmkit import LLM, SamplingParams

    llm = LLM(str(smollm2_gguf), platform={"num_threads": 2},
              structured_output={"disable_any_whitespace": True})
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "What is the weather in Rome for 3 days?"}],
        "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    use = tool_use(req, HermesToolParser())
    messages, _ = template_messages(req, use, native=False)
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=60,
                                            structured_outputs=use.structured_outputs),
                   use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    calls = use.parser.parse(out.text, final=True).tool_calls
    assert len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA_OF[calls[0].name])
    llm.shutdown()
