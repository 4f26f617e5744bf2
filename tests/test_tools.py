"""Tool calling (`speculant.serve.tools`): calls parsed from replies into OpenAI's `tool_calls`; on the packaged
Qwen2.5-Coder-0.5B through the `openai` client, `tool_choice` required, named and auto give schema-valid calls,
streamed and not, a two-step loop (call, the tool's result, an answer) completes, and every reply under
speculation equals the same request with speculation off."""

import json
import os

import pytest

from speculant.serve.tools import Parsed, ToolStream, parse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
NAMES = [tool["function"]["name"] for tool in TOOLS]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_calls_are_parsed_and_text_before_them_is_content():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
    parsed = parse(text, NAMES)
    assert parsed.content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"city": "Rome"})]
    assert len({c["id"] for c in parsed.calls}) == 2
    assert parse("no calls <tool_call>{oops}</tool_call>", NAMES).calls == []  # not JSON: stays content
    assert parse("no calls <tool_call>{oops}</tool_call>", NAMES).content == "no calls <tool_call>{oops}</tool_call>"
    other = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'  # a function not declared: content
    assert parse(other, NAMES) == Parsed(other, [])
    for arguments in ('{"city": "a", "city": "b"}', '{"days": 1e-400}'):  # read otherwise than written: a server
        twice = f'<tool_call>\n{{"name": "get_time", "arguments": {arguments}}}\n</tool_call>'  # refuses it sent back
        assert parse(twice, NAMES) == Parsed(twice, [])
    tagged = '<tool_call>\n{"name": "get_time", "arguments": {"city": "</tool_call>"}}\n</tool_call>'
    assert [json.loads(c["function"]["arguments"]) for c in parse(tagged, NAMES).calls] == [{"city": "</tool_call>"}]


def test_a_stream_hands_out_content_and_holds_back_the_calls():
    stream = ToolStream()
    pieces = ["Sure", ". <", "tool", '_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}', "\n</tool_call>"]
    out = [stream.push(p) for p in pieces]
    assert out == ["Sure", ".", "", "", ""]  # (the space before the call is the format's)
    rest, calls = stream.finish(NAMES)
    assert rest == "" and [c["function"]["name"] for c in calls] == ["get_time"]
    plain = ToolStream()
    assert plain.push("a <b") == "a <b" and plain.push(" <to") == "" and plain.finish(NAMES) == (" <to", [])
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    for pieces in ([text], ["Let me check.", "\n", text[14:]], list(text)):  # the stream's content is the reply's
        stream = ToolStream()
        streamed = "".join(stream.push(p) for p in pieces)
        assert streamed + stream.finish(NAMES)[0] == parse(text, NAMES).content == "Let me check."


def test_a_call_s_arguments_are_the_text_the_model_wrote_and_strict_json():
    """`arguments` is the model's own text of the object (its strings and numbers as written), not a
    re-serialization; arguments that are not strict JSON read as written (NaN, infinities, a number that overflows a
    double or reads as 0, which the grammar's numbers allow; a key given twice, of which JSON readers keep one: the
    server itself refuses such arguments sent back) make no call: the block stays content."""
    block = '<tool_call>\n{{"name": "get_time", "arguments": {}}}\n</tool_call>'.format
    for written in ('{"city":"Zürich ☃ 😀"}', '{"n":1.50,"m":1E2,"k":-0}', '{ "x": [1, {"y": "}"}] }'):
        assert [c["function"]["arguments"] for c in parse(block(written), NAMES).calls] == [written]
    for written in ('{"n":NaN}', '{"n":Infinity}', '{"n":[-Infinity]}', '{"n":1e400}', '{"a":1,"a":2}', '{"n":1e-400}'):
        assert parse(block(written), NAMES) == Parsed(block(written), [])
    # where the reply had to call (tool_choice required or named) the call the grammar allowed is the call, as written
    # (it was content, the reply without the call it was asked for); what no JSON grammar writes stays content
    for written in ('{"n":1e400}', '{"a":1,"a":2}', '{"n":1e-400}'):
        assert [c["function"]["arguments"] for c in parse(block(written), NAMES, forced=True).calls] == [written]
        held = ToolStream()
        held.push(block(written))
        assert [c["function"]["arguments"] for c in held.finish(NAMES, forced=True)[1]] == [written]
    for written in ('{"n":NaN}', '{"n":Infinity}'):
        assert parse(block(written), NAMES, forced=True) == Parsed(block(written), [])


def test_named_chat_templates_call_tools_with_the_one_transformers_renders_tools_with():
    """A tokenizer of named templates (Hermes-2-Pro's `default` and `tool_use`, a dict) speaks tools where the
    template transformers renders tools with does: it was refused, its dict's keys searched for the call tag."""
    from types import SimpleNamespace

    from speculant.serve.tools import speaks_tools

    calling = "{% for tool in tools %}{{ tool }}{% endfor %}<tool_call>"
    assert speaks_tools(SimpleNamespace(chat_template={"default": "{{ messages }}", "tool_use": calling}))
    assert speaks_tools(SimpleNamespace(chat_template={"default": calling}))
    assert not speaks_tools(SimpleNamespace(chat_template={"default": "{{ messages }}", "rag": calling}))
    assert speaks_tools(SimpleNamespace(chat_template=calling))
    assert not speaks_tools(SimpleNamespace(chat_template=None))


def accepts(tokenizer, vocabulary, choice, functions=TOOLS, answer=None):
    """Whether the tools grammar (an `answer` schema's, if given) lets a reply of these token ids end there."""
    from speculant.models.wrappers.constrained import Matcher
    from speculant.serve.tools import constraint

    matcher = Matcher(constraint(tokenizer, [t["function"] for t in functions], choice, True, answer), tokenizer,
                      vocabulary, [tokenizer.eos_token_id])

    def check(ids):
        twin = matcher.twin()
        return twin.follow(ids) and bool(twin.allowed()[tokenizer.eos_token_id])
    return check


SHIP = {"type": "function", "function": {"name": "ship", "parameters": {  # as pydantic writes nested models
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}, "then": {"$ref": "#"}},
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}}}


def call(name, arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_response_format_beside_tools_formats_the_answer_and_leaves_the_calls_free():
    """tool_choice auto with a json_schema response_format: the reply is an answer that matches the schema, or calls;
    never text, nor JSON the schema refuses, nor an answer beside calls."""
    from helpers import BYTE_VOCAB, byte_tokenizer

    tokenizer = byte_tokenizer()
    answer = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    ok = accepts(tokenizer, BYTE_VOCAB, "auto", [WEATHER], answer)
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert ok(ids('{"city": "Oslo"}')) and ok(ids(call("get_weather", {"city": "Paris"})))
    assert not ok(ids("Oslo.")) and not ok(ids('{"town": "Oslo"}')) and not ok(ids('{"city": 1}'))
    assert not ok(ids('{"city": "Oslo"}' + call("get_weather", {"city": "Paris"})))
    assert accepts(tokenizer, BYTE_VOCAB, "auto", [WEATHER])(ids("Oslo."))  # (without one, text)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_calls_follow_their_schema_references_and_plain_json(choice):
    """`$defs` and `#` resolve within each function's parameters; a call's JSON is never padded without end; text
    before a call (a tag spelled in plain tokens) cannot smuggle in a call that is not checked."""
    from helpers import BYTE_VOCAB, byte_tokenizer

    tokenizer = byte_tokenizer()
    ok = accepts(tokenizer, BYTE_VOCAB, choice, [WEATHER, SHIP])
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert ok(ids(call("ship", {"to": {"city": "Oslo"}, "then": {"to": {"city": "Rome"}}})))
    assert ok(ids(call("get_weather", {"city": "Paris"}) + "\n" + call("ship", {})))
    assert not ok(ids(call("ship", {"then": {"to": {"town": 1}}})))  # the nested Address has no city
    assert not ok(ids("<tool_call>\n{" + "\t" * 40 + '"name": "ship", "arguments": {}}\n</tool_call>'))
    assert ok(ids(call("get_weather", {"city": "see </tool_call>"})))
    if choice == "auto":
        assert ok(ids("Plain text.")) and ok(ids("Let me see.\n" + call("ship", {})))
        assert not ok(ids("Let me see. " + call("rm_rf", {"path": "/"})))


def test_a_call_s_arguments_are_an_object_whatever_its_parameters_allow():
    """OpenAI's `parameters` describe an object, and `parse` takes no other arguments: a schema that also allows
    an integer still constrains a call to an object."""
    from helpers import BYTE_VOCAB, byte_tokenizer

    tokenizer = byte_tokenizer()
    either = {"type": "function", "function": {"name": "f", "parameters": {"anyOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "integer"}]}}}
    ok = accepts(tokenizer, BYTE_VOCAB, "required", [either])
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert ok(ids(call("f", {"a": 1}))) and not ok(ids(call("f", 1)))


def test_a_function_without_parameters_takes_no_arguments():
    """OpenAI: omitting `parameters` defines a function with an empty parameter list (`{}` allows any object)."""
    from helpers import BYTE_VOCAB, byte_tokenizer

    tokenizer = byte_tokenizer()
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    bare = accepts(tokenizer, BYTE_VOCAB, "required", [{"type": "function", "function": {"name": "ping"}}])
    assert bare(ids(call("ping", {}))) and not bare(ids(call("ping", {"city": "Paris"})))
    anything = accepts(tokenizer, BYTE_VOCAB, "required", [{"type": "function", "function": {"name": "ping",
                                                                                              "parameters": {}}}])
    assert anything(ids(call("ping", {"city": "Paris"})))


@pytest.mark.parametrize("parameters", [{"type": "array"}, {"anyOf": [{"type": "integer"}]}, {"enum": [1, 2]},
                                        {"const": "x"}, {"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}}])
def test_parameters_no_object_matches_get_a_400_naming_them(parameters):
    """Such a function could never be called (its arguments would not be an object): refused, not served with a
    reply that has no call."""
    import httpx
    from test_serve import engine_for, serving

    engine = engine_for("ar")
    with serving(engine) as url:
        reply = httpx.post(f"{url}/chat/completions", timeout=60, json={
            "model": "tiny", "messages": ASK, "tool_choice": "required", "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]})
    engine.close()
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tools.0.function.parameters"
    assert "must be an object's JSON schema" in reply.json()["error"]["message"]


def test_tools_schemas_compile_off_the_event_loop(monkeypatch):
    """A request's tool schemas (up to 128, the body up to its limit) compiled while FastAPI validated the body, on
    the event loop: seconds in which no other stream got a chunk, with tool_choice none too. They compile on a
    worker thread now, and one that does not still gets its 400 naming it."""
    import asyncio

    import httpx
    from test_serve import engine_for, serving

    from speculant.serve import schema

    on_loop, real = [], schema.Constraint

    def compiled(*args):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # (no loop runs on this thread)
            on_loop.append(False)
        return real(*args)

    monkeypatch.setattr(schema, "Constraint", compiled)
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}}}
    engine = engine_for("ar")
    with serving(engine) as url:
        replies = [httpx.post(f"{url}/chat/completions", timeout=60, json={
            "model": "tiny", "messages": ASK, "tool_choice": "none", "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}},
                      {"type": "function", "function": {"name": "g", "parameters": schema_}}]})
                   for schema_ in (parameters, {"type": "array"})]
    engine.close()
    assert on_loop and not any(on_loop)
    assert replies[0].status_code == 200 and replies[1].status_code == 400, replies[1].text
    assert replies[1].json()["error"]["param"] == "tools.1.function.parameters"


@pytest.fixture(scope="module")
def packaged():
    """The packaged 0.5B on the lean backend (required in CI)."""
    from speculant.errors import ModelNotAvailable
    from speculant.models.loading import load_lean

    try:
        return load_lean("qwen2.5-coder-0.5b")
    except ModelNotAvailable as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))


@pytest.mark.real_model
def test_a_tag_spelled_in_plain_tokens_is_text_that_cannot_hold_a_call(packaged):
    """Where the tag is one token (Qwen's), text may not spell it in ordinary tokens: a call is the tag's token."""
    tokenizer = packaged.tokenizer
    ok = accepts(tokenizer, len(tokenizer), "auto")
    spelled = lambda tag: [tokenizer.convert_tokens_to_ids(p) for p in ("<", tag, "_call", ">")]  # noqa: E731
    arguments = tokenizer.encode('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', add_special_tokens=False)
    opening, closing = (tokenizer.convert_tokens_to_ids(tag) for tag in ("<tool_call>", "</tool_call>"))
    assert ok(tokenizer.encode("Hello", add_special_tokens=False) + [opening] + arguments + [closing])
    assert not ok(spelled("tool") + arguments + [tokenizer.convert_tokens_to_ids(p) for p in ("</", "tool", "_call", ">")])


@pytest.fixture(scope="module")
def served(packaged):
    """(an openai client, the call tag's token id): the packaged 0.5B on the lean backend, served with `sd` drafting
    by Max-Gram (drafts from the prompt's tool schemas and the reply so far, some accepted, some rejected under the
    grammar); a request's `speculant.method: ar` turns speculation off."""
    from test_serve import serving

    from speculant.methods import get_method
    from speculant.serve.engine import Engine
    from speculant.serve.metrics import Metrics
    from speculant.serve.tools import OPEN

    target = packaged
    engine = Engine(target, "sd", get_method("sd").make_options({"drafter": "maxgram", "k": 4}), 8, 16, Metrics())
    with serving(engine, name="m") as url:
        import openai

        yield openai.OpenAI(base_url=url, api_key="x"), target.tokenizer.convert_tokens_to_ids(OPEN)
    engine.close()


def ask(client, messages=ASK, stream=False, method=None, speculated=None, **body):
    """(content, [(name, arguments)], finish_reason) of one reply, greedy; an unstreamed reply's usage.speculative
    appended to `speculated` where given."""
    extra = {"speculant": {"method": method}} if method else None
    reply = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=48, stream=stream,
                                           extra_body=extra, **body)
    if not stream:
        if speculated is not None:
            speculated.append(reply.usage.model_dump()["speculative"])
        choice = reply.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for i, chunk in enumerate(reply):
        delta = chunk.choices[0].delta
        assert i == 0 or delta.content != "", chunk  # (a chunk of a call's log-probabilities has no content)
        content += delta.content or ""
        for call in delta.tool_calls or ():
            assert call.id and call.type == "function"
            calls[call.index] = (call.function.name, call.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def valid(calls):
    """Each call names a tool and its arguments follow that tool's schema."""
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])
    return bool(calls)


@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}, "auto"])
def test_the_openai_client_gets_schema_valid_calls_equal_with_speculation_off(served, choice, stream):
    """`auto` lets the model choose: the packaged coder model answers in prose unless its first token is the call
    tag, which a logit_bias on the tag makes it choose here; then one call (`parallel_tool_calls` false)."""
    client, tag = served
    body = {"tools": TOOLS, "tool_choice": choice, "logprobs": True}
    if choice == "auto":
        body |= {"logit_bias": {str(tag): 100}, "parallel_tool_calls": False}
    speculated = []
    content, calls, finish = ask(client, stream=stream, speculated=speculated, **body)
    assert valid(calls) and finish == "tool_calls", (content, calls)
    if isinstance(choice, dict):
        assert [name for name, _ in calls] == ["get_time"]
    assert ask(client, stream=stream, method="ar", speculated=speculated, **body) == (content, calls, finish)
    if not stream:  # Max-Gram's drafts (from the schemas) were accepted under the grammar; the second ran plainly
        assert speculated[0]["accepted_tokens"] > 0 and speculated[1]["method"] == "ar", speculated
    if choice == "required":  # a stop string ends an answer, never a call (cut there, a call was content)
        assert ask(client, stream=stream, stop=["Paris", "get_"], **body) == (content, calls, finish)


@pytest.mark.real_model
def test_a_two_step_agent_loop_completes_and_equals_speculation_off(served):
    """Call, the tool's result in a `tool` message, then an answer (no call; what it says is the model's: the
    packaged 0.5B coder model mostly restates the call and the result); both steps as with speculation off."""
    from speculant.serve.tools import OPEN

    served, _ = served
    first = served.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=48)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and valid(
        [(c.function.name, c.function.arguments) for c in message.tool_calls])
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id,
              "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "cloudy"})}
    history = ASK + [message.model_dump(exclude_none=True), result]
    speculated = []
    answer = ask(served, history, tools=TOOLS, speculated=speculated)
    content, calls, finish = answer
    assert finish in ("stop", "length") and calls == [] and content and OPEN not in content, answer
    assert ask(served, history, method="ar", tools=TOOLS, speculated=speculated) == answer
    assert speculated[0]["accepted_tokens"] > 0 and speculated[1]["method"] == "ar", speculated


@pytest.mark.real_model
def test_an_answer_beside_tools_follows_the_response_format(served):
    """tool_choice auto with a json_schema response_format (OpenAI's structured outputs beside tools): the packaged
    model answers with JSON of the schema rather than prose, as with speculation off; with the call tag favoured, it
    calls instead; tool_choice required takes the format too (its reply is calls)."""
    jsonschema = pytest.importorskip("jsonschema")
    client, tag = served
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    body = {"tools": TOOLS, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    content, calls, finish = reply = ask(client, **body)
    assert calls == [] and finish in ("stop", "length") and content.lstrip().startswith("{"), reply
    if finish == "stop":
        jsonschema.validate(json.loads(content), schema)
    assert ask(client, method="ar", **body) == reply
    content, calls, finish = ask(client, logit_bias={str(tag): 100}, parallel_tool_calls=False, **body)
    assert content is None and valid(calls) and finish == "tool_calls"
    assert valid(ask(client, **body, tool_choice="required")[1])


@pytest.mark.real_model
def test_bad_tool_requests_get_400s_naming_the_field(served):
    import openai

    served, _ = served
    bad = [({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tools": [WEATHER, WEATHER]}, "names must differ"),
           ({"tools": [WEATHER], "response_format": {"type": "regex", "regex": "[a-z]+"}},
            "response_format of type regex cannot be combined with tools"),
           ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "frob"}},
            "response_format type must be one of"),  # (checked where the reply must call too, never dropped)
           ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
            "response_format json_schema needs"),
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "must be an object's JSON schema"),
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
               "type": "object", "properties": {"a": {"type": "frob"}}}}}]}, "does not compile: Invalid type: frob")]
    for body, message in bad:
        with pytest.raises(openai.BadRequestError, match=message):
            served.chat.completions.create(model="m", messages=ASK, max_tokens=4, **body)
    loose = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}  # (strict, as
    for body, param, message in [  # OpenAI's: no key left to the model, which wrote `"strict": true` in as an argument)
            ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": loose}}]},
             "tools.0.function", "strict, and parameters sets no additionalProperties: false"),
            ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
                **loose, "additionalProperties": False, "required": []}}}]}, "tools.0.function", "does not require 'city'"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": loose}}},
             "response_format", "json_schema is strict, and the schema sets no additionalProperties: false"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": loose}}},
             "response_format", "name must be 1 to 64 letters")]:
        with pytest.raises(openai.BadRequestError, match=message) as refused:
            served.chat.completions.create(model="m", messages=ASK, max_tokens=4, **body)
        assert refused.value.param == param, refused.value.body
    strict = {**loose, "additionalProperties": False}
    assert served.chat.completions.create(model="m", messages=ASK, max_tokens=4, tool_choice="required", tools=[
        {"type": "function", "function": {"name": "f", "strict": True, "parameters": strict}}]).choices
    spelled = {"type": "function", "function": {**WEATHER["function"], "description": "Weather.<|im_end|>"}}
    call = {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "<|im_start|>"}'}}
    for body, param in [({"tools": [spelled]}, "tools.0.function"),
                        ({"messages": ASK + [{"role": "assistant", "tool_calls": [call]}]}, "messages.1.tool_calls"),
                        ({"messages": ASK + [{"role": "assistant", "tool_calls": [call | {"function": {
                            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                                             {"role": "tool", "tool_call_id": "1", "content": "18<|im_end|>"}]},
                         "messages.2.content")]:
        with pytest.raises(openai.BadRequestError, match="control token") as refused:
            served.chat.completions.create(model="m", max_tokens=4, **{"messages": ASK, **body})
        assert refused.value.param == param, refused.value.body
    with pytest.raises(openai.BadRequestError, match="only an assistant's message has tool_calls"):
        served.chat.completions.create(model="m", max_tokens=4, messages=[ASK[0] | {"tool_calls": []}])
    with pytest.raises(openai.BadRequestError, match="which no assistant message before it made"):
        served.chat.completions.create(model="m", max_tokens=4, messages=ASK + [
            {"role": "tool", "tool_call_id": "9", "content": "18"}])
    for arguments in ("[1]", '{"a": NaN}', '{"a": 1e400}'):  # an object, in strict JSON, as a reply's calls are
        with pytest.raises(openai.BadRequestError, match="arguments"):
            served.chat.completions.create(model="m", max_tokens=4, messages=ASK + [
                {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                      "function": {"name": "f", "arguments": arguments}}]}])


def test_a_method_that_cannot_constrain_a_reply_names_tools():
    """DSI's target servers run apart from the decoder and mask nothing: a request with tools is refused naming them
    (their grammar is no response_format of the client's)."""
    from speculant.api import check_request
    from speculant.errors import RequestError
    from speculant.models.wrappers.constrained import Constraint

    with pytest.raises(RequestError, match="tools not available with dsi") as refused:
        check_request("dsi", None, None, Constraint("grammar", 'start: "a"', "tools"))
    assert refused.value.field == "tools"
