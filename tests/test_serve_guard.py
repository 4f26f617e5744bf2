"""`speculant serve` against an adversarial client: per-request options are data (never a file, a device, an
executor or a process), every refusal and fault is a JSON error in OpenAI's shape with the right status (a fuzz test
over both endpoints finds no 500), the body limit answers before the body is read, unknown paths share one metrics
label, the API key guards every route but /health, logprobs keep bytes, and a long prompt neither stalls a short
request nor outlives its client (lean and llama.cpp)."""

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from dataclasses import fields
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from helpers import bpe_tokenizer, byte_tokenizer, tiny_model
from test_serve import SlowDrafter, engine_for, serving, submitted, wait_until

from speculant import generate
from speculant.config import SamplingConfig, ServeConfig
from speculant.drafters.base import Draft, Drafter
from speculant.errors import ConfigError, OptionError
from speculant.methods import get_method
from speculant.methods.registry import METHODS, request_options
from speculant.models import load_model
from speculant.models.wrappers.logprobs import TokenLogprob
from speculant.serve.app import create_app
from speculant.serve.replies import Shape, Spelling
from speculant.serve.batcher import Batcher
from speculant.serve.engine import Engine, ServeJob

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def app():
    engine = engine_for("sd", max_batch=4, max_queue=16)
    with TestClient(create_app(engine, "tiny"), raise_server_exceptions=False) as client:
        yield engine, client
    engine.close()


def is_error(response, status, param=None):
    body = response.json()
    assert response.status_code == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def completion(**fields):
    return {"model": "tiny", "prompt": "ab", "max_tokens": 2, **fields}


def test_no_request_option_names_a_file_a_device_an_executor_or_a_process(app, tmp_path):
    _, client = app
    existing = tmp_path / "exists.json"
    existing.write_text("{}")
    operator = {(m.name, f.name) for m in METHODS.values() for f in fields(m.options) if f.metadata.get("operator")}
    assert {("dsi", "executor"), ("dsi", "twin_latency"), ("dsi", "target_devices"), ("dsi", "ray_address"),
            ("dsi", "servers"), ("tree", "target_profile"), ("tree", "depth_predictor")} <= operator
    for method, name in sorted(operator):
        answers = []
        for value in (str(existing), str(tmp_path / "missing.json"), "process", "cuda:7", 4):
            response = client.post("/v1/completions", json=completion(speculant={"method": method, name: value}))
            answers.append(is_error(response, 400, f"speculant.{name}")["message"])
        assert len(set(answers)) == 1, answers  # the same answer whether the file exists or not: nothing was read
    for method in METHODS:  # what a request may set is data, and the README lists it
        assert not {name for m, name in operator if m == method} & set(request_options(method))
        listed = re.search(rf"^- `{method}`: (.*)$", README.read_text(), re.M)
        assert listed, f"README lists no per-request options of {method}"
        assert re.findall(r"`(\w+)`", listed.group(1)) == request_options(method) or \
            (not request_options(method) and "none" in listed.group(1))


@pytest.mark.parametrize("method, name", [("sd", "k"), ("tree", "depth"), ("tree", "width"), ("auto", "k_max"),
                                          ("auto", "tree_widths"), ("cascade", "k"), ("cascade", "k_matrix"),
                                          ("dsi", "lookahead")])
def test_a_request_s_draft_sizes_are_bounded_however_they_are_spelled(app, method, name):
    """The bound holds on the parsed value: a number, its text, or (an option holding several) a list of them; a
    list where one value goes is refused as such."""
    _, client = app
    for value in (100000, "100000") + (([100000], [2, 100000]) if name == "tree_widths" else ()):
        response = client.post("/v1/completions", json=completion(speculant={"method": method, name: value}))
        assert "at most 64" in is_error(response, 400, f"speculant.{name}")["message"], value


def test_a_request_s_lists_and_trees_are_bounded(app):
    """A list option has at most 8 items (nested rows too), and a tree at most 128 nodes: each node is drafted and
    verified in forwards the other requests wait on, no wider than the part of a long prompt they would wait on."""
    from speculant.config import REQUEST_NODES
    from speculant.models.backends.lean import SERVED_PART

    assert REQUEST_NODES <= SERVED_PART
    _, client = app
    for options, param, message in [
            ({"method": "auto", "tree_widths": [2] * 9}, "tree_widths", "at most 8 items"),
            ({"method": "cascade", "drafters": ",".join([f"m{i}" for i in range(8)] + ["maxgram"])}, "drafters",
             "at most 8 items"),
            ({"method": "tree", "depth": 16, "width": 16}, "width", "at most 128 nodes"),
            ({"method": "tree", "depth": 64}, "depth", "at most 128 nodes"),
            ({"method": "tree", "depth": "auto", "width": 64}, "width", "auto (up to 16) x 64"),
            ({"method": "auto", "tree_widths": [16]}, "tree_widths", "at most 128 nodes"),
            ({"method": "auto", "tree_widths": [4], "k_max": 64}, "tree_widths", "4 x 64")]:
        response = client.post("/v1/completions", json=completion(speculant=options))
        assert message in is_error(response, 400, f"speculant.{param}")["message"], options
    for options in ({"method": "tree", "depth": 32, "width": 4}, {"method": "tree", "depth": "auto", "width": 8},
                    {"method": "tree", "width": "auto", "depth": 16}, {"method": "auto", "tree_widths": [2] * 8},
                    {"method": "auto", "k_max": 64}):
        assert client.post("/v1/completions", json=completion(speculant=options)).status_code == 200, options


def test_an_operator_s_own_sizes_bind_only_the_client_that_names_a_size():
    """The operator may serve larger trees than a client may ask for: a request naming other options keeps them."""
    engine = engine_for("tree", depth=16, width=16, depth_predictor="off")
    for method in (None, "tree"):
        spec, options = engine.options_for(method, {"objective": "length"})
        assert (options.depth, options.width) == (16, 16)  # (naming the server's method keeps its settings too)
    with pytest.raises(ConfigError, match="at most 128 nodes"):
        engine.options_for(None, {"depth": 12})
    engine.close()


@pytest.mark.parametrize("options, param", [
    ({"k": 0}, "k"), ({"method": "auto", "k_max": 0}, "k_max"), ({"method": "auto", "probe_every": 0}, "probe_every"),
    ({"method": "auto", "tree_widths": [1, 2]}, "tree_widths"), ({"draft_confidence": 2}, "draft_confidence"),
    ({"drafter": "nope"}, "drafter"), ({"method": "cascade", "drafters": []}, "drafters"),  # (a null: the default)
    ({"method": "auto", "drafters": ""}, "drafters"), ({"method": ""}, "method"),
    ({"k": [2]}, "k"), ({"k": "1_0"}, "k"), ({"k": "\u0663"}, "k"), ({"drafter": ["maxgram"]}, "drafter"),
    ({"method": "cascade", "drafters": "maxgram,maxgram"}, "drafters"),
    ({"method": "cascade", "drafters": "maxgram", "k_matrix": "2", "leniency": 0.5}, "leniency"),
    ({"method": "cascade", "drafters": "maxgram", "k_matrix": "2,2"}, "k_matrix"),
    ({"method": "tree", "schedule": "stage"}, "schedule"),
    ({"method": "auto", "drafters": "maxgram", "tree_widths": [4]}, "tree_widths")])
def test_an_option_an_options_class_refuses_is_named(app, options, param):
    """A value each option's own parse takes but its options class refuses (a range, a combination) is named: the
    first option that, added to the method's defaults, makes them fail."""
    _, client = app
    is_error(client.post("/v1/completions", json=completion(speculant=options)), 400, f"speculant.{param}")


def test_an_unknown_option_is_told_what_a_request_may_set_not_the_operator_s_options(app):
    """The refusal of a name no option of the method has lists what a client may set: it listed the operator's
    options too (`drafter_dtype`), which a request that then sent one found refused in turn."""
    _, client = app
    for options, where in (({"method": "sd", "foo": 1}, "unknown option 'foo'"),
                           ({"method": "sd", "depth": 3}, "option 'depth' does not apply to method 'sd'")):
        error = is_error(client.post("/v1/completions", json=completion(speculant=options)), 400,
                         f"speculant.{next(iter(options.keys() - {'method'}))}")
        takes = re.search(r"'sd' takes: ([^)]*)\)", error["message"])
        assert where in error["message"] and takes, error["message"]
        assert takes.group(1).split(", ") == request_options("sd"), error["message"]


def test_a_tree_without_a_model_drafter_names_the_drafter_where_the_server_drafts_with_max_gram():
    """The server's own drafter Max-Gram: a tree request naming it is refused naming `speculant.drafter`, the value
    at fault (the method's defaults alone fail too, which would name the method)."""
    engine = engine_for("sd", drafter="maxgram")
    with TestClient(create_app(engine, "tiny"), raise_server_exceptions=False) as client:
        request = completion(speculant={"method": "tree", "drafter": "maxgram"})
        assert "needs a model drafter" in is_error(client.post("/v1/completions", json=request), 400,
                                                   "speculant.drafter")["message"]
    engine.close()


def test_a_chat_prompt_is_named_messages_and_one_limit_is_given():
    engine = engine_for("sd")
    with TestClient(create_app(engine, "tiny"), raise_server_exceptions=False) as client:
        many = [{"role": "user", "content": "ab"}] * 200
        response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": many, "max_tokens": 2})
        assert "positions" in is_error(response, 400, "messages")["message"]
        both = {"model": "tiny", "messages": many[:1], "max_tokens": 2, "max_completion_tokens": 4}
        is_error(client.post("/v1/chat/completions", json=both), 400, "max_completion_tokens")
    engine.close()


def test_a_request_s_default_drafters_are_the_server_s_whatever_other_requests_added():
    """A drafter one request adds (Max-Gram, which costs nothing to load) is not drawn into the next request's
    defaults: the server's method keeps its own drafters and another method defaults to them."""
    engine = engine_for("sd")
    before = [engine.options_for(method, {"k": 3} if method == "sd" else {}) for method in ("sd", "cascade")]
    engine.options_for("sd", {"drafter": "maxgram"})
    assert "maxgram" in engine.models
    after = [engine.options_for(method, {"k": 3} if method == "sd" else {}) for method in ("sd", "cascade")]
    assert [(s.name, o) for s, o in before] == [(s.name, o) for s, o in after]
    assert after[0][1].drafter is engine.options.drafter and after[1][1].drafters == (engine.options.drafter,)
    # a drafter the server was handed as a model is listed, and named by a request, by its name
    named = engine.options.drafter.name
    assert engine.models == [named, "maxgram"]
    with pytest.raises(OptionError, match=f"'foo' is not loaded on this server \\(loaded: {named}, maxgram\\)$"):
        engine.options_for("sd", {"drafter": "foo"})
    for value in ({"a": 1}, [["maxgram"]]):  # (their text had been taken for a drafter's name)
        with pytest.raises(OptionError, match="drafters takes text, a number, true or false, or a list of them; got "):
            engine.options_for("auto", {"drafters": value})
    assert str(engine.options_for("sd", {"drafter": named})[1].drafter) == named
    engine.close()

    class Named(Drafter):
        def __init__(self, name):
            self.name = name

        def propose(self, context, k):
            return Draft([])

    # a user's Drafter object serves requests that give options (its check is what the server holds); a name of a
    # built-in, or of another drafter, would stand for two: refused as the server starts
    for method, options, asked in (("sd", {"drafter": Named("mine")}, {"k": 3}),
                                   ("auto", {"drafters": (Named("mine"), "maxgram")}, {"k_max": 4})):
        engine = engine_for(method, **options)
        assert engine.models == ["mine", "maxgram"] and engine.options_for(method, asked)[0].name == method
        engine.close()
    for options, taken in (({"drafter": Named("maxgram")}, "a drafter object is named 'maxgram', as a built-in"),
                           ({"drafter": Named("self")}, "a drafter object is named 'self', as a built-in"),
                           ({"drafters": (Named("a"), Named("a"))}, "two of the server's drafters go by 'a'")):
        with pytest.raises(ConfigError, match=taken):
            engine_for("auto" if "drafters" in options else "sd", **options)


def test_a_request_naming_one_of_a_pair_of_options_is_not_overruled_by_the_other_s_default():
    """DSI runs `drafters` where given, else `drafter`; a cascade its `k_matrix` where given, else k per level. A
    request naming either of a pair gets it, whatever the operator gave the server's own method."""
    for engine in (engine_for("sd"), engine_for("dsi", drafter="maxgram", drafters="maxgram,maxgram")):
        _, options = engine.options_for("dsi", {"drafter": "maxgram"})
        assert str(options.drafter) == "maxgram" and options.drafters is None
        _, options = engine.options_for("dsi", {"drafters": "maxgram"})
        assert [str(d) for d in options.drafters] == ["maxgram"]
        engine.close()
    for operator, request, expected in [({"k": 5}, {"k_matrix": "2"}, [[2]]), ({"k_matrix": "2"}, {"k": 3}, None)]:
        engine = engine_for("cascade", drafters="maxgram", **operator)
        _, options = engine.options_for(None, request)
        assert (options.k_matrix, options.k) == (expected, request.get("k", 4)), (operator, request)
        engine.close()


def test_a_method_the_target_s_backend_cannot_run_is_a_4xx_naming_it(monkeypatch):
    """A request for DSI on a target whose backend makes no replicas (the lean backend's; here transformers' with
    that capability taken away) is refused when read, naming `speculant.method`, as the CLI refuses it before
    loading."""
    from dataclasses import replace

    engine = engine_for("sd")
    with pytest.raises(ConfigError) as refused:  # (an OptionError: the app names speculant.<its name>)
        monkeypatch.setattr(type(engine.target), "capabilities", replace(engine.target.capabilities, replicates=False))
        engine.options_for("dsi", {"drafter": "maxgram"})
    assert refused.value.option == "method" and "does not offer that" in str(refused.value)
    assert str(refused.value).endswith("(load it on the llamacpp backend)")  # (transformers' taken away here)
    monkeypatch.undo()
    assert engine.options_for("dsi", {"drafter": "maxgram"})[0].name == "dsi"
    engine.close()


def test_a_refused_option_is_a_4xx_naming_it_before_a_stream_starts(app):
    """Options refused when they are read (a tree without a model drafter among them), and those refused only once
    the request runs (a K matrix's entries), answer a stream as they answer a whole reply: a 400, not a 200 whose
    stream carries the error."""
    _, client = app
    for options, param in [({"k": 0}, "speculant.k"), ({"k": "x"}, "speculant.k"), ({"kk": 2}, "speculant.kk"),
                           ({"method": "cascade", "drafters": "maxgram", "k_matrix": "-5"}, "speculant.k_matrix"),
                           ({"method": "tree", "drafter": "maxgram"}, "speculant.drafter"),
                           ({"method": "dsi", "drafter": "maxgram", "drafters": "maxgram"}, "speculant.drafters")]:
        for stream in (False, True):
            response = client.post("/v1/completions", json=completion(stream=stream, speculant=options))
            assert response.headers["content-type"].startswith("application/json"), (options, stream)
            is_error(response, 400, param)
    for stream in (False, True):  # (what DSI cannot keep: the request's own field)
        response = client.post("/v1/completions", json=completion(
            stream=stream, logprobs=1, speculant={"method": "dsi", "drafter": "maxgram"}))
        is_error(response, 400, "logprobs")


@pytest.mark.parametrize("body, param", [
    (dict(stream=True, stream_options={"include_usages": True}), "stream_options.include_usages"),
    (dict(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(response_format={"type": "json_object", "schema": {"type": "object"}}), "response_format"),
    (dict(response_format={"type": "regex", "regex": "a+", "flags": "i"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {}, "schemas": {}}}), "response_format"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]),
     "messages.0.content.0.cache_control"),
    (dict(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text"),
    (dict(messages=[{"role": "user", "content": []}]), "messages.0.content"),
    (dict(prompt=[1, "a"]), "prompt.1"),
    (dict(messages=[{"role": "user", "content": "hi"}], top_logprobs=2), "top_logprobs"),
    (dict(messages=[{"role": "user", "content": "hi"}], tool_choice="required"), "tool_choice"),
    (dict(messages=[{"role": "user", "content": "hi"}], parallel_tool_calls=False), "parallel_tool_calls"),
    (dict(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=10**6), "max_completion_tokens"),
])
def test_a_field_is_refused_by_name_never_dropped(app, body, param):
    """Unknown fields within stream_options, response_format and content parts, and fields that need another, are
    400s naming the field, as every top-level one is; none is silently ignored."""
    _, client = app
    chat = "messages" in body
    request = {"model": "tiny", "max_tokens": 2, **({} if chat else {"prompt": "ab"}), **body}
    is_error(client.post("/v1/chat/completions" if chat else "/v1/completions", json=request), 400, param)


def test_a_message_may_not_hold_a_control_token(app):
    """A chat message's content spelling a special token (here <eos>; Qwen's <|im_end|>) would end its turn:
    refused, naming the message; the same text in a raw completion prompt is the client's."""
    _, client = app
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"},
                                                           {"role": "assistant", "content": "ok<eos>"}]}
    assert "<eos>" in is_error(client.post("/v1/chat/completions", json=chat), 400, "messages.1.content")["message"]
    assert client.post("/v1/completions", json=completion(prompt="hi<eos>")).status_code == 200


def test_a_history_replayed_as_openai_returned_it_is_taken(app):
    """OpenAI's replies carry `refusal`, `function_call` and `audio` as null; a client replaying its history as it
    got it was refused ("messages.1.refusal is not implemented"). Null is taken; a value is refused by name."""
    _, client = app
    replayed = {"role": "assistant", "content": "ok", "refusal": None, "function_call": None, "audio": None}
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}, replayed,
                                                           {"role": "user", "content": "more"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    chat["messages"][1] = {**replayed, "refusal": "I cannot"}
    is_error(client.post("/v1/chat/completions", json=chat), 400, "messages.1.refusal")


@pytest.mark.parametrize(("fields", "param"), [
    ('"speculant": {"method": "\\ud800"}', "speculant.method"),
    ('"speculant": {"\\ud800": 1}', "speculant.\\ud800"),
    ('"speculant": {"method": "sd", "drafter": "\\ud800"}', "speculant.drafter"),
    ('"\\ud800": 1', None),
])
def test_a_lone_surrogate_the_client_sent_is_quoted_in_a_400(app, fields, param):
    """JSON's \\ud800 spells a lone surrogate, which no UTF-8 answer can hold: an error quoting it (a method's,
    an option's or a drafter's name; a field's name) writes it as its escape, not a 500 from the encoder."""
    _, client = app
    body = '{"model": "tiny", "prompt": "ab", "max_tokens": 2, ' + fields + "}"
    error = is_error(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400,
                     param)
    assert "\\ud800" in error["message"] or "Unicode" in error["message"]


def test_a_path_with_a_trailing_slash_is_a_404_not_a_redirect_to_the_client_s_host(app):
    _, client = app
    response = client.post("/v1/completions/", json=completion(), headers={"host": "evil.example"},
                           follow_redirects=False)
    assert "location" not in response.headers
    is_error(response, 404)
    text = client.post("/v1/completions", content=json.dumps(completion()), headers={"content-type": "text/plain"})
    assert "JSON object" in is_error(text, 400)["message"]


def test_a_request_s_options_keep_the_operator_s_settings_of_the_server_s_method():
    engine = engine_for("tree", depth_predictor="off", depth=3)
    spec, options = engine.options_for(None, {"width": 2})
    assert spec.name == "tree" and options.width == 2 and options.depth == 3 and options.depth_predictor == "off"
    engine.close()


def test_stage_scheduling_is_refused_by_the_server_whose_forwards_run_on_one_thread(app):
    engine, client = app
    response = client.post("/v1/completions", json=completion(speculant={"method": "tree", "schedule": "stage"}))
    assert "schedule=serial" in is_error(response, 400)["message"]
    with pytest.raises(ConfigError, match="schedule=serial"):
        Engine(engine.target, "tree", get_method("tree").make_options({"drafter": "self", "schedule": "stage"}))


def test_a_server_whose_tree_drafter_has_another_vocabulary_is_refused_at_its_start_not_in_each_request(app):
    engine, _ = app
    words = bpe_tokenizer(["a tree drafted in another vocabulary"] * 4, 300)  # (a tokenizer of its own)
    other = tiny_model("llama", 3, len(words), tokenizer=words)
    with pytest.raises(ConfigError, match="needs a drafter with the target's vocabulary"):
        Engine(engine.target, "tree", get_method("tree").make_options({"drafter": other}))


@pytest.mark.parametrize("body, param", [
    ('{"model": "tiny", "messages": [{"role": "user", "content": "x \\ud800"}]}', "messages.0.content"),
    ('{"model": "tiny", "prompt": "ab", "temperature": Infinity}', "temperature"),
    ('{"model": "tiny", "prompt": "ab", "temperature": NaN}', "temperature"),
    ('{"model": "tiny", "prompt": "ab", "temperature": 1e-38}', "temperature"),
    ('{"model": "tiny", "prompt": "ab", "seed": 18446744073709551616}', "seed"),
    ('{"model": "tiny", "prompt": "ab", "stop": ""}', "stop"),
    ('{"model": "tiny", "prompt": "ab", "stop": ["a", "' + "x" * 4097 + '"]}', "stop"),  # (its tables: forwards wait)
    ('{"model": "tiny", "prompt": "ab", "response_format": {}}', "response_format"),
    ('{"model": "tiny", "prompt": "ab", "logit_bias": {" 12 ": 1}}', "logit_bias"),
    ('{"model": "tiny", "prompt": "ab", "logit_bias": {"1_0": 1}}', "logit_bias"),
    ('{"model": "tiny", "prompt": "ab", "logit_bias": {"\\u0663": 1}}', "logit_bias"),
    ('{"model": "tiny", "prompt": "ab", "logit_bias": {"01": 1}}', "logit_bias"),
    ('{"model": "tiny", "prompt": "ab", "logit_bias": {"1": Infinity}}', "logit_bias.1"),
    ('{"model": "tiny", "prompt": "ab", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": '
     '{"name": "x", "schema": ' + '{"type": "array", "items": ' * 200 + '{}' + '}' * 200 + '}}}', "response_format"),
    ('{"model": "tiny", "prompt": "ab"', None),  # truncated: no character offset as param
    # what Python's json reads past: a key twice (the last would win), a number below a double's (read as 0: greedy)
    ('{"model": "tiny", "prompt": "ab", "max_tokens": 2, "max_tokens": 500}', "max_tokens"),
    ('{"model": "tiny", "prompt": "ab", "speculant": {"k": 2, "method": "sd", "k": 3}}', "speculant.k"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": "x", "role": "system"}]}', "messages.0.role"),
    ('{"model": "tiny", "prompt": "ab", "temperature": 1e-400}', "temperature"),
    ('{"model": "tiny", "prompt": "ab", "temperature": 0.000e-400, "logit_bias": {"3": -2.5E-999}}', "logit_bias.3"),
    ('{"model": "tiny", "prompt": "ab", "seed": ' + "9" * 5000 + '}', "seed"),  # (json: "not JSON")
    ('{"model": "tiny", "prompt": "ab", "stop": [{"a": 1, "a": 2}, {"b": 1, "b": 2}], "logit_bias": {"3": 1e-999}}',
     "stop.0.a"),  # the first in the text's order
    *[('{"model": "tiny", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": '
       '"1", "type": "function", "function": {"name": "f", "arguments": ' + json.dumps(arguments) + '}}]}]}',
       "messages.1.tool_calls.0.function.arguments")  # (JSON in a string: read as written too)
      for arguments in ('{"a": 1, "a": 2}', '{"a": 1e-400}', '{"a": ' + "1" * 5000 + '}')],
])
def test_bad_numbers_text_and_shapes_are_400s_naming_the_field(app, body, param):
    _, client = app
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert not is_error(response, 400, param)["message"].startswith(f"{param}: Value error"), response.text


def test_a_body_s_route_and_type_are_answered_before_what_it_holds(app):
    """A key given twice where no route takes the body, or in a body that is no JSON: what the app answers there."""
    _, client = app
    twice = b'{"model": "tiny", "prompt": "ab", "max_tokens": 2, "max_tokens": 3}'
    json_type = {"content-type": "application/json"}
    is_error(client.post("/v1/nothing", content=twice, headers=json_type), 404)
    is_error(client.post("/health", content=twice, headers=json_type), 405)
    assert "twice" not in is_error(client.post("/v1/completions", content=twice,
                                               headers={"content-type": "text/plain"}), 400)["message"]
    two = [("content-type", "application/json"), ("content-type", "text/plain")]  # (the first is what FastAPI reads)
    is_error(client.post("/v1/completions", content=twice, headers=two), 400, "max_tokens")
    assert "twice" not in is_error(client.post("/v1/completions", content=b"[" + twice + b"]", headers=json_type),
                                   400)["message"]  # (no object: that is what is wrong)
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json", None):  # (JSON to FastAPI)
        response = client.post("/v1/completions", content=twice, headers={"content-type": kind} if kind else {})
        assert "max_tokens: a key given twice" in is_error(response, 400, "max_tokens")["message"], kind


def test_zeros_and_the_smallest_doubles_are_taken_as_sent(app):
    _, client = app
    body = ('{"model": "tiny", "prompt": "ab", "max_tokens": 2, "temperature": 0.0e-400, "top_p": 1E0, '
            '"logit_bias": {"3": 5e-324, "4": -0e5}}')
    response = client.post("/v1/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


def test_a_token_id_beyond_the_tokenizer_is_refused_even_where_the_embedding_has_a_row(app):
    engine, client = app
    real = len(engine.target.tokenizer)
    for ids in ({str(real): 1.0}, {str(engine.target.vocab_size): 1.0}):
        is_error(client.post("/v1/completions", json=completion(logit_bias=ids)), 400, "logit_bias")


def test_parse_errors_routes_and_methods_answer_in_the_api_shape(app):
    _, client = app
    json_type = {"content-type": "application/json"}
    for body in (b'{"model": "\xff\xfe"}', b"[" * 10000 + b"]" * 10000):
        error = is_error(client.post("/v1/completions", content=body, headers=json_type), 400)
        assert error["message"] in ("the body is not valid JSON", "the body is not JSON in UTF-8, or is nested too "
                                    "deeply"), error
    is_error(client.get("/v1/completions"), 405)
    is_error(client.get("/v1/zz-nothing"), 404)
    assert client.get("/docs").status_code == client.get("/openapi.json").status_code == 404  # off unless asked


def test_unknown_paths_share_one_metrics_label_and_a_server_fault_is_a_counted_500(app, monkeypatch):
    engine, client = app
    for i in range(5):
        client.get(f"/v1/zz-{i}")
    metrics = client.get("/metrics").text
    unmatched = re.search(r'endpoint="unmatched",status="404"} (\S+)', metrics)
    assert "zz-" not in metrics and unmatched and float(unmatched.group(1)) >= 5

    def broken(*args, **kwargs):
        raise RuntimeError("a bug of the server's own")

    monkeypatch.setattr(engine, "submit", broken)
    error = is_error(client.post("/v1/completions", json=completion()), 500)
    assert re.search(r"error id [0-9a-f]{12}", error["message"]) and "bug" not in error["message"]
    assert 'endpoint="/v1/completions",status="500"} 1.0' in client.get("/metrics").text


class BrokenDrafter(Drafter):
    """Drafts nothing twice, then breaks: a request that fails mid-generation."""

    name = "broken"

    def __init__(self):
        self.proposals = 0

    def propose(self, context, k):
        self.proposals += 1
        if self.proposals > 2:
            raise RuntimeError("the drafter broke")
        return Draft([], None)

    def observe(self, n_accepted):
        pass


def test_a_stream_is_counted_once_by_how_it_ended(monkeypatch, caplog):
    """A stream's headers go out as a 200 before it ends: one that ends whole counts as a 200, one the engine fails
    mid-stream as a 500 (not a 200), one a fault of the server's own ends mid-stream as one 500 (not a 200 and a
    500). A generation's failure is a fault of the server's: the client gets an error id its log holds with the
    exception, not the exception's text (which may hold paths), as it got, with nothing logged."""
    engine = engine_for("sd", drafter=BrokenDrafter())
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 12, "stream": True, "logit_bias": {"256": -100},
            "stream_options": {"include_provenance": True}}  # (a step's event: the stream starts at the first)
    chunk = Shape.chunk

    def broken(self, delta, entries, finish_reason=None):
        if finish_reason is not None:
            raise RuntimeError("a bug of the server's own")
        return chunk(self, delta, entries, finish_reason)

    with TestClient(create_app(engine, "tiny"), raise_server_exceptions=False) as client:
        def streamed(**fields):
            response = client.post("/v1/completions", json={**body, **fields})
            assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]"), response.text
            return response.text

        assert '"error"' not in streamed(speculant={"method": "ar"})
        with monkeypatch.context() as patch:
            patch.setattr(Shape, "chunk", broken)
            assert "server_error" in streamed(speculant={"method": "ar"})
        failed = streamed()  # (its drafter breaks at its third draft)
        ident = re.search(r"error id (\w+)", failed)[1]
        assert "the drafter broke" not in failed
        assert any(ident in r.getMessage() and "the drafter broke" in str(r.exc_info[1]) for r in caplog.records)
        counted = dict(re.findall(r'speculant_requests_total\{endpoint="/v1/completions",status="(\d+)"\} (\S+)',
                                  client.get("/metrics").text))
    engine.close()
    assert counted == {"200": "1.0", "500": "2.0"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("lost", ["receive fails", "task cancelled"])
def test_a_request_whose_client_the_server_lost_is_counted_as_gone_not_as_a_fault(lost, stream):
    """Ray Serve's replica hears its client through a call to the proxy, which raises once the proxy has cancelled
    the request (Ray's TaskCancelledError) and then never answers, or Ray cancels the replica's task itself: either
    way the request ends as one 499 and frees its row (a failed receive was a logged 500; a task cancelled before a
    whole reply, not counted; a cancelled stream was counted 499 already)."""
    engine = engine_for("sd", drafter=SlowDrafter())  # 400 tokens (<eos> banned) would take 8 s or more
    body = json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 400, "stream": stream,
                       "logit_bias": {"256": -100}}).encode()
    app, received, sent = create_app(engine, "tiny"), [], []

    async def receive():
        received.append(None)
        if len(received) == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        if lost == "receive fails" and len(received) == 2:  # (Ray's proxy raises it at once, from its queue; once)
            raise RuntimeError("the proxy's call was cancelled")
        await asyncio.Event().wait()  # no more messages: the client stays, or the proxy answers no more

    async def send(message):
        sent.append(message)

    async def run():
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
                 "query_string": b"", "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("test", 80)}
        task = asyncio.create_task(app(scope, receive, send))
        if lost == "task cancelled":
            while not (sent if stream else engine.active):  # (a stream: once its first chunk went out)
                await asyncio.sleep(0.01)
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)

    began = time.monotonic()
    asyncio.run(run())
    wait_until(lambda: engine.active == 0)
    assert time.monotonic() - began < 4.0  # (its row freed, not decoded to the end: 400 tokens take 8 s or more)
    counted = dict(re.findall(r'speculant_requests_total\{endpoint="/v1/completions",status="(\d+)"\} (\S+)',
                              engine.metrics.render().decode()))
    engine.close()
    assert counted == {"499": "1.0"}, counted
    if stream:  # (its headers had gone out before the client was lost)
        assert sent and sent[0]["status"] == 200, sent
    else:
        assert not sent or sent[0]["status"] == 499, sent[0]


def test_the_api_key_guards_every_route_but_health_and_the_page_and_the_flags_open_what_they_name():
    """The playground's page is open (it holds no secret and asks for the key); its API calls are not."""
    engine = engine_for("sd")
    for config, open_routes in ((ServeConfig(api_key="k"), {"/health", "/"}),
                                (ServeConfig(api_key="k", open_metrics=True, docs=True), {"/health", "/metrics", "/"})):
        app = create_app(engine, "tiny", config)
        with TestClient(app, raise_server_exceptions=False) as client:
            for route in app.routes:
                method = sorted(getattr(route, "methods", None) or {"GET"})[0]
                response = client.request(method, route.path, json={})
                assert (response.status_code != 401) == (route.path in open_routes), (route.path, response.text)
            assert {"/docs", "/openapi.json"} <= {r.path for r in app.routes} or not config.docs
            assert client.head("/").status_code == 200  # (as /health: probes may HEAD; it was a 405)
    with TestClient(create_app(engine, "tiny", ServeConfig(api_key="k"))) as client:
        assert client.get("/v1/models", headers={"authorization": "bearer k"}).status_code == 200
        for twice in ([("authorization", "Bearer wrong"), ("authorization", "Bearer k")],
                      [("authorization", "Bearer k"), ("authorization", "Bearer wrong")]):  # neither is chosen
            assert is_error(client.get("/v1/models", headers=twice), 401)["message"] == \
                "2 Authorization headers: send one"
    with TestClient(create_app(engine, "tiny", ServeConfig(allowed_hosts="api.example"))) as client:
        is_error(client.get("/v1/models"), 400)
        assert client.get("/v1/models", headers={"host": "api.example"}).status_code == 200
    engine.close()


def test_a_body_beyond_the_limit_is_refused_unread_while_health_answers():
    engine = engine_for("sd")
    with serving(engine) as url:
        base = url.removesuffix("/v1")
        big = json.dumps(completion(prompt="x" * 5_000_000)).encode()
        refused, health = {}, []

        def send():
            refused["response"] = httpx.post(f"{url}/completions", content=big,
                                             headers={"content-type": "application/json"}, timeout=30)

        sender = threading.Thread(target=send)
        sender.start()
        while sender.is_alive():
            began = time.perf_counter()
            assert httpx.get(f"{base}/health").status_code == 200
            health.append(time.perf_counter() - began)
        sender.join()
        is_error(refused["response"], 413)
        assert max(health) < 2.0, health  # (100 ms alone; a busy CI runner stalls now and then) - unguarded: ~7 s
        assert 'endpoint="/v1/completions",status="413"} 1.0' in httpx.get(f"{base}/metrics").text

        def chunks():  # no declared length: refused as the body arrives
            for _ in range(6):
                yield b"x" * 1_000_000

        is_error(httpx.post(f"{url}/completions", content=chunks(), timeout=30), 413)
        with socket.create_connection(("127.0.0.1", int(url.split(":")[2].split("/")[0])), timeout=30) as raw:
            # a declared length beside a chunked transfer: HTTP's parser refuses the framing before any body is read
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nxxxxx\r\n")
            answer = b""
            while chunk := raw.recv(4096):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and json.loads(body)["error"]["code"] == "invalid_http", answer
    engine.close()


def test_a_request_the_http_parser_refuses_is_a_json_400_in_the_api_shape():
    engine = engine_for("sd")
    with serving(engine) as url:
        port = int(url.split(":")[2].split("/")[0])
        for request in (b"HELLO\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
                raw.sendall(request)
                answer = b""
                while chunk := raw.recv(4096):
                    answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), answer
            error = json.loads(body)["error"]
            assert error["code"] == "invalid_http" and "not valid HTTP/1.1" in error["message"], error
    engine.close()


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
FIELDS = {
    "model": st.sampled_from(["tiny", "other"]) | JSON,
    "max_tokens": st.integers(-2, 6) | JSON,
    "temperature": st.sampled_from([0, 0.7, 1e-9, -1, 2.5, 1e308]) | st.floats(),
    "top_p": st.floats(),
    "seed": st.integers(-(1 << 70), 1 << 70),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5),
    "logit_bias": st.dictionaries(st.text("0123456789 _-", max_size=5), st.floats(-150, 150), max_size=3) | JSON,
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "regex", "regex": "a+"},
                                        {"type": "nope"}, {}]) | JSON,
    "speculant": st.fixed_dictionaries({}, optional={"method": st.sampled_from([*METHODS, "x"]),
                                                     "k": st.integers(-1, 5), "depth": JSON, "width": JSON,
                                                     "executor": JSON, "leniency": st.floats()}) | JSON,
    "logprobs": JSON, "top_logprobs": st.integers(-1, 30), "n": JSON, "stream": st.booleans(), "echo": JSON,
    "presence_penalty": JSON, "user": JSON, "tools": JSON,
}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(chat=st.booleans(), body=st.fixed_dictionaries({}, optional=FIELDS),
       text=st.text(max_size=12) | st.lists(st.integers(-5, 300), max_size=4))
@example(chat=False, body={"top_p": float("inf")}, text="")
@example(chat=True, body={"temperature": float("nan")}, text="x")
def test_fuzzed_requests_get_an_answer_or_a_4xx_in_the_api_shape_never_a_500(app, chat, body, text):
    _, client = app
    if chat:
        body = {"messages": [{"role": "user", "content": text}], **body}
    else:
        body = {"prompt": text, **body}
    body.setdefault("max_tokens", 3)
    response = client.post("/v1/chat/completions" if chat else "/v1/completions", content=json.dumps(body),
                           headers={"content-type": "application/json"})  # (Python's JSON: NaN and Infinity too)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        is_error(response, response.status_code)
    elif body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event or set(event["error"]) == {"message", "type", "param", "code"}
    else:
        assert response.json()["choices"]


def test_logprobs_name_distinct_tokens_apart_and_carry_their_real_bytes(app):
    engine, _ = app
    tokenizer = engine.target.tokenizer
    high = [t for t in range(len(tokenizer)) if tokenizer.decode([t]) == "\ufffd"]
    assert len(high) > 5  # the byte vocabulary's bytes >= 0x80 each decode alone as U+FFFD
    spelling = Spelling(tokenizer, engine.target.vocab_size)
    entry = TokenLogprob(high[0], -0.5, [(t, -1.0 - i) for i, t in enumerate(high[:5])])
    completions = Shape("x", "tiny", False, spelling).entries([entry])
    (top,) = completions["top_logprobs"]
    assert len(top) == 5 and all(re.fullmatch(r"bytes:\\x[89a-f][0-9a-f]", key) for key in top), top
    assert completions["text_offset"] == [0]
    (item,) = Shape("x", "tiny", True, spelling).entries([entry])["content"]
    for one in [item, *item["top_logprobs"]]:
        (byte,) = one["bytes"]
        assert byte >= 0x80 and one["token"] == f"bytes:\\x{byte:02x}"  # not U+FFFD's three bytes


@pytest.fixture(scope="module")
def long_prompt_targets(tmp_path_factory):
    """A tiny GGUF (Q4_K/Q6_K, 256 wide) on the lean and llama.cpp backends; profiles go to a throwaway cache."""
    from tiny_gguf import write_tiny_gguf

    root = tmp_path_factory.mktemp("long")
    path = root / "llama.gguf"
    write_tiny_gguf(path, "llama", 3, "k", hidden=256)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECULANT_CACHE", str(root / "cache"))
        yield lambda backend: load_model(str(path), backend=backend, tokenizer=byte_tokenizer())


def test_a_prompt_s_first_part_goes_before_a_long_prompt_s_later_parts():
    """A batch prefills PREFILL_TOKENS: the part of a long prompt that fills it goes after a new prompt's first
    part, which would otherwise wait for another part of the long one; once left for a later batch, it goes first
    (new prompts arriving all the time never starve it)."""
    from speculant.models.base import Call
    from speculant.serve.batcher import PREFILL_TOKENS, _Parked

    batcher = Batcher(4)
    long_part = _Parked(None, None, Call(list(range(PREFILL_TOKENS)), prefill=True, continues=True))
    short = _Parked(None, None, Call([1, 2, 3], prefill=True))
    step = _Parked(None, None, Call([5]))
    batcher._parked = [long_part, step, short]
    assert batcher._next_batch() == ([step, short, long_part], [])
    other = _Parked(None, None, Call(list(range(PREFILL_TOKENS)), prefill=True))
    batcher._parked = [long_part, other, short]
    assert batcher._next_batch() == ([other], [short, long_part])
    newcomer = _Parked(None, None, Call(list(range(PREFILL_TOKENS)), prefill=True))
    batcher._parked = [short, long_part, newcomer]  # a part left once goes ahead of the arrivals after it
    assert batcher._next_batch() == ([short, long_part], [newcomer])
    batcher.close()


@pytest.mark.parametrize("backend", ["lean", "llamacpp"])
def test_a_long_prompt_neither_stalls_a_short_request_nor_outlives_its_client(long_prompt_targets, backend,
                                                                               monkeypatch):
    """A 480-token prompt prefills in parts (of 32 here, as many as a batch prefills) between the other requests'
    steps: a short request sent after its first part finishes within a few of its own steps plus a part each, and
    a long prompt whose client went away stops between parts."""
    if backend == "llamacpp":
        pytest.importorskip("llama_cpp")
    from speculant.models import base
    from speculant.models.backends import lean
    from speculant.serve import batcher

    monkeypatch.setattr(base, "PREFILL_PART", 32)
    monkeypatch.setattr(lean, "SERVED_PART", 32)
    monkeypatch.setattr(batcher, "PREFILL_TOKENS", 32)
    target = long_prompt_targets(backend)
    engine = Engine(target, "ar", get_method("ar").make_options({}), 8, 16)
    calls, ends = [], {}  # each call's length, in the order the batcher ran them (32: a part of a long prompt)
    run = Batcher._run

    def logged(self, batch):  # (a part takes 10 ms more: a long prompt's, not a tiny model's)
        calls.extend(len(p.call.ids) for p in batch)
        time.sleep(0.01 if any(len(p.call.ids) == 32 for p in batch) else 0)
        run(self, batch)

    monkeypatch.setattr(Batcher, "_run", logged)
    long_prompt = [(7 * i + 3) % 200 for i in range(480)]

    def submit(name, ids, tokens):
        return engine.submit(ServeJob(ids, tokens, SamplingConfig()), lambda piece, logprobs: None,
                             lambda outcome: ends.setdefault(name, outcome))

    submit("long", long_prompt, 4)
    wait_until(lambda: 32 in calls)  # its first part ran
    submit("short", [1, 2, 3, 4], 4)
    wait_until(lambda: len(ends) == 2)
    assert ends["short"].completion_tokens == 4 and ends["long"].completion_tokens == 4
    first = calls.index(4)  # the short request's prefill, then its 3 forwards (1 token each)
    last = first + [i for i, n in enumerate(calls[first:]) if n == 1][2]
    assert calls.count(32) == 15 and calls[first:last + 1].count(32) <= 4, str(calls)  # a long part beside each
    calls.clear()
    ticket = submit("gone", long_prompt[::-1], 4)  # (another prompt: none of it in the prefix cache)
    wait_until(lambda: 32 in calls)
    ticket.cancel()
    at_cancel = calls.count(32)
    wait_until(lambda: "gone" in ends)
    gone = ends["gone"]
    assert gone.finish_reason == "cancelled" and gone.completion_tokens == 0
    assert calls.count(32) - at_cancel <= 1 and calls.count(32) < 15, str(calls)  # at most the part then running
    engine.close()


def test_a_fault_of_one_row_fails_its_request_alone_on_a_pointer_cache(long_prompt_targets, monkeypatch):
    """On the lean backend (a pointer over a fixed cache), a batched forward that raises for one request's row after
    computing every row (each row's pointer past what it wrote) fails that request alone: the others' pointers move
    back, they run again alone, and generate what they would alone."""
    from speculant.models.backends import lean

    target = long_prompt_targets("lean")
    prompts, bad = [[1 + i, 2, 3, 4] for i in range(3)], [9, 8, 7, 6]
    expected = [generate(target, prompt_ids=p, method="ar", max_new_tokens=8).text for p in prompts]
    faulty, faults = set(), []  # the faulty request's handle; the rows of each forward that failed
    prefill, run_rows = lean.LeanCausalLM.prefill, lean._run_rows

    def marked(self, ids):
        if list(ids) == bad:
            faulty.add(id(self))
        return prefill(self, ids)

    def faulted(calls):
        logits = run_rows(calls)
        if any(id(call.handle) in faulty for call in calls):
            faults.append(len(calls))
            raise RuntimeError("a fault of one row")
        return logits

    monkeypatch.setattr(lean.LeanCausalLM, "prefill", marked)
    monkeypatch.setattr(lean, "_run_rows", faulted)
    engine = Engine(target, "ar", get_method("ar").make_options({}), 8, 16)
    ends = {}
    engine.batcher.run(lambda: [submitted(engine, ServeJob(ids, 8, SamplingConfig()), ends, name)
                                for name, ids in [*enumerate(prompts), ("bad", bad)]])  # (admitted together)
    wait_until(lambda: len(ends) == 4)
    engine.close()
    assert isinstance(ends["bad"], RuntimeError) and max(faults) > 1 and 1 in faults
    assert [ends[i].text for i in range(3)] == expected
