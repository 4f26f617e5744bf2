"""`speculant serve`: rows batched bit for bit, every method's concurrent greedy output equal to its solo
output, the OpenAI client end to end (chat, completions, streaming, stop strings), every bad request a
4xx JSON error, disconnects, 429, 401, metrics, SIGTERM draining and the load script."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from openai import APIStatusError, OpenAI

from helpers import (ARCHS, BYTE_VOCAB, MORE_ARCHS, RAY, byte_tokenizer, costs, invent, perturbed, run_job,
                     tiny_model)
from speculant import generate
from speculant.api import encode_prompt
from speculant.bench.datasets import Prompt
from speculant.bench.serve import run_load
from speculant.config import SamplingConfig, ServeConfig
from speculant.drafters.base import Draft, Drafter
from speculant.errors import ConfigError
from speculant.methods import get_method
from speculant.models import load_model
from speculant.models.base import Call
from speculant.models.backends.hf import forward_rows
from speculant.serve.app import create_app, uvicorn_options
from speculant.serve.batcher import Batcher, Row, WorkerStopped
from speculant.serve.engine import Engine, QueueFull, ServeJob, Steps
from speculant.serve.metrics import Metrics
from speculant.serve.text import TextStream
from speculant.trees.tree import TokenTree

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def byte_model(arch="llama", seed=0):
    """A tiny model over bytes with a chat template, peaked enough to emit <eos> now and then."""
    model = tiny_model(arch, seed, vocab=BYTE_VOCAB, init_std=0.2, tokenizer=byte_tokenizer())
    model.tokenizer.chat_template = TEMPLATE
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(engine, api_key=None, name="tiny"):
    import uvicorn

    port = free_port()
    app = create_app(engine, name, ServeConfig(api_key=api_key))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **uvicorn_options()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)


def engine_for(method="sd", max_batch=8, max_queue=16, target=None, **options):
    target = target or byte_model()
    if method in ("sd", "tree") and "drafter" not in options:
        options["drafter"] = perturbed(target, 0.05, 1)
    return Engine(target, method, get_method(method).make_options(options), max_batch, max_queue, Metrics())


@pytest.mark.parametrize("arch", ARCHS + MORE_ARCHS)
def test_rows_of_one_forward_equal_their_own_forwards(arch):
    """Prefills, chains and a tree of different rows in one forward: each row's logits, hidden states and cache
    are bit for bit those of its own calls."""
    base = tiny_model(arch, 3, vocab=64)
    batched, alone = [base.share() for _ in range(3)], [base.share() for _ in range(3)]
    rng = random.Random(arch)
    prompts = [[rng.randrange(64) for _ in range(n)] for n in (5, 11, 2)]
    tree = TokenTree([7, 8, 9, 10], [-1, 0, 0, 1])
    rounds = [[Call(p, prefill=True) for p in prompts],
              [Call([1, 2, 3]), Call([4]), Call(tree.tokens, tree=tree)],
              [Call([5, 6]), Call(prompts[0], prefill=True), Call([11])],
              [Call([18, 19, 20, 21], rows=2), Call([22]), Call([23, 24])],  # a catch-up's last 2 rows
              [Call([12, 13, 14], prefill=True, continues=True), Call([15]), Call([16, 17], prefill=True, continues=True)]]
    for calls in rounds:
        got = forward_rows(list(zip(batched, calls)))
        for row, together, call, logits in zip(alone, batched, calls, got):
            assert torch.equal(call.run(row), logits)
            assert torch.equal(row.last_hidden, together.last_hidden)  # (what a depth predictor reads)
        assert [r.cache_len for r in batched] == [r.cache_len for r in alone]


def concurrent_equals_solo(engine, prompts, **job):
    solo = [run_job(engine, p, **job).text for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: run_job(engine, p, **job).text, prompts))
    return solo, together


@pytest.mark.parametrize("method", ["ar", "sd", "tree", "cascade", "auto", "dsi"])
@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_greedy_requests_equal_their_solo_runs_and_ar(method, arch, monkeypatch):
    """Each method's drafts are accepted (auto on a machine where its model drafter pays: with measured costs it
    chose Max-Gram or plain steps only; DSI's target padded to 10 ms, as costly beside its drafter as a real one)."""
    from speculant.decoding.dsi import engine as dsi_engine

    target = byte_model(arch, 1)
    options = {"cascade": {"drafters": (perturbed(target, 0.05, 2), "maxgram")},
               "auto": {"drafters": (perturbed(target, 0.05, 2), "maxgram")},
               "dsi": {"drafter": perturbed(target, 0.05, 2), "twin_latency": "10,0"},
               "tree": {"width": 2, "depth": 3}}.get(method, {})
    if method == "auto":
        invent(monkeypatch, costs(target))
    dsi_accepted = []  # (a DSI request's reply reports no drafts: its target verifies on servers of its own)

    def dsi(*args, **kwargs):
        stats = yield from decode_dsi(*args, **kwargs)
        dsi_accepted.append(sum(stats.accepted_lengths))
        return stats
    decode_dsi = dsi_engine.dsi
    monkeypatch.setattr(dsi_engine, "dsi", dsi)
    engine = engine_for(method, target=target, **options)
    prompts = [list(f"prompt {i}: ".encode() * (1 + i % 3)) for i in range(6)]
    solo, together = concurrent_equals_solo(engine, prompts)
    assert solo == together
    speculative = run_job(engine, prompts[2]).speculative
    if method == "auto":
        assert speculative["drafter_forwards"]  # (its model drafted)
    if method == "dsi":
        assert len(dsi_accepted) == 2 * len(prompts) + 1 and min(dsi_accepted) > 0, dsi_accepted  # (every request)
    elif method != "ar":
        assert speculative["accepted_tokens"] > 0, speculative
    for p, text in zip(prompts[:2], solo):
        assert generate(target, prompt_ids=p, method="ar", max_new_tokens=24).text == text
    engine.close()


@pytest.mark.parametrize("method", ["ar", "auto"])
def test_long_prompts_prefill_in_parts_and_equal_their_solo_runs(method, monkeypatch):
    """Prompts longer than a prefill part run part by part, in separate forwards beside the other rows, and
    every output is the request's solo run and `ar`'s."""
    from speculant.models import base

    monkeypatch.setattr(base, "PREFILL_PART", 4)
    target = byte_model("llama", 1)
    options = {"drafters": (perturbed(target, 0.05, 2), "maxgram")} if method == "auto" else {}
    if method == "auto":
        invent(monkeypatch, costs(target))  # (its model drafter pays: measured costs had it draft little)
    engine = engine_for(method, target=target, **options)
    parts = []
    run = Call.run
    monkeypatch.setattr(Call, "run", lambda call, model: parts.append(call.continues) or run(call, model))
    prompts = [list(f"prompt {i}: ".encode() * (1 + i % 3)) for i in range(4)]
    solo, together = concurrent_equals_solo(engine, prompts)
    assert method != "auto" or run_job(engine, prompts[3]).speculative["drafter_forwards"]  # (its model drafted)
    engine.close()
    assert solo == together
    assert [generate(target, prompt_ids=p, method="ar", max_new_tokens=24).text for p in prompts] == solo
    assert any(parts)  # (later parts ran as calls of their own)


def test_sampled_rows_follow_their_own_seeds():
    """A seeded sampled request draws the same tokens in a batch as alone: each row has its own generator."""
    engine = engine_for("sd")
    prompts = [list(b"abc"), list(b"hello"), list(b"xyz xyz"), list(b"q")] * 2
    solo, together = concurrent_equals_solo(engine, prompts, sampling=SamplingConfig(1.0), seed=7)
    assert solo == together and len(set(solo)) > 1
    engine.close()


def test_text_stream_holds_back_stop_prefixes_and_cuts_at_stops():
    stream = TextStream(byte_tokenizer(), ["END", "xy"])
    pieces = [stream.push(t) for t in b"abcEN"]
    assert "".join(pieces) == "abc" and not stream.stopped
    assert stream.push(ord("D")) == "" and stream.stopped and stream.text == "abc"
    stream = TextStream(byte_tokenizer(), ["END"])
    assert "".join(stream.push(t) for t in "é".encode()) == "é"  # the first byte alone is held back
    assert "".join(stream.push(t) for t in b"EN") == "" and stream.flush() == "EN"
    stream = TextStream(byte_tokenizer(), ["!"])  # (a character of bytes before the stop: each byte's token counts)
    assert "".join(stream.push(t) for t in "xé!?".encode()) == "xé" and stream.covering() == 3
    # A token that ends with the first byte of a character, after a stop string: the stop ends the text at once.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from speculant.drafters.vocab import byte_of_char

    vocab = byte_of_char()
    a, first = (next(c for c, b in vocab.items() if b == byte) for byte in (ord("A"), 0xE2))  # ("“" is E2 80 9C)
    merged = Tokenizer(models.BPE(vocab={**vocab, a + first: 256}, merges=[(a, first)]))
    merged.pre_tokenizer, merged.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    stream = TextStream(PreTrainedTokenizerFast(tokenizer_object=merged), ["A"])
    assert stream.push(ord("x")) == "x" and stream.push(256) == "" and stream.stopped and stream.text == "x"


def test_stop_strings_end_an_answer_but_never_a_call():
    """A reply that may call tools: a stop string in the text before a call ends it; one inside the call does not
    (cut there, the reply's call was raw markup in its content, finish "stop"); a tail held back as the start of a
    stop string goes out with the call."""
    calls = "<tool_call>"
    stream = TextStream(byte_tokenizer(), ["Oslo"], calls)
    assert "".join(stream.push(t) for t in b"Hi Osl") == "Hi " and not stream.stopped
    assert stream.push(ord("o")) == "" and stream.stopped and stream.text == "Hi "
    stream = TextStream(byte_tokenizer(), ["Oslo", "<tool_call>\n{"], calls)
    call = b'Hi <tool_call>\n{"city": "Oslo"}</tool_call>'
    assert "".join(stream.push(t) for t in call) + stream.flush() == call.decode() and not stream.stopped
    stream = TextStream(byte_tokenizer(), ["Os"], calls)  # (held back as a stop string's start, then a call)
    assert "".join(stream.push(t) for t in b"O<tool_call>Os") == "O<tool_call>Os" and not stream.stopped
    for stop in ("tool", "<", "call", "_"):  # a tag of several tokens (here bytes): while it may be one, no cut
        stream = TextStream(byte_tokenizer(), [stop], calls)
        assert "".join(stream.push(t) for t in call) + stream.flush() == call.decode() and not stream.stopped, stop
    for text, stop, cut in (("a <b", "<", "a "), ("a <tool", "<", "a ")):  # (not a tag after all; a tag never ended)
        stream = TextStream(byte_tokenizer(), [stop], calls)
        assert "".join(stream.push(t) for t in text.encode()) + stream.flush() == cut and stream.stopped, text


def test_text_stream_holds_back_the_longest_tail_that_begins_a_stop_string():
    """Against the definition, on texts of few letters (many partial matches), and for a stop string far longer than
    the text at linear cost (each push searched every tail of the text: 20000 pushes under a long stop string
    took a minute instead of a fraction of a second)."""
    rng = random.Random(0)
    for _ in range(200):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        stream = TextStream(byte_tokenizer(), stops)
        for token in rng.choices(b"ab", k=30):
            stream.push(token)
            if stream.stopped:
                break
            held = max((n for s in stops for n in range(1, len(s)) if stream.text.endswith(s[:n])), default=0)
            assert len(stream.text) - stream.sent == held, (stops, stream.text)
    stream = TextStream(byte_tokenizer(), ["a" * 30000 + "b"])
    started = time.perf_counter()
    assert not any(stream.push(ord("a")) for _ in range(20000)) and time.perf_counter() - started < 5
    assert stream.push(ord("c")) == "a" * 20000 + "c"


def test_text_stream_decodes_a_few_tokens_per_push_while_the_text_ends_in_a_replacement_character():
    """Bytes no character begins with (a client's logit_bias can force them) decode as U+FFFD for good: the window
    waited for the character to end and grew, each push decoding every one of them again (10,000 tokens took minutes
    of the batcher's thread). Now it stays a few tokens long. Over random runs of whole, cut and stray bytes, tokens
    of bytes that end inside a character and special tokens (skipped: the bytes on either side join), with stop
    strings that end in U+FFFD too: the text never hands out what decoding every id would not begin with, its final
    ids (`done`, which a server's per-token entries follow) decode to it, and it ends as that decoding does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from speculant.drafters.vocab import byte_of_char

    tokenizer, widest = byte_tokenizer(), []

    class Counting:
        def decode(self, ids, **kwargs):
            widest.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    stream = TextStream(Counting(), ["zz"])
    pieces = [stream.push(0x80) for _ in range(2000)]
    assert max(widest) <= 8 and sum(map(len, pieces)) >= 1990  # (handed out as it comes, not at the end)
    assert "".join(pieces) + stream.flush() == "\ufffd" * 2000
    chars = byte_of_char()
    spelled = {byte: char for char, byte in chars.items()}
    pairs = [bytes(p) for p in ((0xAD, 0xE4), (0xB8, 0xAD), (0x61, 0xE4), (0x9F, 0x98))]  # (ending inside one)
    vocab = {**chars, **{"".join(spelled[b] for b in pair): 256 + i for i, pair in enumerate(pairs)}, "<sp>": 260}
    rich = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    rich.pre_tokenizer, rich.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    rich = PreTrainedTokenizerFast(tokenizer_object=rich, additional_special_tokens=["<sp>"])
    rng = random.Random(0)
    for trial in range(1500):
        ids = []
        for _ in range(rng.randint(1, 30)):
            kind = rng.random()
            if kind < 0.3:  # a character, whole or a cut of it
                ids += list("é€😀中".encode()[rng.choice([0, 2, 5, 9]):][:rng.randint(1, 4)])
            elif kind < 0.45:
                ids.append(rng.randint(0x80, 0xFF))
            elif kind < 0.6 and trial % 2:
                ids.append(rng.choice([256, 257, 258, 259, 260, 260]))
            else:
                ids.append(rng.choice(b"abz "))
        stops = rng.choice([[], ["zz"], ["a z"], ["\ufffda"], ["\ufffd"], ["z\ufffd"]])
        chosen = rich if trial % 2 else tokenizer
        stream, handed = TextStream(chosen, stops), ""
        text = chosen.decode(ids, skip_special_tokens=True)
        for n, token in enumerate(ids, 1):
            handed += stream.push(token)  # (after a stop: "")
            assert text.startswith(handed), (ids, stops)
            if not stream.stopped:
                assert chosen.decode(ids[: stream.done], skip_special_tokens=True) == stream.text, (ids, n)
        expected = text[:min([text.find(stop) for stop in stops if stop in text], default=len(text))]
        assert handed + stream.flush() == expected, (ids, stops)


def test_text_stream_of_a_sentencepiece_tokenizer_keeps_a_space_after_a_special_token_and_its_sent_bytes():
    """Llama's and Mistral's decoders strip the text's leading space, and byte-fallback decoders turn a run of byte
    tokens that ends inside a character into U+FFFDs whole. A window that began with a special token (skipped) lost
    the next token's space, so a stop string across it went unseen; the text at the end, every id decoded again,
    took back a character already sent. Over random ids with a stop string: what is handed out is the text, the text
    is what decoding every id gives wherever that has no stray byte, and a stop string in it ends it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab |= {piece: len(vocab) + i for i, piece in enumerate(["▁", "a", "b", "▁a", "▁b", "ab", "▁ab", "é"])}
    tokenizers = []
    for strip in (True, False):  # (Llama's decoder, and Gemma's, which keeps the space)
        model = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
        model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           *([decoders.Strip(" ", 1, 0)] if strip else [])])
        tokenizers.append(PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>",
                                                  unk_token="<unk>"))
    llama, gemma = tokenizers

    def streamed(tokenizer, pieces, stops=()):
        stream = TextStream(tokenizer, stops)
        handed = "".join(stream.push(tokenizer.convert_tokens_to_ids(p)) for p in pieces) + stream.flush()
        assert handed == stream.text
        return stream

    assert streamed(llama, ["a", "<s>", "▁b"]).text == "a b"
    stream = TextStream(llama)  # a special token's id is final with the next text's (a server's entries follow)
    assert [(stream.push(llama.convert_tokens_to_ids(p)), stream.done) for p in ["a", "<s>", "▁b"]] == \
        [("a", 1), ("", 1), (" b", 3)]
    stream.push(llama.convert_tokens_to_ids("<0xC3>"))
    assert (stream.flush(), stream.flush(), stream.text) == ("\ufffd", "", "a b\ufffd")  # (once)
    stream = streamed(llama, ["a", "<s>", "▁b", "▁a"], [" b"])
    assert stream.stopped and stream.text == "a"
    assert streamed(gemma, ["<0xC3>", "<0xA9>", "<0xF0>", "<0x9F>"]).text == "é\ufffd\ufffd"  # (not 4 U+FFFDs)
    assert streamed(gemma, ["<0xC3>", "<0xA9>", "<0x80>", "a"]).text == "é\ufffda"
    rng = random.Random(0)
    units = [[i] for i in range(len(vocab) - 8, len(vocab))] + [[1], [2], [*b"\xc3\xa9"], [*"😀".encode()], [0x9F]]
    for trial in range(600):
        tokenizer = tokenizers[trial % 2]
        ids = [t + 3 if t > 2 and t < 256 else t for unit in rng.choices(units, k=rng.randint(1, 8)) for t in unit]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        stop = rng.choice(["", " b", "ab", "a b", " "])
        stream = streamed(tokenizer, tokenizer.convert_ids_to_tokens(ids), [stop] if stop else [])
        assert not (stop and stop in stream.text), (ids, stop)
        if "\ufffd" not in whole:  # (a stray byte: U+FFFDs, the decoder's for the run or one per byte sent)
            expected = whole[:whole.find(stop)] if stop and stop in whole else whole
            assert stream.text == expected and stream.stopped == (expected != whole), (ids, stop)


def test_a_server_measures_its_models_as_it_starts_whatever_its_method(tmp_path, monkeypatch):
    """A request may pick auto on a server of another method: its models' machine profiles were measured in that
    request, on the batcher's thread, every other stream waiting (a 1.5B's first profile takes over a minute). They
    are measured as the server starts, on that thread, and a request picking auto measures nothing."""
    from speculant import latency
    from speculant.config import ModelConfig
    from speculant.serve.app import build_app

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    for name, seed in (("target", 0), ("drafter", 1)):
        model = byte_model(seed=seed)
        model.model.save_pretrained(tmp_path / name)
        model.tokenizer.save_pretrained(tmp_path / name)
    measured, measure = [], latency._measure
    monkeypatch.setattr(latency, "_measure", lambda model, *args: measured.append(threading.current_thread().name)
                        or measure(model, *args))
    options = get_method("sd").make_options({"drafter": str(tmp_path / "drafter")})
    app = build_app(str(tmp_path / "target"), ModelConfig(), "sd", options, ServeConfig(), "tiny")
    assert measured == ["speculant-batcher"] * 2  # the target's and the drafter's
    with TestClient(app) as client:
        reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 4,
                                                     "speculant": {"method": "auto"}})
    assert reply.status_code == 200 and reply.json()["usage"]["speculative"]["method"] == "auto"
    assert len(measured) == 2


@pytest.fixture(scope="module")
def server():
    engine = engine_for("sd", max_batch=8, max_queue=32)
    with serving(engine) as url:
        yield engine, url, OpenAI(base_url=url, api_key="unused", max_retries=0)
    engine.close()


def test_openai_client_completions_chat_and_streams(server):
    engine, url, client = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=20, temperature=0)
    ids = engine.target.tokenizer("def f(x):")["input_ids"]
    assert done.choices[0].text == generate(engine.target, prompt_ids=ids, method="ar", max_new_tokens=20).text
    usage = done.usage.model_dump()
    assert usage["completion_tokens"] <= 20 and usage["prompt_tokens"] == len(ids)
    spec = usage["speculative"]
    assert spec["method"] == "sd" and spec["target_forwards"] >= 1 and 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=16, temperature=0, user="ann")  # (`user`: accepted, ignored)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
    reply = {"role": "assistant", "content": "hello", "refusal": None, "annotations": []}  # (as OpenAI's come)
    replayed = client.chat.completions.create(model="tiny", max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": "hi"}, reply, {"role": "user", "content": "hi"}])
    assert replayed.usage.prompt_tokens > chat.usage.prompt_tokens
    engine.target.tokenizer.chat_template = TEMPLATE.replace("{{ m['role'] }}", "{{ m['name'] or m['role'] }}")
    try:  # (a template that writes a participant's name: it reaches the prompt)
        named = client.chat.completions.create(model="tiny", max_tokens=1, temperature=0,
                                               messages=[{"role": "user", "content": "hi", "name": "ann"}])
        plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=1, temperature=0)
        # One that writes a user's name but not an assistant's: that one is refused, naming its message.
        engine.target.tokenizer.chat_template = TEMPLATE.replace(
            "{{ m['role'] }}", "{{ m['name'] if m['role'] == 'user' and m['name'] else m['role'] }}")
        partly = httpx.post(f"{url}/chat/completions", json={"model": "tiny", "max_tokens": 1, "messages": [
            {"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "x", "name": "bob"},
            {"role": "user", "content": "hi"}]})
    finally:
        engine.target.tokenizer.chat_template = TEMPLATE
    assert named.usage.prompt_tokens == plain.usage.prompt_tokens - len("user") + len("ann")
    assert partly.status_code == 400 and partly.json()["error"]["param"] == "messages.1.name", partly.text
    for message in ({"role": "user", "content": None}, {"role": "assistant"}):  # (named the message before)
        empty = httpx.post(f"{url}/chat/completions", json={"model": "tiny", "max_tokens": 1, "messages": [message]})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages.0.content", empty.text
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=16, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])  # (a null, as OpenAI's)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat.choices[0].finish_reason
    chunks = list(client.completions.create(model="tiny", prompt="def f(x):", max_tokens=20, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text
    assert sum(bool(c.choices[0].text) for c in chunks) > 1  # (streamed as it decodes, not in one piece)
    assert not any("usage" in c.model_fields_set for c in chunks)  # (no usage asked for: none)


def test_logprobs_stream_and_not_equal_plain_decoding_s(server):
    engine, _, client = server
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                          logprobs=True, top_logprobs=3)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=3, extra_body={"speculant": {"method": "ar"}})
    entries = chat.choices[0].logprobs.content
    ended = chat.choices[0].finish_reason == "stop"  # at <eos>, which adds nothing to the content: no entry
    assert len(entries) == chat.usage.completion_tokens - ended and all(len(e.top_logprobs) == 3 for e in entries)
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in plain.choices[0].logprobs.content]
    assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.logprob for e in entries)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    assert all(e.top_logprobs == [] for e in streamed)
    assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=4).choices[0].logprobs is None
    done = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=12, temperature=0, logprobs=2)
    logprobs = done.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == done.usage.completion_tokens
    text = done.choices[0].text  # each token's offset: the characters before it (a split character's at its start)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[-1] <= len(text)
    assert all(text[at:at + len(t)] == t for t, at in zip(logprobs.tokens, logprobs.text_offset)
               if not t.startswith("bytes:"))
    from speculant.models.wrappers.logprobs import TokenLogprob
    from speculant.serve.replies import Shape, Spelling

    shape = Shape("id", "tiny", False, Spelling(byte_tokenizer(), BYTE_VOCAB))  # "“" is three bytes, three tokens
    halves = [shape.entries([TokenLogprob(t, -1.0, ()) for t in part]) for part in (b"a\xe2\x80", b"\x9cb")]
    assert [at for half in halves for at in half["text_offset"]] == [0, 1, 1, 1, 2]  # (streamed in two chunks)
    shape = Shape("id", "tiny", False, Spelling(byte_tokenizer(), BYTE_VOCAB))  # a special token: no text, no width
    special = shape.entries([TokenLogprob(t, -1.0, [(ord("c"), -0.5)]) for t in (ord("a"), 256, ord("b"))])
    assert special["text_offset"] == [0, 1, 1]
    assert special["top_logprobs"] == [{"c": -0.5, "a": -1.0}, {"c": -0.5, "<eos>": -1.0}, {"c": -0.5, "b": -1.0}]
    shape = Shape("id", "tiny", False, Spelling(byte_tokenizer(), BYTE_VOCAB))  # a character cut short by "b"
    halves = [shape.entries([TokenLogprob(t, -1.0, ()) for t in part]) for part in (b"a\xe2\x80", b"b\xffc")]
    assert [at for half in halves for at in half["text_offset"]] == [0, 1, 1, 2, 3, 4]  # (text "a\ufffdb\ufffdc")
    chunks = list(client.completions.create(model="tiny", prompt="def f(x):", max_tokens=12, temperature=0,
                                            logprobs=2, stream=True))
    assert [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == \
        logprobs.token_logprobs
    # a stop string where a token begins: its tokens leave the log-probabilities too
    i = next(i for i, (t, at) in enumerate(zip(logprobs.tokens, logprobs.text_offset))
             if i and t.strip() and not t.startswith("bytes:") and text.find(t) == at)
    for stream in (False, True):
        stopped = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=12, temperature=0,
                                            logprobs=2, stop=logprobs.tokens[i], stream=stream)
        parts = list(stopped) if stream else [stopped]
        assert "".join(c.choices[0].text for c in parts) == text[:logprobs.text_offset[i]]
        assert [v for c in parts if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == \
            logprobs.token_logprobs[:i]


def test_logit_bias_is_applied_and_speculation_stays_exact(server):
    engine, _, client = server
    ids = engine.target.tokenizer("abc")["input_ids"]
    plain = generate(engine.target, prompt_ids=ids, method="ar", max_new_tokens=12).token_ids
    bias = {plain[0]: -100.0}
    expected = generate(engine.target, prompt_ids=ids, method="ar", max_new_tokens=12, logit_bias=bias).text
    done = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0,
                                     logit_bias={str(t): v for t, v in bias.items()})
    assert done.choices[0].text == expected and done.usage.model_dump()["speculative"]["method"] == "sd"


def test_structured_output_is_schema_valid_json_and_equals_constrained_ar(server, monkeypatch):
    """A reply follows its schema exactly as constrained `ar`, streamed too; its grammar compiles once, on the
    request's handler thread: never on the thread that runs every request's forwards (a client's large grammar held
    up every stream there), the drafter's matcher a copy of it."""
    pytest.importorskip("llguidance")
    from speculant.models.wrappers import constrained

    engine, _, client = server
    compiled, init = [], constrained.Matcher.__init__
    monkeypatch.setattr(constrained.Matcher, "__init__",
                        lambda self, *args: compiled.append(threading.current_thread().name) or init(self, *args))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False,  # compact JSON: a random model pads with all the whitespace it may
              "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}
    response_format = {"type": "json_schema", "json_schema": {"name": "digit", "schema": schema}}
    messages = [{"role": "user", "content": "a digit"}]
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                          response_format=response_format)
    text = done.choices[0].message.content
    assert set(json.loads(text)) == {"n"} and done.choices[0].finish_reason == "stop"
    assert len(compiled) == 1 and not compiled[0].startswith("speculant-"), compiled
    ids = encode_prompt(engine.target.tokenizer, messages)
    assert text == generate(engine.target, prompt_ids=ids, method="ar", max_new_tokens=40,
                            response_format=response_format).text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=40, temperature=0, response_format=response_format, stream=True)
        if c.choices)
    assert streamed == text


def test_stop_strings_cut_the_text_across_tokens(server):
    _, _, client = server
    for prompt in (f"prompt {i}" for i in range(50)):  # one whose output has three whole characters at [5:8]
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0).choices[0].text
        stop = full[5:8]
        if len(stop) == 3 and "\ufffd" not in stop:
            break
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "@@"])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=stop, stream=True))
    assert streamed == cut.choices[0].text


def test_per_request_method_and_options(server):
    engine, _, client = server
    loaded = dict(engine.drafters)  # (changed only on the batcher's thread, which reads them in a step)
    plain = client.completions.create(model="tiny", prompt="xyz", max_tokens=16, temperature=0)
    for extra in ({"method": "ar"}, {"k": 2}, {"method": "sd", "drafter": "maxgram"}, {"method": "tree", "depth": 2}):
        other = client.completions.create(model="tiny", prompt="xyz", max_tokens=16, temperature=0,
                                          extra_body={"speculant": extra})
        assert other.choices[0].text == plain.choices[0].text, extra
        assert other.usage.model_dump()["speculative"]["method"] == extra.get("method", "sd")
    assert engine.drafters == loaded


BAD = [
    ("completions", b"{not json", "not valid JSON"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": 5}, "prompt"),
    ("completions", {"model": "gpt-9", "prompt": "x"}, "not served here"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**6}, "exceeds"),
    ("completions", {"model": "tiny", "prompt": "x", "temperature": -0.5}, "temperature"),
    ("completions", {"model": "tiny", "prompt": "x", "temperature": 2.5}, "temperature"),
    ("completions", {"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p"),
    ("completions", {"model": "tiny", "prompt": "x" * 600}, "positions"),
    ("completions", {"model": "tiny", "prompt": "x" * 500}, "max_tokens 16 (the default) after a 500-token prompt"),
    ("completions", {"model": "tiny", "prompt": ""}, "empty"),
    ("completions", {"model": "tiny", "prompt": [1, 9999]}, "token ids"),
    ("completions", {"model": "tiny", "prompt": "x", "n": 2}, "n"),
    ("completions", {"model": "tiny", "prompt": "x", "speculant": {"method": "fast"}}, "unknown method"),
    ("completions", {"model": "tiny", "prompt": "x", "speculant": {"method": "f" * 5000}}, "unknown method"),
    ("completions", {"model": "tiny", "prompt": ["x", "y"]}, "one prompt per request"),
    ("completions", {"model": "tiny", "prompt": [[1, 2]]}, "one prompt per request"),
    ("completions", {"model": "tiny", "prompt": "x", "speculant": {"kk": 1}}, "unknown option"),
    ("completions", {"model": "tiny", "prompt": "x", "speculant": {"k": 0}}, "k must be"),
    ("completions", {"model": "tiny", "prompt": "x", "speculant": {"k": 0}}, "speculant.k"),  # (its field named)
    ("completions", {"model": "tiny", "prompt": "x", "speculant": {"method": "tree", "depth": 0}}, "speculant.depth"),
    ("completions", {"model": "tiny", "prompt": "x", "speculant": {"drafter": "org/big"}}, "not loaded"),
    ("chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, "content"),
    ("chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
    ("completions", {"model": "tiny", "prompt": "x", "logit_bias": {"x": 10}}, "keys must be token ids"),
    ("completions", {"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, "values must lie"),
    ("completions", {"model": "tiny", "prompt": "x", "logit_bias": {"9999": 1}}, "token ids must lie"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, "does not call tools"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools.0.function.name"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "xml"}}, "response_format type must be one of"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "grammar", "grammar": "start: nowhere"}}, "does not compile"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "regex", "regex": "[^\\s\\S]"}}, "matches no text"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": 4, "speculant": {"method": "ar"},
                     "response_format": {"type": "regex", "regex": "a{1000000}"}}, "response_format"),  # (at run time)
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "tool_choice": "auto"}, "tool_choice needs tools"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tool_choice": {
        "type": "function"}, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice.function"),
    ("chat/completions", {"model": "tiny", "messages": [  # (a template without tools would leave the call out)
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "4", "tool_call_id": "1"}]}, "messages.1.tool_calls"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"},
                                                        {"role": "tool", "content": "4", "tool_call_id": "1"}]},
     "which no assistant message before it made"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi", "tool_call_id": "1"}]},
     "only a tool message"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}]},
     "message 1 makes two tool calls of one id"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "functions": []},
     "functions is not implemented"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs needs logprobs"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"model": "tiny", "prompt": "x", "logprobs": 6}, "logprobs"),
    ("completions", {"model": "tiny", "prompt": "x", "logprobs": True}, "logprobs"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "ann"}]},
     "messages.0.name"),  # (this template writes no name: refused, not dropped)
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "description": "Reply in French", "schema": {}}}},
     "description would go unread"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": "ok", "annotations": [{"type": "url_citation"}]}]},
     "messages.1.annotations"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"\\ud800": 1}'}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{
        "type": "function", "function": {"name": "f", "parameters": {"properties": {"\ud800": {}}}}}]},
     "tools.0.function.parameters"),
]


@pytest.mark.parametrize("endpoint,body,message", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_4xx_json_errors_and_the_server_keeps_serving(server, endpoint, body, message):
    _, url, client = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{url}/{endpoint}", content=content, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert message in error["message"] or message == error["param"], error
    assert len(error["message"]) <= 1003  # (one that quotes the request is cut)
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2, temperature=0).choices[0].text is not None


def test_nulls_are_the_defaults_openai_gives_them(server):
    _, url, _ = server
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "seed",
                           "stop", "max_tokens"))
    for endpoint, body in (("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": None}),
                           ("completions", {"prompt": "hi", "logprobs": None, "echo": None})):
        response = httpx.post(f"{url}/{endpoint}", json={"model": "tiny", **body, **nulls})
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"], response.text
    response = httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": "hi", "functions": None})
    assert response.status_code == 400 and response.json()["error"]["param"] == "functions"
    for options in ({"method": "sd", "k": None}, {"method": None, "drafter": None}):  # (null: the default here too)
        response = httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                          "speculant": options})
        assert response.status_code == 200, response.text
    response = httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": "hi", "speculant": {"nosuch": None}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "speculant.nosuch"  # (null or not)
    for best_of, status in ((1, 200), (None, 200), (2, 400)):  # (OpenAI's default, which one completion is)
        response = httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                          "best_of": best_of})
        assert response.status_code == status and (status == 200 or response.json()["error"]["param"] == "best_of")


class SlowDrafter(Drafter):
    """Drafts nothing, slowly: a request that takes long enough to test queues and disconnects."""

    name = "slow"

    def propose(self, context, k):
        time.sleep(0.02)
        return Draft([], None)

    def observe(self, n_accepted):
        pass


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_row(stream):
    engine = engine_for("sd", drafter=SlowDrafter())  # 400 tokens (<eos> banned) would take 8 s or more
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 400, "temperature": 0, "stream": stream,
            "logit_bias": {str(BYTE_VOCAB - 1): -100}}
    with serving(engine) as url:
        if stream:
            with httpx.stream("POST", f"{url}/completions", json=body) as response:
                next(response.iter_lines())
        else:
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
                httpx.post(f"{url}/completions", json=body, timeout=0.375)  # (between the server's checks, 0.25 s)
            assert engine.active == 1  # still decoding when its client left
        deadline = time.monotonic() + 5
        while engine.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.active == 0
    engine.close()


def test_a_dsi_request_runs_apart_and_does_not_stall_the_others():
    engine = engine_for("sd")
    long = next(p for p in (list(f"prompt {i}".encode()) for i in range(100))  # one that runs to 60 tokens
                if len(generate(engine.target, prompt_ids=p, method="ar", max_new_tokens=60).token_ids) == 60)
    finished = []
    dsi = threading.Thread(target=lambda: finished.append(run_job(  # 60 forwards padded to 50 ms: ~3 s
        engine, long, max_tokens=60, method="dsi", options={"drafter": "maxgram", "twin_latency": "50,5"})))
    dsi.start()
    deadline = time.monotonic() + 10
    while not engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run_job(engine, list(b"hello"), max_tokens=8).completion_tokens >= 1
    assert not finished  # the other request came back while DSI still decoded
    dsi.join(60)
    assert finished[0].completion_tokens == 60
    # (its target verified on DSI's servers, which no row counts: unknown, not zero; its drafter's forwards are)
    assert {k: v for k, v in finished[0].speculative.items() if v is None} == {
        "drafted_tokens": None, "accepted_tokens": None, "mean_accepted_length": None, "target_forwards": None}
    assert engine.active == 0
    engine.close()


def test_a_served_row_counts_the_requests_waiting_to_join_its_next_batch():
    """The first of a burst of clients decides its next step while the others still wait for a row: it counts
    them, up to the batch's rows, so that `auto` does not start a drafter's catch-up that all of them wait for."""
    model = tiny_model("llama", 0)
    for max_rows, first_sees in ((8, 4), (3, 3)):
        batcher, started, gate, seen = Batcher(max_rows), threading.Event(), threading.Event(), []

        def first():
            started.set()
            gate.wait()
            seen.append(Row(batcher, model).batch_load())

        batcher.start(first, seen.append)
        started.wait()
        for _ in range(3):
            batcher.start(lambda: seen.append(Row(batcher, model).batch_load()), seen.append)
        gate.set()
        batcher.close()
        assert seen == [first_sees, 3, 2, 1], seen  # the other three, admitted together, each ending at once


def submitted(engine, job, ends, name, on_step=None):
    """Submit `job`; its Outcome (or error) goes to `ends[name]`."""
    return engine.submit(job, lambda piece, logprobs: None, lambda outcome: ends.setdefault(name, outcome), on_step)


def wait_until(condition, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_max_queue_requests_wait_beside_the_free_rows_and_max_batch_run_apart():
    """While one of two rows runs a long call, one request takes the free row and `max_queue` (1) more wait: the
    next is refused. Requests apart (DSI) never wait: `max_batch` of them run at once, the next is refused."""
    engine = engine_for("ar", max_batch=2, max_queue=1)
    gate, started, ends = threading.Event(), threading.Event(), {}
    threading.Thread(target=engine.batcher.run, args=(lambda: started.set() or gate.wait(30),), daemon=True).start()
    assert started.wait(30)
    job = ServeJob(list(b"hello"), 4, SamplingConfig())
    submitted(engine, job, ends, "row")
    # a queued request whose client went away leaves the queue (it held the place a live one was refused for)
    submitted(engine, job, ends, "gone").cancel()
    submitted(engine, job, ends, "queued")
    with pytest.raises(QueueFull):
        submitted(engine, job, ends, "refused")
    gate.set()
    dsi = ServeJob(list(b"hello"), 40, SamplingConfig(), method="dsi",
                   options={"drafter": "maxgram", "twin_latency": "50,5"})  # (forwards padded to 50 ms: seconds)
    for name in ("dsi 1", "dsi 2"):
        submitted(engine, dsi, ends, name)
    with pytest.raises(QueueFull):
        submitted(engine, dsi, ends, "dsi refused")
    wait_until(lambda: len(ends) == 4)
    assert all(end.completion_tokens for end in ends.values()) and "gone" not in ends, ends
    engine.close()


def test_a_stop_string_found_as_the_text_settles_at_the_end_stops_the_reply():
    """A stop string that ends in U+FFFD is found once the text settles: where that is only at the end (the reply
    ends on a character's first byte), the reply said "length" and kept the stop string's log-probabilities."""
    engine = engine_for("ar", max_batch=1)
    ends = {}
    job = ServeJob(list(b"hello"), 1, SamplingConfig(), stops=("\ufffd",), logprobs=0, logit_bias={0xEF: 100.0})
    submitted(engine, job, ends, "reply")  # (its one token: 0xEF, a three-byte character's first)
    wait_until(lambda: ends)
    engine.close()
    assert (ends["reply"].text, ends["reply"].finish_reason, ends["reply"].logprobs) == ("", "stop", [])


@pytest.mark.parametrize("stop, text", [("\ufffd", "L)]"), ("]\ufffd", "L)")])
def test_a_stop_string_found_as_the_text_settles_after_the_end_of_sequence_cuts_the_log_probabilities(stop, text):
    """The same where the reply ended on its end-of-sequence token (the finish reason already "stop"): the
    log-probabilities of the tokens after the cut went out with the reply."""
    engine = engine_for("ar", max_batch=1)
    ends = {}
    for name, stops in (("whole", ()), ("cut", (stop,))):
        submitted(engine, ServeJob(list(b"The cat"), 12, SamplingConfig(), stops=stops, logprobs=0), ends, name)
        wait_until(lambda: name in ends)
    engine.close()
    whole, cut = ends["whole"], ends["cut"]  # (the tiny model's reply: three characters, two stray bytes, <eos>)
    assert (whole.text, whole.finish_reason, len(whole.logprobs)) == ("L)]\ufffd\ufffd", "stop", 5)
    assert (cut.text, cut.finish_reason) == (text, "stop")
    assert cut.logprobs == whole.logprobs[: len(text)]


def test_the_queue_depth_gauge_is_what_waits_when_it_is_read():
    """Other work the worker queues (a warm-up's) holds a request back without a submission: the gauge reads the
    queue then, and 0 once all of it has run."""
    engine = engine_for("ar", max_batch=1)
    gate, started, ends = threading.Event(), threading.Event(), {}

    def depth():
        return engine.metrics.registry.get_sample_value("speculant_queue_depth")

    threading.Thread(target=engine.batcher.run, args=(lambda: started.set() or gate.wait(30),), daemon=True).start()
    assert started.wait(30)
    submitted(engine, ServeJob(list(b"hello"), 4, SamplingConfig()), ends, "request")
    warm_up = threading.Thread(target=engine.batcher.run, args=(lambda: None,))
    warm_up.start()
    wait_until(lambda: engine.batcher.waiting == 2)
    assert depth() == 2
    gate.set()
    warm_up.join(30)
    wait_until(lambda: ends)
    assert depth() == 0
    engine.close()


def test_draft_metrics_count_a_tree_s_nodes_by_depth():
    """Per position: a chain's drafts at positions 0..W-2, a tree's nodes at their depth's (several at a depth),
    and an accepted path at positions 0..accepted-1."""
    metrics = Metrics()
    steps = Steps(metrics)
    tree = TokenTree([1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 2, 3])  # depths 0, 1, 1, 2, 2, 3
    steps.on_target(Call([9], prefill=True))
    steps.on_token(1, "")
    steps.on_target(Call(list(tree.tokens), tree=tree))
    for token in (2, 4, 7):  # nodes 1 and 3 accepted, then the target's own
        steps.on_token(token, "")
    steps.on_target(Call([7, 8, 9]))  # a chain of two drafts, one accepted
    for token in (8, 5):
        steps.on_token(token, "")
    steps.close()

    def by_position(name):
        return {str(j): metrics.registry.get_sample_value(name, {"position": str(j)}) for j in range(5)}

    assert by_position("speculant_draft_tokens_total") == {"0": 3, "1": 3, "2": 1, "3": None, "4": None}
    assert by_position("speculant_accepted_tokens_total") == {"0": 2, "1": 1, "2": None, "3": None, "4": None}
    assert (steps.drafted, steps.accepted) == (7, 3)
    steps.on_target(Call([5, 6, 7]))  # a reply that ends on a draft's token (an end of sequence, a stop string):
    for token in (6, 7):  # both accepted, no token of the target's own after them
        steps.on_token(token, "")
    steps.close()
    assert (steps.drafted, steps.accepted) == (9, 5)


def test_a_fault_of_one_row_fails_its_request_alone_and_the_others_decode_as_alone():
    """A batched forward that raises for one request's row (here its prompt's, at the second layer: the first has
    cached its keys for every row) fails that request alone: the others, decoding in that forward, run again alone
    from their caches as they were before it, and generate what they would alone."""
    engine = engine_for("ar")
    model, bad = engine.target.model.model, list(b"a faulty prompt")
    running, faults = [], []  # the ids of the forward running now; the widths of those that failed

    def fault(module, args):
        if ", ".join(map(str, bad)) in ", ".join(map(str, running)):
            faults.append(len(running))
            raise RuntimeError("a fault of one row")

    model.embed_tokens.register_forward_pre_hook(lambda module, args: running.__setitem__(
        slice(None), args[0].flatten().tolist()))
    model.layers[1].register_forward_pre_hook(fault)
    prompts, ends, joined = [list(f"prompt {i}: ".encode()) for i in range(3)], {}, []

    def join(step):  # the first request's first token: the faulty request joins the others' next forward
        if not joined:
            joined.append(submitted(engine, ServeJob(bad, 24, SamplingConfig()), ends, "bad"))

    for i, prompt in enumerate(prompts):
        submitted(engine, ServeJob(prompt, 24, SamplingConfig()), ends, i, join if i == 0 else None)
    wait_until(lambda: len(ends) == 4)
    engine.close()
    assert isinstance(ends["bad"], RuntimeError) and max(faults) > len(bad) and len(bad) in faults
    assert [ends[i].text for i in range(3)] == \
        [generate(engine.target, prompt_ids=p, method="ar", max_new_tokens=24).text for p in prompts]


def test_a_stopped_worker_fails_its_requests_and_health_says_so():
    """An error outside a call's forward (here the batch metrics' hook) ends the batcher's one worker: the request
    it ran and the one it queued fail with WorkerStopped, a later request is refused with a 503, and /health is a
    503 too."""
    engine = engine_for("ar", max_batch=1)
    with TestClient(create_app(engine, "tiny"), raise_server_exceptions=False) as client:
        assert client.get("/health").status_code == 200

        def broken(rows, tokens, seconds):
            raise RuntimeError("a fault of the worker's own")

        engine.batcher.on_batch = broken
        ends, job = {}, ServeJob(list(b"hello"), 4, SamplingConfig())
        engine.batcher.run(lambda: [submitted(engine, job, ends, name) for name in ("running", "queued")])
        wait_until(lambda: len(ends) == 2)
        assert all(isinstance(end, WorkerStopped) for end in ends.values()), ends
        for response in (client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}),
                         client.get("/health")):
            assert response.status_code == 503 and response.json()["error"]["code"] == "worker_stopped"
    engine.close()
    # A closed engine (a server shutting down) refuses later requests the same way, and /health says so: they were a
    # 500 (a RuntimeError), and /health answered 200.
    for method in ("ar", "dsi"):
        engine = engine_for(method)
        with TestClient(create_app(engine, "tiny"), raise_server_exceptions=False) as client:
            engine.close()
            for response in (client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                             client.get("/health")):
                assert response.status_code == 503 and response.json()["error"] == {
                    "message": "the server is shutting down", "type": "server_error", "param": None,
                    "code": "worker_stopped"}, response.text


class OutOfVocabulary(Drafter):
    """Drafts an id past the vocabulary: a drafter that breaks its contract."""

    name = "out"

    def propose(self, context, k):
        return Draft([10**6], None)

    def observe(self, n_accepted):
        pass


def test_the_server_s_own_drafter_breaking_its_contract_is_the_server_s_fault():
    """A 500 with an error id, as a drafter that raises is, not a 400 that blames the request (and names its
    `speculant` options where it has some)."""
    engine = engine_for("sd", drafter=OutOfVocabulary())
    with TestClient(create_app(engine, "tiny"), raise_server_exceptions=False) as client:
        for options in ({}, {"speculant": {"k": 2}}):
            response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                                            **options})
            error = response.json()["error"]
            assert response.status_code == 500 and error["type"] == "server_error" and error["param"] is None, error
            assert error["message"].startswith("the server failed (error id ")
    engine.close()


def test_a_full_queue_answers_429_and_a_wrong_key_401():
    engine = engine_for("sd", max_batch=1, max_queue=0, drafter=SlowDrafter())
    with serving(engine, api_key="sesame") as url:
        assert httpx.get(f"{url}/models").status_code == 401
        client = OpenAI(base_url=url, api_key="sesame", max_retries=0)
        answered = []
        slow = threading.Thread(target=lambda: answered.append(client.completions.create(model="tiny", prompt="a",
                                                                                         max_tokens=60)))
        slow.start()
        while engine.active == 0:
            time.sleep(0.01)
        with pytest.raises(APIStatusError) as refused:
            client.completions.create(model="tiny", prompt="b", max_tokens=5)
        assert refused.value.status_code == 429 and "busy" in refused.value.message
        slow.join()
        answered.append(client.completions.create(model="tiny", prompt="b", max_tokens=5))
        assert answered[-1].choices[0].text is not None
        assert httpx.get(url.removesuffix("/v1") + "/metrics").status_code == 401  # every route but /health
        for wrong in ("Bearer sesam", "Basic sesame", "sesame", "Bearer  sesame x"):
            assert httpx.get(f"{url}/models", headers={"Authorization": wrong}).status_code == 401, wrong
        assert client.models.retrieve("tiny").id == "tiny"
        with pytest.raises(APIStatusError) as unknown:
            client.models.retrieve("other")
        assert unknown.value.status_code == 404 and unknown.value.body["code"] == "model_not_found"
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        with pytest.raises(APIStatusError) as unknown:  # another model's request is refused before it is read (its
            client.chat.completions.create(model="other", messages=[{"role": "user", "content": "a"}],  # tools, a
                                           tools=[tool], tool_choice="required")  # long conversation templated)
        assert unknown.value.status_code == 404 and unknown.value.body["param"] == "model"
        assert httpx.head(url.removesuffix("/v1") + "/health").status_code == 200
        # (the scheme in any case: RFC 9110 11.1)
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics", headers={"Authorization": "bearer sesame"}).text
        assert 'speculant_requests_total{endpoint="/v1/completions",status="429"} 1.0' in metrics
        value = lambda name: float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1))  # noqa: E731
        tokens = [reply.usage.completion_tokens for reply in answered]
        assert value("speculant_time_to_first_token_seconds_count") == 2  # the two answered, not the refused
        assert value("speculant_inter_token_latency_seconds_count") == sum(tokens) - 2
        assert value("speculant_completion_tokens_total") == sum(tokens)
        assert value("speculant_prompt_tokens_total") == sum(reply.usage.prompt_tokens for reply in answered)
        assert value("speculant_batch_rows_count") > 0 and value("speculant_batch_tokens_sum") >= sum(tokens)
        busy = re.search(r"^speculant_forward_seconds_total (\S+)$", metrics, re.M)
        assert busy and float(busy.group(1)) > 0
    engine.close()


def test_the_load_script_reports_and_finds_no_solo_mismatch(server):
    _, url, _ = server
    prompts = [Prompt("p1", "def add(a, b):"), Prompt("p2", "Say hi", chat=True)]
    result = run_load(url, prompts, requests=8, concurrency=4, max_tokens=12, check_solo=True)
    assert result["errors"] == result["lost"] == result["mismatches_vs_solo"] == 0
    assert result["completion_tokens"] > 0 and result["ttft_ms"]["p50"] is not None
    spec = result["speculative"]  # summed over the 8 requests' usage
    assert spec["target_forwards"] >= 8 and 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]


def test_sigterm_drains_running_requests(tmp_path):
    """A served model on disk, a streamed request, SIGTERM mid-stream: the stream finishes, the process exits 0."""
    model = byte_model()
    model.model.save_pretrained(tmp_path / "m")
    model.tokenizer.save_pretrained(tmp_path / "m")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    process = subprocess.Popen([sys.executable, "-m", "speculant", "serve", "--target", str(tmp_path / "m"),
                                "--backend", "hf", "--method", "sd", "--drafter", "maxgram", "--port", str(port)],
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                name = httpx.get(f"{url}/models").json()["data"][0]["id"]
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        lines = []
        with httpx.stream("POST", f"{url}/completions", timeout=60,
                          json={"model": name, "prompt": "abc", "max_tokens": 200, "temperature": 0, "stream": True,
                                "logit_bias": {"256": -100}, "speculant": {"method": "ar"}}) as response:  # (no <eos>)
            for line in response.iter_lines():
                if line and not lines:
                    process.send_signal(signal.SIGTERM)
                lines.append(line)
        chunks = [json.loads(line[6:])["choices"][0] for line in lines if line.startswith("data: {")]
        assert "data: [DONE]" in lines and chunks[-1]["finish_reason"] == "length"  # (decoded to its end after it)
        assert sum(bool(chunk["text"]) for chunk in chunks) > 100
        assert process.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
        assert "Traceback" not in process.stderr.read()
    finally:
        process.kill()


def test_serve_cli_refuses_bad_options_before_loading(capsys):
    from speculant import cli

    for argv, message in [(["serve", "--port", "0"], "port"), (["serve", "--max-batch", "0"], "max-batch"),
                          (["serve", "--method", "ar", "--k", "3"], "does not apply")]:
        assert cli.main(argv) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):  # (a flag's own type: argparse's usage error)
        cli.main(["bench-serve", "--requests", "0"])
    assert "argument --requests: must be >= 1" in capsys.readouterr().err


def test_bench_serve_says_in_one_line_where_no_server_lists_models(capsys):
    """A URL without the API's /v1, or one where nothing listens, is one line and exit 2, not a traceback."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from speculant import cli

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    site = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    prompts = str(Path(__file__).parent.parent / "prompts" / "mixed.jsonl")
    try:
        for url, why in [(f"http://127.0.0.1:{site.server_port}", "404"),
                         (f"http://127.0.0.1:{free_port()}/v1", "Connect")]:
            assert cli.main(["bench-serve", "--url", url, "--prompts", prompts, "--requests", "1"]) == 2
            err = capsys.readouterr().err
            assert f"no model listed at {url}/models" in err and why in err and "Traceback" not in err
    finally:
        site.shutdown()


@RAY
def test_two_replicas_on_ray_serve_both_answer_as_one_process_would(tmp_path):
    """`serve --replicas 2` on a local Ray cluster: requests through the one port reach both replicas (each names
    itself in a header), and every greedy answer equals the same request decoded here."""
    pytest.importorskip("ray.serve")
    model = byte_model()
    model.model.save_pretrained(tmp_path / "m")
    model.tokenizer.save_pretrained(tmp_path / "m")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), "RAY_AUTH_MODE": "disabled"}
    process = subprocess.Popen([sys.executable, "-m", "speculant.cli", "serve", "--target", str(tmp_path / "m"),
                                "--backend", "hf", "--method", "sd", "--drafter", "maxgram", "--port", str(port),
                                "--replicas", "2", "--replica-cpus", "0.5", "--served-name", "tiny"],
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        while (line := process.stderr.readline()) and "serving tiny from 2 replicas" not in line:
            pass  # the deployment runs once both replicas have loaded (the first may answer before)
        assert process.poll() is None, process.stderr.read()
        prompts = [f"prompt {i}:" for i in range(12)]

        def ask(prompt):
            response = httpx.post(f"{url}/completions", timeout=120, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0})
            return response.headers["x-speculant-replica"], response.json()["choices"][0]["text"]

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, prompts))
        assert len({replica for replica, _ in answers}) == 2
        served = load_model(str(tmp_path / "m"), backend="hf")  # as each replica loads it (dtype auto)
        for prompt, (_, text) in zip(prompts, answers):
            assert text == generate(served, prompt, method="ar", max_new_tokens=16).text
    finally:
        process.send_signal(signal.SIGTERM)  # the local cluster goes down with it
        done = process.wait(60)
    assert done == 0 and "Traceback" not in process.stderr.read()


@RAY
def test_replicas_that_do_not_fit_a_local_cluster_are_refused_however_it_is_named(tmp_path):
    """`--ray-cluster local` starts a cluster on this machine as no `--ray-cluster` does: more replicas of a core each
    than it has cores are refused in one line, not waited for (it was taken for a remote cluster: no check, and a
    hang)."""
    many = 4 * (os.cpu_count() or 1)  # (whatever the machine)
    model = byte_model()
    model.model.save_pretrained(tmp_path / "m")
    model.tokenizer.save_pretrained(tmp_path / "m")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-m", "speculant.cli", "serve", "--target", str(tmp_path / "m"),
                           "--backend", "hf", "--method", "ar", "--port", str(free_port()), "--ray-cluster", "local",
                           "--replicas", str(many)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and f"{many} replicas of 1 CPUs do not fit this machine's" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_stall_shows_in_itl_and_tpot_is_a_request_s_mean():
    """ITL: every gap between two chunks (a stall whole, a chunk of several tokens one gap); TPOT: each request's
    time per token after its first."""
    from speculant.bench.serve import summarize

    steady = {"tokens": 65, "times": [0.1 + 0.02 * i for i in range(65)]}
    stalled = {"tokens": 65, "times": [0.1 + 0.02 * i + 0.5 * (i // 8) for i in range(65)]}  # a stall every 8
    chunked = {"tokens": 64, "times": [0.1 + 0.08 * i for i in range(16)]}  # 4 tokens every 80 ms
    result = summarize([steady] * 9 + [stalled], 10.0)
    assert result["itl_ms"]["p50"] == pytest.approx(20.0) and result["itl_ms"]["p99"] > 500
    assert result["tpot_ms"]["p50"] == pytest.approx(20.0) and result["tpot_ms"]["p99"] < 100
    assert summarize([chunked], 1.0)["itl_ms"]["p50"] == pytest.approx(80.0)


def test_a_served_drafter_s_catch_up_computes_the_head_for_its_last_rows_only(monkeypatch):
    """A drafter catching up through a request's Row ran a forward (the output head over every row, logits of a
    whole vocabulary per token); it now runs the backend's catch_up, batched or not."""
    base = tiny_model("llama", 3, vocab=64)
    alone = base.share()
    batcher = Batcher(max_rows=2)
    try:
        for row in (Row(None, base), Row(batcher, base)):
            def served(work, row=row):  # (a batched row's calls run on the batcher's worker)
                return work() if row.batcher is None else batcher.run(work)

            served(lambda: row.prefill([1, 2, 3]))
            alone.prefill([1, 2, 3])
            asked, catch_up = [], row.handle.catch_up
            monkeypatch.setattr(row.handle, "catch_up", lambda ids, rows=1: asked.append(rows) or catch_up(ids, rows))
            got = served(lambda: row.catch_up([4, 5, 6, 7], 2))
            assert asked == [2] and torch.equal(got, alone.catch_up([4, 5, 6, 7], 2))
    finally:
        batcher.close()


def test_allowed_hosts_name_hosts_without_a_port_and_requests_match_them_whatever_their_port():
    """A Host header's port is not compared, so a port in --allowed-hosts (which no request could match) is refused
    when the options are read; an IPv6 address is written in brackets, as Host headers write it."""
    for hosts in ("localhost:8000", "api.example,[::1]:8000", "::1"):
        with pytest.raises(ConfigError, match="without a port"):
            ServeConfig(allowed_hosts=hosts)
    engine = engine_for("ar")
    with TestClient(create_app(engine, "tiny", ServeConfig(allowed_hosts="Localhost,[::1]"))) as client:
        for host, status in (("localhost:8000", 200), ("localhost", 200), ("[::1]:8000", 200), ("[::1]", 200),
                             ("api.example:8000", 400), ("api.example:x@localhost", 400),
                             ("localhost:x@api.example", 400), ("localhost:8000/", 400),  # (what passed before)
                             ("localhost:", 200)):
            assert client.get("/v1/models", headers={"host": host}).status_code == status, host
        two = client.get("/v1/models", headers=[("host", "api.example"), ("host", "localhost")])  # (the last counted)
        assert two.status_code == 400 and "api.example, localhost" in two.json()["error"]["message"]
    engine.close()
