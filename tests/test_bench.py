"""The benchmark harness on tiny models: parsing, interleaving, same-run speedups, outputs."""

import json
from pathlib import Path

import pytest

from helpers import byte_tokenizer, tiny_transformer
from speculant import cli
from speculant.bench.datasets import Prompt, load_dataset
from speculant.bench.llamacpp_cli import schema_args
from speculant.bench.methods import parse_method
from speculant.drafters.spec import DrafterSpec
from speculant.bench.runner import run_matrix
from speculant.bench.summary import rows_from_json, summarize, to_json
from speculant.errors import ConfigError
from speculant.models import HFCausalLM


def test_method_specs_parse():
    spec = parse_method("sd:drafter=qwen2.5-coder-0.5b@int8,k=6,dtype=fp32,drafter_dtype=bf16")
    assert (spec.method, spec.options.drafter, spec.options.k, spec.dtype, spec.options.drafter_dtype) == \
        ("sd", DrafterSpec("qwen2.5-coder-0.5b", "int8"), 6, "fp32", "bf16")
    assert parse_method("ar").dtype is None and parse_method("sd").options.k == 4
    assert parse_method("sd:k=15,draft_confidence=0.4").options.draft_confidence == 0.4
    tree = parse_method("tree:depth=3,width=auto")
    assert (tree.options.depth, tree.options.width, str(tree.options.drafter)) == (3, "auto", "default")
    cascade = parse_method("cascade:drafters=a@int8,b,maxgram,k_matrix=2,1,1;0,2,1;0,0,3,leniency=2,dtype=fp32")
    assert ([str(d) for d in cascade.options.drafters], cascade.options.k_matrix, cascade.options.leniency,
            cascade.dtype) == (["a@int8", "b", "maxgram"], [[2, 1, 1], [0, 2, 1], [0, 0, 3]], 2.0, "fp32")
    dsi = parse_method("dsi:drafter=a@int8,servers=2,lookahead=6,executor=process")
    assert (str(dsi.options.drafter), dsi.options.servers, dsi.options.lookahead, dsi.options.executor) == \
        ("a@int8", 2, 6, "process")
    assert parse_method("hf-assisted:k=3").peer and parse_method("hf-assisted:k=3").options.k == 3


@pytest.mark.parametrize(("bad", "why"), [
    ("xx", "unknown method 'xx'"), ("ar:k=3", "option 'k' does not apply to method 'ar'"),
    ("sd:k=0", "k must be >= 1, got 0"), ("sd:k=two", "bad value 'two' for k"),
    ("sd:depth=3", "option 'depth' does not apply to method 'sd'"), ("sd:dtype=fp16", "dtype must be one of"),
    ("sd:k", "bad option 'k'"), ("tree:width=0", "width must be an integer >= 1 or auto, got 0"),
    ("tree:profile=x.json", "unknown option 'profile' for method 'tree'"),
    ("tree:target_profile=missing.json", "target profile not found: missing.json"),
    ("cascade", "method 'cascade' needs option 'drafters'"),
    ("cascade:drafters=a,maxgram,k_matrix=1;2;3", "the K matrix needs one row per drafter level"),
    ("hf-pld:drafter=x", "option 'drafter' does not apply to method 'hf-pld'"),
    ("sd:drafter=x@int3", "unknown quantization 'int3'"),
    ("cascade:drafters=maxgram,leniency=0.5", "leniency must be a finite number >= 1, got 0.5"),
    ("sd:drafter=x,leniency=2", "option 'leniency' does not apply to method 'sd'"),
    ("dsi:servers=0", "servers must be in 1..64, got 0"), ("dsi:executor=mpi", "unknown executor 'mpi'"),
    ("sd:servers=2", "option 'servers' does not apply to method 'sd'"), ("dsi:lookahead=x", "bad value 'x' for lookahead"),
    ("sd:draft_confidence=1.5", r"draft_confidence must lie in \[0, 1\), got 1.5"),
    ("sd:draft_confidence=x", "bad value 'x' for draft_confidence"),
    ("tree:draft_confidence=0.5", "option 'draft_confidence' does not apply to method 'tree'"),
    ("sd:drafter=maxgram,draft_confidence=0.5", "draft_confidence needs a model drafter, not maxgram"),
    ("hf-assisted:drafter=maxgram", "hf-assisted needs a model drafter"),
    ("llamacpp-cli-spec:drafter=suffix", "llamacpp-cli-spec needs a model drafter")])
def test_bad_method_specs_are_refused(bad, why):
    """Each refused for its own reason, in a line that names the spec."""
    with pytest.raises(ConfigError, match=why) as refused:
        parse_method(bad)
    assert f"in '{bad}'" in str(refused.value)


@pytest.mark.parametrize("bad", ["hf-pld:k=0", "hf-pld:k=-1", "hf-assisted:drafter=x,k=0", "llamacpp-cli-ngram:k=0",
                                 "llamacpp-cli-spec:drafter=x,k=-1", "llamacpp-pld:k=0", "hf-pld:k=1025",
                                 "llamacpp-cli-ngram:k=99999999999"])  # (llama.cpp's own parse failed, unnamed)
def test_a_peer_s_draft_length_outside_1_to_1024_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match=r"k must lie in \[1, 1024\], got -?\d+ \(leave k out for the peer's "
                       "default\)"):
        parse_method(bad)


def test_humaneval_slices():
    prompts = load_dataset("humaneval[:3]")
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert load_dataset("humaneval[160:]")[0].id == "HumanEval/160"


def test_jsonl_prompts_and_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a", "category": "x"}\n\n{"prompt": "b", "id": "two"}\n')
    prompts = load_dataset(str(good))
    assert [(p.id, p.text, p.category) for p in prompts] == [("1", "a", "x"), ("two", "b", "all")]
    assert load_dataset(f"{good}[1:]")[0].text == "b"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        load_dataset(str(bad))
    turns = tmp_path / "mtbench.jsonl"
    turns.write_text('{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}\n')
    assert load_dataset(str(turns)) == [Prompt("81", "Write a poem.", "writing", chat=True)]
    (tmp_path / "field.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match=r"field.jsonl:1: no prompt has a field \"text\" \(the fields: prompt,"):
        load_dataset(str(tmp_path / "field.jsonl"))
    (tmp_path / "field.jsonl").write_text('{"id": "a"}\n')
    with pytest.raises(ConfigError, match=r"field.jsonl:1: .*'prompt'"):
        load_dataset(str(tmp_path / "field.jsonl"))
    (tmp_path / "blank.jsonl").write_text('{"prompt": "a"}\n{"prompt": " "}\n')
    with pytest.raises(ConfigError, match=r"blank.jsonl:2: the prompt is empty"):
        load_dataset(str(tmp_path / "blank.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no prompts"):
        load_dataset(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_dataset("nope[:2]")
    with pytest.raises(ConfigError, match="prompts file not found: .*missing.jsonl"):
        load_dataset(str(tmp_path / "missing.jsonl") + "[:2]")
    joined = load_dataset(f"{good}[1:]+humaneval[:2]+{Path(__file__).parents[1] / 'prompts' / 'long.jsonl'}")
    assert [p.id for p in joined] == ["two", "HumanEval/0", "HumanEval/1", "rag-long-1", "rag-long-2",
                                      "summarization-long-1", "summarization-long-2"]
    with pytest.raises(ConfigError, match="prompt ids repeat across .*: 'HumanEval/1'"):
        load_dataset("humaneval[:2]+humaneval[1:3]")
    for name, lines, message in (  # within one file too: a bench pairs methods' runs by prompt id
            ("ids", '{"prompt": "a"}\n{"prompt": "b", "id": 1}\n', r"ids.jsonl:2: the prompt id '1' is line 1's too "
             r"\(a prompt without an id is named by its line\)"),
            ("both", '{"prompt": "a", "turns": ["b"]}\n', r"both.jsonl:1: give one of 'prompt', 'turns' and 'messages', "
             "not prompt and turns"),  # (turns were dropped)
            ("null", '{"prompt": "a", "id": null}\n', r"null.jsonl:1: id must be text or an integer, got null"),
            ("kind", '{"prompt": "a", "category": ["x"]}\n', r"kind.jsonl:1: category must be text, got \[\"x\"\]"),
            ("chat", '{"prompt": "a", "chat": "false"}\n', r"chat.jsonl:1: chat must be true or false"),
            ("typo", '{"prompt": "a", "caht": true}\n', r"typo.jsonl:1: no prompt has a field \"caht\" \(the fields: "
             "prompt, turns,"),  # (it would run without the chat template)
            ("surrogate", '{"prompt": "a\\udcffb"}\n', r"surrogate.jsonl:1: the prompt is not UTF-8 text"),
            ("twice", '{"prompt": "a", "prompt": "b"}\n', r"twice.jsonl:1: prompt: a key given twice"),
            ("ids2", '{"prompt": "a", "id": 1, "question_id": 2}\n', r"ids2.jsonl:1: give one of 'id' and "
             "'question_id', not id and question_id"),
            ("bot", '{"messages": [{"role": "bot", "content": "a"}]}\n', r"bot.jsonl:1: expected .* \(roles: system, "
             "user, assistant; content: text\)"),
            ("named", '{"messages": [{"role": "user", "content": "a", "name": "x"}]}\n', r"named.jsonl:1: expected"),
            ("turns", '{"turns": ["a", 5]}\n', r"turns.jsonl:1: expected"),
            ("silent", '{"messages": [{"role": "user", "content": " "}]}\n', r"silent.jsonl:1: the prompt is empty")):
        (tmp_path / f"{name}.jsonl").write_text(lines)
        with pytest.raises(ConfigError, match=message):
            load_dataset(str(tmp_path / f"{name}.jsonl"))
    (tmp_path / "a+b.jsonl").write_text('{"prompt": "a"}\n')
    assert load_dataset(str(tmp_path / "a+b.jsonl"))[0].text == "a"
    assert load_dataset(f"{tmp_path / 'a+b.jsonl'}[:1]")[0].text == "a"  # (sliced too)
    with pytest.raises(ConfigError, match=r"a slice is written in brackets, .*good.jsonl\[:1\]"):
        load_dataset(f"{good}:1")


def test_a_prompts_file_longer_than_any_is_refused_not_read_without_end(tmp_path, monkeypatch):
    from speculant.bench import datasets

    monkeypatch.setattr(datasets, "MOST_PROMPTS_BYTES", 64)
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "a" * 64}))
    for path in [tmp_path / "long.jsonl", *(["/dev/zero"] if Path("/dev/zero").exists() else [])]:
        with pytest.raises(ConfigError, match=f"prompts file {path} holds more than 64 bytes: not a prompts file"):
            load_dataset(str(path))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = tiny_transformer("llama", 0, 257)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


def test_matrix_is_interleaved_and_speedup_comes_from_the_same_run(tiny_dir, monkeypatch):
    from speculant.models import base

    target = HFCausalLM(tiny_transformer("llama", 0, 257), byte_tokenizer(), "tiny")
    methods = [parse_method("ar"), parse_method(f"sd:drafter={tiny_dir},k=3")]  # same weights: always agrees
    prompts = [Prompt("p1", "def f(x): return x + 1"), Prompt("p2", "hello")]
    kept = []  # (tokens the drafter's cache held, of the context) at each of its catch-ups
    monkeypatch.setattr(base, "resync", lambda model, cached, context, *rest, resync=base.resync: kept.append(
        (base.common_prefix_len(cached, context), len(context))) or resync(model, cached, context, *rest))
    rows = run_matrix(lambda dtype, backend: target, methods, prompts, 12, repeats=2,
                      on_row=lambda row: kept.append(row.method))
    first = kept[kept.index("ar") + 1]  # sd's first catch-up in its first measured run: the warm-up left nothing
    assert first[0] <= 1 < first[1]
    sd_label = methods[1].label
    # A B, B A across prompts and across repeats
    assert [(r.prompt_id, r.method) for r in rows] == [("p1", "ar"), ("p1", sd_label), ("p2", sd_label), ("p2", "ar"),
                                                       ("p1", sd_label), ("p1", "ar"), ("p2", "ar"), ("p2", sd_label)]
    assert [r.repeat for r in rows] == [0] * 4 + [1] * 4
    ar, sd = summarize(rows, methods)
    assert ar.speedup == 1.0 and ar.identical_to_ar == 1.0
    assert sd.identical_to_ar == 1.0 and sd.common_prefix_with_ar == 12 and sd.acceptance_rate == 1.0
    ar_rows, sd_rows = [r for r in rows if r.method == "ar"], [r for r in rows if r.method == sd_label]
    ar_tps = sum(r.stats.new_tokens for r in ar_rows) / sum(r.stats.wall_s for r in ar_rows)  # all repeats
    sd_tps = sum(r.stats.new_tokens for r in sd_rows) / sum(r.stats.wall_s for r in sd_rows)
    assert sd.speedup == pytest.approx(sd_tps / ar_tps)
    assert sd.acceptance_per_position == [1.0, 1.0, 1.0]
    # Reported again from its results.json, over another baseline: the same numbers, seen from sd.
    again = rows_from_json(json.loads(json.dumps(to_json({}, rows, [], {}))))
    assert [(r.prompt_id, r.method, r.token_ids, r.text) for r in again] == [
        (r.prompt_id, r.method, r.token_ids, r.text) for r in rows]
    ar2, sd2 = summarize(again, methods, baseline=methods[1].label)
    assert sd2.speedup == 1.0 and ar2.speedup == pytest.approx(1 / sd.speedup)
    assert sd2.identical_to_ar == 1.0 and sd2.acceptance_rate == 1.0


def test_a_peer_warms_up_on_the_prompt_itself(monkeypatch):
    """llama.cpp's tools take the prompt as text and tokenize it again: reversed ids need not come back as they were
    (the tool then counted other prompt tokens and the run stopped), and a peer keeps no cache to mislead."""
    from speculant.api import GenerationResult
    from speculant.bench import runner
    from speculant.decoding.stats import GenerationStats

    given = []
    monkeypatch.setattr(runner, "peer_generate", lambda method, target, ids, *rest: given.append(list(ids)) or
                        GenerationResult([1], "a", GenerationStats(new_tokens=1, wall_s=0.1, ttft_s=0.05)))
    target = HFCausalLM(tiny_transformer("llama", 0, 257), byte_tokenizer(), "tiny")
    run_matrix(lambda dtype, backend: target, [parse_method("hf-ar")], [Prompt("p1", "def f(x):")], 4)
    assert given[0] == given[1]  # the warm-up's, then the measured run's


def test_prompts_with_a_response_format_are_followed_by_every_method(tiny_dir, tmp_path):
    pytest.importorskip("llguidance")
    path = tmp_path / "json.jsonl"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False,  # compact JSON: a random model pads with all the whitespace it may
              "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}
    path.write_text(json.dumps({"id": "j1", "prompt": "Answer:", "response_format": {
        "type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}}) + "\n")
    prompts = load_dataset(str(path))
    target = HFCausalLM(tiny_transformer("llama", 0, 257), byte_tokenizer(), "tiny")
    methods = [parse_method("ar"), parse_method(f"sd:drafter={tiny_dir},k=3"), parse_method("sd:drafter=maxgram")]
    rows = run_matrix(lambda dtype, backend: target, methods, prompts, 30)
    assert all(json.loads(row.text) in ({"ok": True}, {"ok": False}) for row in rows)
    assert all(s.identical_to_ar == 1.0 for s in summarize(rows, methods))
    with pytest.raises(ConfigError, match="hf-ar cannot follow a prompt's response_format"):
        run_matrix(lambda dtype, backend: target, [parse_method("hf-ar")], prompts, 4)
    with pytest.raises(ConfigError, match="llamacpp-cli-spec cannot follow a json_schema response_format"):
        run_matrix(lambda dtype, backend: target, [parse_method("llamacpp-cli-spec")], prompts, 4)
    assert schema_args("llamacpp-cli-ar", prompts[0].response_format) == ["--json-schema", json.dumps(schema)]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "response_format": {"type": "xml"}}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: response_format type must be one of"):
        load_dataset(str(tmp_path / "bad.jsonl"))
    (tmp_path / "text.jsonl").write_text('{"prompt": "a", "response_format": {"type": "text"}}\n')
    assert load_dataset(str(tmp_path / "text.jsonl"))[0].response_format is None  # (free text: acceptance took it
    # for structured output, and --ignore-response-format for a format to ignore)


def test_dsi_in_the_matrix_keeps_its_servers_across_prompts(tiny_dir):
    target = HFCausalLM(tiny_transformer("llama", 0, 257), byte_tokenizer(), "tiny")
    methods = [parse_method("ar"), parse_method(f"dsi:drafter={tiny_dir},servers=2,lookahead=3")]
    prompts = [Prompt("p1", "def f(x):"), Prompt("p2", "hello")]
    rows = run_matrix(lambda dtype, backend: target, methods, prompts, 12)
    ar, dsi = summarize(rows, methods)
    assert dsi.identical_to_ar == 1.0 and dsi.acceptance_rate in (None, 1.0)  # same weights: never rejected
    assert [r.stats.dsi.lookahead for r in rows if r.method == dsi.method] == [3, 3]


def test_a_run_s_verifier_reaches_the_methods_that_take_one(tiny_dir):
    """A run's verifier (`bench --verifier token`) is for the methods whose sampled chains follow it: `ar` and `tree`
    in the same run sample as the run says and decode with the default they take (they refuse one given them)."""
    from speculant.config import SamplingConfig

    target = HFCausalLM(tiny_transformer("llama", 0, 257), byte_tokenizer(), "tiny")
    methods = [parse_method("ar"), parse_method("sd:drafter=maxgram,k=2"), parse_method(f"tree:drafter={tiny_dir}")]
    rows = run_matrix(lambda dtype, backend: target, methods, [Prompt("p1", "def f(x):")], 4, seed=0,
                      sampling=SamplingConfig(1.0, verifier="token"))
    assert [len(row.token_ids) for row in rows] == [4, 4, 4]
    assert [m.sampled(SamplingConfig(1.0, verifier="token")).verifier for m in methods] == ["block", "token", "block"]


def test_dsi_in_the_matrix_runs_its_servers_as_its_spec_says(tiny_dir):
    """The servers a bench run starts for a DSI method carry its own options, as `generate` starts them: the twin's
    padding (a run's time at least its forwards' padded time) and the method's sampling (its servers sample alike)."""
    target = HFCausalLM(tiny_transformer("llama", 0, 257), byte_tokenizer(), "tiny")
    methods = [parse_method("dsi:drafter=maxgram,twin_latency=60,1"),
               parse_method("dsi:drafter=maxgram,lookahead=2,temperature=1")]
    rows = run_matrix(lambda dtype, backend: target, methods, [Prompt("p1", "def f(x):")], 4, seed=0)
    padded, sampled = rows
    assert padded.stats.wall_s >= 4 * 0.06 and len(sampled.token_ids) == 4


def test_bench_cli_writes_json_markdown_and_plots(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):", "category": "code"}\n{"prompt": "hello", "category": "chat"}\n')
    out = tmp_path / "out"
    code = cli.main(["bench", "--target", tiny_dir, "--dtype", "fp32", "--methods", "ar", f"sd:drafter={tiny_dir},k=2",
                     "hf-ar", f"hf-assisted:drafter={tiny_dir},k=2", "hf-pld:k=3", f"tree:drafter={tiny_dir},depth=2,width=2,verify_width=3",
                     f"cascade:drafters={tiny_dir},maxgram,k_matrix=2,1;3", "sd:k=2",
                     "--prompts", str(prompts), "--max-new-tokens", "6", "--out", str(out), "--baseline", "default"])
    stdout, _ = capsys.readouterr()
    assert code == 0
    assert "hf-assisted" in stdout and "speedup" in stdout
    results = json.loads((out / "results.json").read_text())
    assert len(results["rows"]) == 16
    # what each method's drafters were: `default` as it resolved for this target (no catalog pair: Max-Gram)
    assert results["config"]["drafters"] == {f"sd:drafter={tiny_dir},k=2": tiny_dir, "sd:k=2": "maxgram",
                                             f"tree:drafter={tiny_dir},depth=2,width=2,verify_width=3": tiny_dir,
                                             f"cascade:drafters={tiny_dir},maxgram,k_matrix=2,1;3": f"{tiny_dir}, maxgram",
                                             f"hf-assisted:drafter={tiny_dir},k=2": tiny_dir}
    assert "`sd:k=2`: maxgram" in (out / "report.md").read_text()
    # `--baseline default` saved as what it resolved to (it was saved as its text, which --report-from took for a label)
    assert results["config"]["baseline"] is None
    # the command as a shell reads it back (a spec's ';' quoted)
    assert f"'cascade:drafters={tiny_dir},maxgram,k_matrix=2,1;3'" in results["config"]["command"]
    assert cli.main(["bench", "--report-from", str(out / "results.json"), "--out", str(tmp_path / "again")]) == 0
    assert "`sd:k=2`: maxgram" in (tmp_path / "again" / "report.md").read_text()
    assert results["config"]["prompts"] == str(prompts) and results["config"]["dataset"] is None  # (not its default)
    summary = {s["method"]: s for s in results["summary"]}
    # Greedy peers and speculant's methods all reproduce the target's greedy output.
    assert all(s["identical_to_ar"] == 1.0 for s in summary.values())
    assert summary["ar"]["swi"] == pytest.approx(1.0, abs=0.2) and summary["hf-ar"]["swi"] is None
    # What nobody measured stays unset: ar drafts nothing, a peer's forwards are not counted.
    assert summary["ar"]["mean_accepted_length"] is None and summary["hf-ar"]["target_forwards"] is None
    assert summary["ar"]["speedup_ci95"] == [1.0, 1.0] and summary["hf-ar"]["decode_tokens_per_s"] > 0
    assert "| ar | " in (out / "report.md").read_text() and "| - |" in (out / "report.md").read_text()
    assert summary[f"cascade:drafters={tiny_dir},maxgram,k_matrix=2,1;3"]["cost_ratios"]
    assert set(results["by_category"]) == {"code", "chat"}
    report = (out / "report.md").read_text()
    assert "speculant bench" in report and "| ar |" in report and "## code" in report
    for name in ("speedup.png", "acceptance.png", "categories.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_methods_sample_with_settings_of_their_own_each_against_its_own_ar(tiny_dir):
    """`auto:temperature=0.3,verifier=token`: the method's sampling in place of the run's; its speedup is over the
    first `ar` that samples alike (the verifier aside), so that one run compares several temperatures."""
    from speculant.config import SamplingConfig

    spec = parse_method("sd:drafter=maxgram,temperature=0.3,verifier=token")
    assert spec.sampling == (("temperature", 0.3), ("verifier", "token"))
    assert spec.sampled(SamplingConfig(1.0, top_k=5)) == SamplingConfig(0.3, 5, None, "token")
    with pytest.raises(ConfigError, match="verifier must be one of block, token"):
        parse_method("sd:verifier=tokens")
    target = HFCausalLM(tiny_transformer("llama", 0, 257), byte_tokenizer(), "tiny")
    methods = [parse_method(m) for m in ("ar:temperature=1", "ar:temperature=0.3", spec.label)]
    rows = run_matrix(lambda dtype, backend: target, methods, [Prompt("p1", "def f(x):")], 8, seed=3)
    from speculant import generate
    from speculant.api import encode_prompt

    ids = encode_prompt(target.tokenizer, "def f(x):")
    for row, temperature in zip(rows, (1.0, 0.3)):  # each ar sampled at its own temperature, as generate samples it
        assert row.token_ids == generate(target, prompt_ids=ids, method="ar", max_new_tokens=8, temperature=temperature,
                                         seed=3).token_ids
    hot, cold, sd = summarize(rows, methods)
    assert sd.speedup == pytest.approx(sd.tokens_per_s / cold.tokens_per_s)
    # agreement too is with the ar that samples alike: each ar agrees with itself, whatever the other drew
    assert hot.identical_to_ar == cold.identical_to_ar == 1.0
    assert sd.identical_to_ar == (rows[2].token_ids == rows[1].token_ids)
    # a method sampling as the run does (--temperature 0.3), no temperature of its own: over the ar at 0.3 too
    from dataclasses import replace

    run_s = parse_method("sd:drafter=maxgram,verifier=token")
    again = [*rows[:2], replace(rows[2], method=run_s.label)]
    *_, sd = summarize(again, [*methods[:2], run_s], sampling=SamplingConfig(0.3))
    assert sd.speedup == pytest.approx(sd.tokens_per_s / cold.tokens_per_s)
    assert sd.identical_to_ar == (rows[2].token_ids == rows[1].token_ids)


def test_each_bench_method_learns_from_its_own_generations_only(tiny_dir, tmp_path, monkeypatch):
    """A session per method (its drafter caches, the acceptance it learns): no method finds another's drafter cache
    holding the prompt or acceptance learned on it, without --isolate."""
    from speculant.bench import runner

    made = []

    class Recorded(runner.Session):
        def __init__(self, target):
            super().__init__(target)
            made.append(self)

    monkeypatch.setattr(runner, "Session", Recorded)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "def g(y):"}\n')
    argv = ["bench", "--target", tiny_dir, "--dtype", "fp32", "--prompts", str(prompts), "--max-new-tokens", "2"]
    assert cli.main([*argv, "--methods", "ar", "auto", "auto:k_max=4"]) == 0
    assert len(made) == 3


def test_bench_cli_bad_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert cli.main(["bench", "--methods", "ar", "--dataset", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert cli.main(["bench", "--methods", "ar", "zz"]) == 2
    assert cli.main(["bench", "--methods", "ar", "sd", "sd:k=4"]) == 2  # (one method spelled twice)
    assert "'sd:k=4' runs what 'sd' runs" in capsys.readouterr().err
    for argv in (["--repeats", "0"], ["ar"]):  # (a flag's own type, a list's entry twice: argparse's usage errors)
        with pytest.raises(SystemExit, match="2"):
            cli.main(["bench", "--methods", "ar", *argv])


def test_a_generation_refused_in_its_own_process_is_one_line(tiny_dir):
    """`--isolate`: what speculant refuses in the child (here structured output with dsi) reaches the bench as the
    child's one line, a ConfigError, not as a RuntimeError holding the tail of a traceback."""
    from speculant.bench.isolated import isolated_generate

    request = {"target": tiny_dir, "dtype": "fp32", "device": "cpu", "backend": "hf", "method": "dsi:drafter=maxgram",
               "prompt_ids": [100, 101], "max_new_tokens": 2, "temperature": 0.0, "verifier": "block",
               "response_format": {"type": "json_object"}}
    with pytest.raises(ConfigError, match=r"^response_format not available with dsi: .*\(in the isolated generation of "
                                          r"dsi:drafter=maxgram\)$"):
        isolated_generate(request)


def test_the_printed_table_folds_a_long_method_label_and_never_cuts_it():
    """Two labels that part only at their ends print whole (they were cut to one same prefix with an ellipsis)."""
    from rich.console import Console

    from speculant.bench.report import print_table
    from speculant.bench.summary import MethodSummary

    labels = [f"tree:drafter=qwen2.5-coder-0.5b@lean,depth=4,width=2{tail}" for tail in ("", ",schedule=stage")]
    console = Console(record=True, width=100)
    print_table([MethodSummary(label, "t", 10, 1.0, 10.0, 10.0) for label in labels], "title", console)
    printed = "".join(line.split("│")[1].strip() for line in console.export_text().splitlines() if "│" in line)
    assert "…" not in printed and all(label in printed for label in labels), printed


def test_the_speedup_plot_names_its_baseline_and_leaves_out_methods_without_a_speedup(tmp_path, monkeypatch):
    """speedup.png said "over ar" whatever the baseline, and drew a method without a speedup (a peers-only run with no
    baseline) as a bar at 0."""
    import matplotlib.axes

    from speculant.bench.report import plot
    from speculant.bench.summary import MethodSummary

    labels, bars, errors = [], [], []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel", lambda self, text, *a, **k: labels.append(text))
    bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda self, x, heights, *a, **k:
                        bars.append(list(heights)) or errors.append(k.get("yerr")) or bar(self, x, heights, *a, **k))
    rows = [MethodSummary("llamacpp-cli-ar", "t", 10, 1.0, 10.0, 10.0, speedup=1.0),
            MethodSummary("ar", "t", 10, 1.0, 15.0, 15.0, speedup=1.5, speedup_ci95=(1.25, 2.0)),
            MethodSummary("hf-ar", "t", 10, 1.0, 9.0, 9.0)]
    assert (tmp_path / "speedup.png") in plot(rows, {}, tmp_path, "llamacpp-cli-ar")
    assert bars == [[1.0, 1.5]] and labels[0] == "speedup over llamacpp-cli-ar (same run, 95% CI)"
    assert errors[0] == [[0.0, 0.25], [0.0, 0.5]]  # (its interval drawn: none where the summary has none)
    assert plot(rows[:2], {}, tmp_path)[0].name == "speedup.png"
    assert labels[-1] == "speedup over its ar (same run, 95% CI)"
    # nothing to draw (a peer without a baseline, no drafts): no plot, and none left from the run before
    assert plot(rows[2:], {}, tmp_path) == [] and not list(tmp_path.glob("*.png"))


def test_each_method_is_sped_up_over_the_ar_of_its_own_weights_and_a_mismatch_never_reads_100_percent(tmp_path):
    """With `ar`, `ar:dtype=fp32` and `sd:...,dtype=fp32`, sd's speedup was over the first ar (other weights) while
    its identity was checked against its own; and one output in 250 unlike ar's printed as 100% identical."""
    from speculant.bench.report import markdown_table
    from speculant.bench.runner import Measurement
    from speculant.decoding.stats import GenerationStats

    methods = [parse_method(m) for m in ("ar", "ar:dtype=fp32", "sd:drafter=maxgram,dtype=fp32")]
    weights = {methods[0].label: "lean", methods[1].label: "fp32", methods[2].label: "fp32"}
    seconds = {methods[0].label: 1.0, methods[1].label: 4.0, methods[2].label: 2.0}
    rows = [Measurement(f"p{i}", "c", spec.label, 0, weights[spec.label],
                        [9] if spec is methods[2] and i == 0 else [1], GenerationStats(new_tokens=10,
                        wall_s=seconds[spec.label], ttft_s=0.1)) for i in range(250) for spec in methods]
    _, _, sd = summarize(rows, methods)
    assert sd.speedup == pytest.approx(2.0) and sd.identical_to_ar == pytest.approx(0.996)
    assert "| 99.6% |" in markdown_table([sd])


def test_a_prompt_too_long_for_the_target_is_refused_before_the_first_generation():
    target = HFCausalLM(tiny_transformer("llama", 0, 257), byte_tokenizer(), "tiny")
    long = Prompt("long", "x" * (target.max_positions + 5))
    with pytest.raises(ConfigError, match="prompt long: the prompt has .* holds at most"):
        run_matrix(lambda dtype, backend: target, [parse_method("ar")], [Prompt("p1", "def f(x):"), long], 4)
