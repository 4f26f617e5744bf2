"""`speculant bench-serve`: load a running OpenAI-compatible server, closed loop (N requests from C clients,
each sending its next when one ends) or open loop (multi-turn conversations arriving at a Poisson rate:
`run_sessions`).

Each client streams its completions (chat for chat prompts) and times the first text and every later
chunk; the run reports throughput over the wall time, percentiles of TTFT, of TPOT (a request's time per output
token after its first) and of ITL (every gap between two chunks of a stream, as vLLM's benchmark counts it: a chunk
that carries several tokens, as a speculative step may, is one gap, and a stall shows whole), errors
and lost requests (sent, never finished), what a speculant server says it drafted and verified, and with
`check_solo` how many outputs differ from the same prompt sent alone (greedy)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from speculant.bench import MOST_RESULTS_BYTES
from speculant.bench.datasets import Prompt
from speculant.cache import read_text
from speculant.errors import ConfigError

TIMEOUT_S = 600.0  # a request's (a long generation on a loaded server)
PROBE_S = 30.0  # the model listing's, before any request: a server that does not answer it is not serving
# What a speculant server says of each request's speculation, summed over a run's requests.
SPECULATIVE = ("drafted_tokens", "accepted_tokens", "target_forwards", "drafter_forwards")


def total(counts: list[int | None]) -> int | None:
    """The sum of the responses' counts; None (unknown) where one was: DSI's target verifies on servers apart."""
    return None if None in counts else sum(counts)


def request_body(prompt: Prompt, model: str, max_tokens: int, temperature: float) -> tuple[str, dict]:
    """(endpoint, body) for one prompt, streamed with its usage: chat for chat prompts and conversations, else a
    completion; with the prompt's `response_format` where it has one."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if prompt.response_format is not None:
        body["response_format"] = prompt.response_format
    if prompt.chat:
        return "/chat/completions", {**body, "messages": messages_of(prompt)}
    return "/completions", {**body, "prompt": prompt.text}


def messages_of(prompt: Prompt) -> list[dict[str, str]]:
    """A prompt as chat messages: a text as the user's one message, a conversation as it is."""
    return [{"role": "user", "content": prompt.text}] if isinstance(prompt.text, str) else list(prompt.text)


def summarize(results: Sequence[dict[str, Any] | None], wall: float) -> dict[str, Any]:
    """What a run's requests (None: never finished) add up to: throughput over the wall time, TTFT, TPOT and ITL
    percentiles, errors, lost streams, and what a speculant server says it drafted and verified."""
    done = [r for r in results if r is not None and "error" not in r]
    tokens = sum(r["tokens"] for r in done)
    spoken = [r["speculative"] for r in done if r.get("speculative")]  # speculant's servers say what they drafted
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in done
            if r["tokens"] > 1 and len(r["times"]) > 1]
    itl = [later - earlier for r in done for earlier, later in zip(r["times"], r["times"][1:])]
    return {
        "wall_s": round(wall, 2), "throughput_tok_s": round(tokens / wall, 2),
        "requests_per_s": round(len(done) / wall, 3), "completion_tokens": tokens,
        "ttft_ms": percentiles([r["times"][0] for r in done if r["times"]]), "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "errors": sum(r is None or "error" in r for r in results),
        "lost": sum(r is None or bool(r.get("lost")) for r in results),
        "speculative": {key: total([s.get(key, 0) for s in spoken]) for key in SPECULATIVE} if spoken else None,
        "error_samples": sorted({r["error"] for r in results if r is not None and "error" in r})[:3],
    }


def piece_of(chunk: dict) -> str:
    """The text a streamed chunk (`chunk_fault` found nothing amiss) adds: its first choice's, completion or chat."""
    choice = (chunk.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def chunk_fault(chunk: dict) -> str | None:
    """The field of a streamed chunk that is not in the API's form, as what it should be (None: none is): a reply
    of another shape broke the run's summary (a traceback) or was counted lost."""
    choices = chunk.get("choices")
    if choices is not None and not (isinstance(choices, list) and all(isinstance(c, dict) for c in choices)):
        return "choices is not a list of objects"
    choice = choices[0] if choices else {}
    delta = choice.get("delta")
    if not isinstance(choice.get("text") or "", str):
        return "choices.0.text is not text"
    if delta is not None and not (isinstance(delta, dict) and isinstance(delta.get("content") or "", str)):
        return "choices.0.delta is not an object whose content is text"
    usage = chunk.get("usage")
    if usage is None:
        return None
    if not isinstance(usage, dict):
        return "usage is not an object"
    if not fits(usage.get("completion_tokens"), COUNT + OR_NONE):
        return f"usage.completion_tokens is not {COUNT}"
    spoken = usage.get("speculative")
    if spoken is not None and not (isinstance(spoken, dict) and
                                   all(fits(spoken.get(key), COUNT + OR_NONE) for key in SPECULATIVE)):
        return f"usage.speculative is not an object of counts ({', '.join(SPECULATIVE)})"
    return None


def stream_one(client: httpx.Client, endpoint: str, body: dict) -> dict[str, Any]:
    """One streamed request: its text, completion tokens, TTFT and chunk arrival times (seconds from the send), or
    its error (a chunk not in the API's form, too)."""
    start = time.perf_counter()
    text, times, usage, done = [], [], None, False
    with client.stream("POST", endpoint, json=body) as response:
        if response.status_code != 200:
            response.read()
            return {"error": f"HTTP {response.status_code}: {response.text[:200]}"}
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            try:
                chunk = json.loads(line[6:])
            except ValueError:
                return {"error": f"a chunk that is not JSON: {line[6:106]}"}
            if not isinstance(chunk, dict):
                return {"error": f"a chunk that is not a JSON object: {line[6:106]}"}
            if "error" in chunk:
                error = chunk["error"]
                return {"error": str(error.get("message", "error") if isinstance(error, dict) else error)}
            if fault := chunk_fault(chunk):
                return {"error": f"a chunk whose {fault}: {line[6:106]}"}
            usage = chunk.get("usage") or usage
            if piece := piece_of(chunk):
                text.append(piece)
                times.append(time.perf_counter() - start)
    if not done:
        return {"error": "the stream ended without [DONE]", "lost": True}
    tokens = (usage or {}).get("completion_tokens") or len(times)
    return {"text": "".join(text), "tokens": tokens, "times": times, "speculative": (usage or {}).get("speculative")}


def reply_to(client: httpx.Client, endpoint: str, body: dict) -> dict[str, Any]:
    """`stream_one`, or the transport's error as the request's."""
    try:
        return stream_one(client, endpoint, body)
    except httpx.HTTPError as error:
        return {"error": f"{type(error).__name__}: {error}"}


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(np.asarray(values) * 1000, [50, 90, 99])
    return {"p50": round(float(p[0]), 1), "p90": round(float(p[1]), 1), "p99": round(float(p[2]), 1)}


def client_for(url: str, api_key: str | None, connections: int) -> httpx.Client:
    """A client that holds `connections` requests open at once (httpx's pool holds 100: more would wait here, unseen
    by the server, their TTFT counted from the send), and a few more (the model listing, solo requests)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT_S,
                        limits=httpx.Limits(max_connections=connections + 4))


def run_threads(jobs: Sequence[Callable[[], None]], stop: threading.Event) -> None:
    """Each job on a thread of its own, until all end; `stop` is set on the way out, Ctrl-C's included, for the
    jobs to send nothing more on a client about to close. The threads are daemons: none holds the process open."""
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()


def first_model(client: httpx.Client, url: str) -> str:
    """The first model the server lists, or one line saying why there is none to ask for."""
    try:
        listed = client.get("/models", timeout=PROBE_S)
        if listed.status_code in (401, 403):
            raise ConfigError(f"the server at {url} refused the API key (HTTP {listed.status_code}): give its key "
                              "with --api-key")
        return listed.raise_for_status().json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
        raise ConfigError(f"no model listed at {url}/models ({type(error).__name__}: {str(error).splitlines()[0]}); "
                          "--url takes the API's base, e.g. http://127.0.0.1:8000/v1") from None


def run_load(url: str, prompts: Sequence[Prompt], requests: int, concurrency: int, max_tokens: int,
             temperature: float = 0.0, model: str | None = None, api_key: str | None = None,
             check_solo: bool = False, label: str | None = None) -> dict[str, Any]:
    with client_for(url, api_key, concurrency) as client:
        model = model or first_model(client, url)
        order = [i % len(prompts) for i in range(requests)]
        results: list[dict[str, Any] | None] = [None] * requests
        next_index = iter(range(requests))
        lock, stop = threading.Lock(), threading.Event()

        def worker() -> None:
            while not stop.is_set():
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                endpoint, body = request_body(prompts[order[i]], model, max_tokens, temperature)
                results[i] = reply_to(client, endpoint, body)

        start = time.perf_counter()
        run_threads([worker] * min(concurrency, requests), stop)
        wall = time.perf_counter() - start
        mismatches, solo_errors = None, None
        if check_solo:
            solo = {p: reply_to(client, *request_body(prompts[p], model, max_tokens, temperature))
                    for p in sorted(set(order))}
            mismatches = sum(r is not None and "error" not in r and "error" not in solo[order[i]]
                             and r["text"] != solo[order[i]]["text"] for i, r in enumerate(results))
            solo_errors = [reply["error"] for reply in solo.values() if "error" in reply]
    return {"label": label, "url": url, "model": model, "concurrency": concurrency, "requests": requests,
            "max_tokens": max_tokens, "temperature": temperature, **summarize(results, wall),
            "mismatches_vs_solo": mismatches, "solo_errors": solo_errors}


FOLLOW_UPS = ("Thank you. Can you say that again more briefly?", "Which point matters most, and why?",
              "Can you give one concrete example?")  # the later turns of a conversation, in order


def run_sessions(url: str, prompts: Sequence[Prompt], conversations: int, turns: int, rate: float, max_tokens: int,
                 temperature: float = 0.0, model: str | None = None, api_key: str | None = None,
                 label: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Open loop, multi-turn: conversation i (its first message prompt i, cycling) starts at the i-th arrival of a
    Poisson process of `rate` conversations per second, whatever the server's backlog; its `turns` turns run one
    after another, each sending the whole history (every earlier message and reply) and the next of FOLLOW_UPS (a
    conversation of one turn sends its prompt as it is: a text prompt as a completion).
    TTFT is reported for first turns and later turns apart: a later turn's history is what a prefix cache keeps."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, conversations))
    arrivals -= arrivals[0]  # the first conversation starts at once
    results: list[list[dict[str, Any]]] = [[] for _ in range(conversations)]
    with client_for(url, api_key, conversations) as client:
        model = model or first_model(client, url)
        start, stop = time.perf_counter(), threading.Event()

        def conversation(i: int) -> None:
            if stop.wait(max(0.0, arrivals[i] - (time.perf_counter() - start))):
                return
            prompt = prompts[i % len(prompts)]
            messages = messages_of(prompt)
            for turn in range(turns):
                if turn:
                    messages.append({"role": "user", "content": FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]})
                asked = prompt if turns == 1 else replace(prompt, text=tuple(messages), chat=True)  # (one turn: as
                endpoint, body = request_body(asked, model, max_tokens, temperature)  # the prompt is)
                result = reply_to(client, endpoint, body)
                results[i].append({**result, "turn": turn})
                if "error" in result or stop.is_set():
                    return
                messages.append({"role": "assistant", "content": result["text"]})

        run_threads([lambda i=i: conversation(i) for i in range(conversations)], stop)
        wall = time.perf_counter() - start
    flat = [r for turns_of in results for r in turns_of]  # the turns sent (none after a turn's error)
    done = [r for r in flat if "error" not in r]
    return {
        "label": label, "url": url, "model": model, "concurrency": None, "rate": rate, "turns": turns,
        "conversations": conversations, "requests": len(flat), "max_tokens": max_tokens,
        "temperature": temperature, **summarize(flat, wall),
        "ttft_first_turn_ms": percentiles([r["times"][0] for r in done if r["times"] and r["turn"] == 0]),
        "ttft_later_turns_ms": percentiles([r["times"][0] for r in done if r["times"] and r["turn"] > 0]),
        "mismatches_vs_solo": None,
    }


P50_90 = ("p50", "p90")  # the percentiles a report's table shows


def spread(p: dict[str, float | None], keys: tuple[str, ...] = ("p50", "p90", "p99"), sep: str = "/") -> str:
    """Percentiles as text: "-" where none was measured, nothing where the run recorded none (an older run's)."""
    return sep.join("" if key not in p else "-" if p[key] is None else f"{p[key]}" for key in keys)


def format_load(result: dict[str, Any]) -> str:
    line = (f"{result['label'] or result['url']}: {arrivals(result)}, {result['requests']} requests x "
            f"{result['max_tokens']} tokens in {result['wall_s']:.1f} s: {result['throughput_tok_s']:.1f} tok/s, "
            f"TTFT p50/p90/p99 {spread(result['ttft_ms'])} ms, TPOT {spread(result['tpot_ms'])} ms, ITL "
            f"{spread(result['itl_ms'])} ms, {result['errors']} errors, {result['lost']} lost")
    if later := result.get("ttft_later_turns_ms"):
        first = result["ttft_first_turn_ms"]
        line += f"; TTFT p50/p90 first turns {spread(first, P50_90)} ms, later turns {spread(later, P50_90)} ms"
    if result["mismatches_vs_solo"] is not None:
        line += f", {result['mismatches_vs_solo']} outputs differ from solo"
    if failed := result.get("solo_errors"):
        line += f" ({len(failed)} prompt(s) not compared, their solo request failed: {failed[0]})"
    if (spec := result.get("speculative")) and spec["drafted_tokens"] is None:
        line += f"; {spec['drafter_forwards']} drafter forwards (the target's verifications: on DSI's servers, " \
                "uncounted)"
    elif spec:
        line += (f"; {spec['drafted_tokens']} tokens drafted, {spec['accepted_tokens']} accepted, "
                 f"{spec['target_forwards']} target and {spec['drafter_forwards']} drafter forwards")
    return line + ("; " + "; ".join(result["error_samples"]) if result["error_samples"] else "")


def arrivals(result: dict[str, Any]) -> str:
    """How a run's requests came: C closed-loop clients, or conversations arriving at a Poisson rate."""
    if result.get("rate") is None:
        return f"C={result['concurrency']}"
    return f"{result['rate']:g} conversations/s x {result['turns']} turns"


RESULTS, REPORT, PLOT = "results.jsonl", "report.md", "throughput.png"  # what bench-serve writes in its --out
REPORTED = ("label", "requests", "throughput_tok_s", "ttft_ms", "tpot_ms", "errors", "lost", "mismatches_vs_solo")
COUNT, NUMBER, OR_NONE, TEXT, PERCENTILES = "a whole number >= 0", "a number >= 0", " or null", "a text or null", \
    "percentiles"
KINDS = {"label": TEXT, "prompts": TEXT, "requests": COUNT, "throughput_tok_s": NUMBER, "errors": COUNT, "lost": COUNT,
         "mismatches_vs_solo": COUNT + OR_NONE, "concurrency": COUNT + OR_NONE, "rate": NUMBER + OR_NONE,
         "turns": COUNT, "max_tokens": COUNT, "temperature": NUMBER, "ttft_ms": PERCENTILES, "tpot_ms": PERCENTILES,
         "itl_ms": PERCENTILES, "ttft_first_turn_ms": PERCENTILES, "ttft_later_turns_ms": PERCENTILES}  # what the
# report reads of a run: each checked where the run has it


def fits(value: Any, kind: str) -> bool:
    """Whether a run's field holds what `KINDS` says the report reads there."""
    if value is None:
        return kind.endswith(OR_NONE) or kind == TEXT
    if kind == TEXT:
        return isinstance(value, str)
    if kind == PERCENTILES:
        return isinstance(value, dict) and all(fits(v, NUMBER + OR_NONE) for v in value.values())
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    return number and (isinstance(value, int) if kind.startswith(COUNT) else True)


def read_runs(out: Path) -> list[dict[str, Any]]:
    """The runs `out/results.jsonl` holds (none where it is not there yet); a ConfigError naming the line where one
    is not a run this command wrote (checked before a new run appends to it, not after)."""
    path = out / RESULTS
    if not path.exists():
        return []
    if not path.is_file():  # (a link to /dev/null took every run unsaid; /dev/zero never ended)
        raise ConfigError(f"{path} is not a file: give another --out")
    runs = []
    try:
        lines = read_text(path, MOST_RESULTS_BYTES).splitlines()
    except (OSError, ValueError) as error:  # (TooLong, UnicodeDecodeError)
        raise ConfigError(f"{path} cannot be read: {error}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            run = json.loads(line)
        except ValueError:
            run = None
        if not isinstance(run, dict):
            raise ConfigError(f"{path}:{number} is not a JSON object: not a run of bench-serve (give another --out)")
        if lacking := [key for key in REPORTED if key not in run]:
            raise ConfigError(f"{path}:{number} has no {', '.join(lacking)}: not a run of bench-serve (give another "
                              "--out)")
        if odd := next((key for key, kind in KINDS.items() if key in run and not fits(run[key], kind)), None):
            raise ConfigError(f"{path}:{number}: {odd} is {json.dumps(run[odd])}, not {KINDS[odd]}: not a run of "
                              "bench-serve (give another --out)")
        runs.append(run)
    return runs


def write_report(out: Path) -> list[Path]:
    """`report.md` (a table) and `throughput.png` (tok/s against concurrency, a line per label) from every
    run in `out/results.jsonl` (runs made before ITL was counted by chunk show none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = read_runs(out)
    rows = ["| server | prompts | arrivals | requests | max tokens | temperature | tok/s | TTFT p50 / p90 ms | later "
            "turns' TTFT p50 / p90 ms | TPOT p50 / p90 ms | ITL p50 / p90 ms | errors | lost | differ from solo |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        later, itl = r.get("ttft_later_turns_ms") or {}, r.get("itl_ms") or {}
        rows.append(f"| {r['label']} | {r.get('prompts') or ''} | {arrivals(r)} | {r['requests']} | "
                    f"{r.get('max_tokens', '')} | "
                    f"{r.get('temperature', '')} | {r['throughput_tok_s']:.1f} | "
                    f"{spread(r['ttft_ms'], P50_90, ' / ')} | {spread(later, P50_90, ' / ')} | "
                    f"{spread(r['tpot_ms'], P50_90, ' / ')} | {spread(itl, P50_90, ' / ')} | "
                    f"{r['errors']} | {r['lost']} | {'' if r['mismatches_vs_solo'] is None else r['mismatches_vs_solo']} |")
    (out / REPORT).write_text("\n".join(rows) + "\n")
    runs = [r for r in runs if r.get("rate") is None]  # the plot: closed-loop runs, by concurrency
    if not runs:
        return [out / REPORT]
    figure, axis = plt.subplots(figsize=(6, 4))
    def setting(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["label"], r.get("prompts"), r.get("max_tokens"), r.get("temperature")

    lines = dict.fromkeys(map(setting, runs))  # (a line joins the runs of one server and settings alone)
    for line in lines:
        label, prompts, tokens, temperature = line
        points = sorted((r["concurrency"], r["throughput_tok_s"]) for r in runs if setting(r) == line)
        alike = sum(other[0] == label for other in lines) == 1
        axis.plot(*zip(*points), marker="o", label=f"{label}" + ("" if alike else
                                                                  f" ({prompts}, {tokens} tokens, T {temperature})"))
    axis.set_xlabel("concurrent clients")
    axis.set_ylabel("tokens/s over the run")
    axis.set_xscale("log", base=2)
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / PLOT, dpi=120)
    plt.close(figure)
    return [out / REPORT, out / PLOT]
