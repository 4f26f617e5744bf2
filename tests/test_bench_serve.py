"""`speculant bench-serve` against stand-in servers: every request in flight at once at any concurrency, replies not
in the API's form counted as that request's errors, solo requests that fail left out of the comparison, and Ctrl-C
sending nothing more."""

import http.server
import json
import signal
import threading
import time
from functools import partial

import httpx
import pytest

from speculant.bench.datasets import Prompt
from speculant.bench.serve import format_load, run_load

URL = "http://stand-in/v1"
PROMPTS = [Prompt("p1", "a"), Prompt("p2", "b")]


def sse(*chunks: object) -> httpx.Response:
    """A stream of `chunks` (text as it is, else as JSON), then [DONE]."""
    lines = [f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n" for chunk in (*chunks, "[DONE]")]
    return httpx.Response(200, content="".join(lines).encode())


def text(piece: str) -> dict:
    return {"choices": [{"text": piece}]}


def stand_in(monkeypatch, answer) -> None:
    """bench-serve's client talks to `answer(request) -> httpx.Response` (the model listing answered here)."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return answer(request)

    monkeypatch.setattr(httpx, "Client", partial(httpx.Client, transport=httpx.MockTransport(handler)))


def test_more_than_a_hundred_clients_are_in_flight_at_once():
    """httpx's pool holds 100 connections by default: the 110 clients' requests must all reach the server."""
    clients, lock = 110, threading.Condition()
    seen = {"in_flight": 0, "most": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                seen["in_flight"] += 1
                seen["most"] = max(seen["most"], seen["in_flight"])
                lock.notify_all()
                lock.wait_for(lambda: seen["most"] >= clients, timeout=3)
                seen["in_flight"] -= 1
            body = b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            body = b'{"data": [{"id": "m"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 256

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = run_load(f"http://127.0.0.1:{server.server_port}/v1", PROMPTS, clients, clients, 1)
    finally:
        server.shutdown()
    assert result["errors"] == 0 and seen["most"] == clients


@pytest.mark.parametrize("chunk, error", [("{not json", "a chunk that is not JSON: {not json"),
                                          ("[1, 2]", "a chunk that is not a JSON object: [1, 2]"),
                                          ({"error": "overloaded"}, "overloaded"),
                                          ({"error": {"message": "too long"}}, "too long"),
                                          ({"choices": "x"}, "a chunk whose choices is not a list of objects"),
                                          ({"choices": [{"text": 5}]}, "whose choices.0.text is not text"),
                                          ({"choices": [{"delta": {"content": [1]}}]}, "choices.0.delta is not an"),
                                          ({"usage": [1]}, "a chunk whose usage is not an object"),
                                          ({"usage": {"completion_tokens": "2"}}, "completion_tokens is not a whole"),
                                          ({"usage": {"completion_tokens": -650}}, "completion_tokens is not a whole"),
                                          ({"usage": {"speculative": [1]}}, "usage.speculative is not an object"),
                                          ({"usage": {"speculative": {"drafted_tokens": "3"}}}, "is not an object of")])
def test_a_reply_not_in_the_api_s_form_is_that_request_s_error(chunk, error, monkeypatch):
    """Each is one request's error naming the field (a traceback in the summary, or the request counted lost, or a
    negative throughput)."""
    stand_in(monkeypatch, lambda request: sse(text("x"), chunk))
    result = run_load(URL, PROMPTS, requests=3, concurrency=2, max_tokens=4)
    assert (result["errors"], result["lost"]) == (3, 0) and len(result["error_samples"]) == 1, result
    assert error in result["error_samples"][0]


def test_a_usage_without_a_token_count_counts_the_chunks(monkeypatch):
    usage = {"choices": [], "usage": {"completion_tokens": None}}
    stand_in(monkeypatch, lambda request: sse(text("x"), text("y"), usage))
    result = run_load(URL, PROMPTS, requests=2, concurrency=2, max_tokens=4)
    assert result["errors"] == 0 and result["completion_tokens"] == 4


def test_a_dsi_server_s_uncounted_verifications_are_said_to_be_uncounted_not_summed_as_zero(monkeypatch):
    counts = {"drafted_tokens": None, "accepted_tokens": None, "target_forwards": None, "drafter_forwards": 3}
    stand_in(monkeypatch, lambda request: sse(text("x"), {"choices": [], "usage": {"speculative": counts}}))
    result = run_load(URL, PROMPTS, requests=2, concurrency=2, max_tokens=4)
    assert result["speculative"] == {**counts, "drafter_forwards": 6}
    assert "; 6 drafter forwards (the target's verifications: on DSI's servers, uncounted)" in \
        format_load({**result, "label": "x"})


def test_prompts_whose_solo_request_failed_are_not_compared(monkeypatch):
    """The load's 4 requests answer; then p1's solo request fails (the transport's error) and p2's answers."""
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["prompt"])
        if len(sent) == 5:
            raise httpx.ConnectError("refused")
        return sse(text("same"))

    stand_in(monkeypatch, answer)
    result = run_load(URL, PROMPTS, requests=4, concurrency=2, max_tokens=4, check_solo=True)
    assert sent[4:] == ["a", "b"] and result["mismatches_vs_solo"] == 0
    assert result["solo_errors"] == ["ConnectError: refused"]
    assert "0 outputs differ from solo (1 prompt(s) not compared, their solo request failed: ConnectError: refused)" \
        in format_load({**result, "label": "x"})


def test_after_ctrl_c_no_client_sends_another_request(monkeypatch):
    """Ctrl-C while the first requests are in flight: they end, no client takes the next (the client is closed)."""
    sent, failures = [], []
    monkeypatch.setattr(threading, "excepthook", failures.append)

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if len(sent) == 1:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.2)
        return sse(text("x"))

    stand_in(monkeypatch, answer)
    with pytest.raises(KeyboardInterrupt):
        run_load(URL, PROMPTS, requests=40, concurrency=2, max_tokens=4)
    time.sleep(0.5)
    assert len(sent) <= 2 and not failures



def test_a_prompt_s_response_format_is_sent_with_each_of_its_requests(monkeypatch):
    """A prompt that asks for structured output asks the server for it, in a closed loop and in every turn of an
    open-loop conversation (the dataset's check of it was all it got)."""
    from speculant.bench.serve import run_sessions

    sent = []
    stand_in(monkeypatch, lambda request: sent.append(json.loads(request.content)) or sse(text("{}")))
    schema = {"type": "json_object"}
    prompts = [Prompt("j", "give json", response_format=schema), Prompt("c", "chat", chat=True)]
    run_load(URL, prompts, requests=2, concurrency=1, max_tokens=4)
    run_sessions(URL, prompts[:1], conversations=1, turns=2, rate=100.0, max_tokens=4)
    assert [body.get("response_format") for body in sent] == [schema, None, schema, schema]
    assert [len(body["messages"]) for body in sent[2:]] == [1, 3]


def test_a_one_turn_conversation_sends_its_prompt_as_it_is(monkeypatch):
    """Open loop, one turn: a text prompt is sent as a completion (a model without a chat template answers it), a
    conversation as a chat; more turns are a conversation whatever the prompt."""
    from speculant.bench.serve import run_sessions

    paths = []
    stand_in(monkeypatch, lambda request: paths.append(request.url.path) or sse(text("x")))
    prompts = [Prompt("t", "text"), Prompt("c", "chat", chat=True)]
    run_sessions(URL, prompts, conversations=2, turns=1, rate=100.0, max_tokens=2)
    assert sorted(paths) == ["/v1/chat/completions", "/v1/completions"]
    run_sessions(URL, prompts[:1], conversations=1, turns=2, rate=100.0, max_tokens=2)
    assert paths[2:] == ["/v1/chat/completions"] * 2


def test_a_run_whose_every_request_failed_is_an_error_and_no_result(monkeypatch, tmp_path, capsys):
    from speculant import cli

    stand_in(monkeypatch, lambda request: httpx.Response(400, json={"error": {"message": "no"}}))
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    assert cli.main(["bench-serve", "--url", URL, "--prompts", str(tmp_path / "p.jsonl"), "--requests", "2",
                     "--concurrency", "1", "--max-tokens", "2", "--out", str(tmp_path / "out")]) == 2
    assert "all 2 requests failed" in capsys.readouterr().err and not (tmp_path / "out" / "results.jsonl").exists()


def test_a_conversation_that_failed_counts_one_error_and_its_unsent_turns_not_at_all(monkeypatch):
    """Open loop, three turns: one conversation's first turn is refused (HTTP 500), so its later turns are never
    sent. One error, nothing lost (sent, never finished), the other conversation's three turns done (the unsent
    turns were counted as errors and lost, 3 and 2)."""
    from speculant.bench.serve import run_sessions

    def answer(request):
        first = json.loads(request.content)["messages"][0]["content"]
        return httpx.Response(500, json={"error": "nope"}) if first == "bad" else sse(text("hi"))

    stand_in(monkeypatch, answer)
    prompts = [Prompt("b", "bad", chat=True), Prompt("g", "good", chat=True)]
    result = run_sessions(URL, prompts, conversations=2, turns=3, rate=100.0, max_tokens=4)
    assert (result["requests"], result["errors"], result["lost"], result["completion_tokens"]) == (4, 1, 0, 3), result


def test_a_server_given_no_label_is_named_by_its_url_in_the_results_report_and_table(monkeypatch, tmp_path):
    """bench-serve without --label wrote `"label": null`: the report named the server "None" and
    scripts/serve_table.py failed on it."""
    import subprocess
    import sys
    from pathlib import Path

    from speculant import cli

    stand_in(monkeypatch, lambda request: sse(text("x")))
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    assert cli.main(["bench-serve", "--url", URL, "--prompts", str(tmp_path / "p.jsonl"), "--requests", "2",
                     "--concurrency", "1", "--max-tokens", "2", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "results.jsonl").read_text())["label"] == URL
    assert f"| {URL} |" in (tmp_path / "report.md").read_text()
    script = Path(__file__).resolve().parent.parent / "scripts" / "serve_table.py"
    table = subprocess.run([sys.executable, str(script), str(tmp_path / "results.jsonl")], capture_output=True,
                           text=True)
    assert table.returncode == 0 and URL in table.stdout, table.stderr


def test_a_run_of_another_kind_in_results_jsonl_is_refused_before_the_load_and_settings_tell_runs_apart(
        monkeypatch, tmp_path, capsys):
    """A run whose field the report reads held another type (null throughput, a text concurrency) was appended to,
    then the report failed with a traceback, on every later run again; runs of other settings (temperature, max
    tokens) of one server were one line of the plot and alike in the table."""
    from speculant import cli

    stand_in(monkeypatch, lambda request: sse(text("x")))
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    load = ["bench-serve", "--url", URL, "--prompts", str(tmp_path / "p.jsonl"), "--requests", "2", "--concurrency",
            "1", "--out", str(tmp_path)]
    for tokens, temperature in (("2", "0"), ("3", "1")):
        assert cli.main([*load, "--max-tokens", tokens, "--temperature", temperature]) == 0
    table = (tmp_path / "report.md").read_text()
    prompts = str(tmp_path / "p.jsonl")  # (the prompt set: runs of others are told apart too)
    assert f"| {URL} | {prompts} | C=1 | 2 | 2 | 0.0 |" in table and f"| {URL} | {prompts} | C=1 | 2 | 3 | 1.0 |" in table
    good = (tmp_path / "results.jsonl").read_text()
    for field, value, kind in (("throughput_tok_s", None, "a number >= 0"), ("concurrency", "many", "a whole number"),
                               ("ttft_ms", 5, "percentiles"), ("label", 3, "a text or null")):
        run = json.loads(good.splitlines()[0])
        (tmp_path / "results.jsonl").write_text(json.dumps({**run, field: value}) + "\n")
        capsys.readouterr()
        assert cli.main([*load, "--max-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"results.jsonl:1: {field} is {json.dumps(value)}, not {kind}" in err, err
        assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 1  # (nothing appended)


def test_a_server_that_refuses_the_key_is_said_to_refuse_it(monkeypatch):
    """A 401 at the model listing is the key's fault, not the URL's."""
    from speculant.errors import ConfigError

    monkeypatch.setattr(httpx, "Client", partial(httpx.Client, transport=httpx.MockTransport(
        lambda request: httpx.Response(401, json={"error": {"message": "invalid API key"}}))))
    with pytest.raises(ConfigError, match="the server at http://stand-in/v1 refused the API key \\(HTTP 401\\)"):
        run_load(URL, PROMPTS, 2, 1, 4, api_key="wrong")
