"""Yggdrasil's depth predictor: it learns what decides how deep a tree is accepted, drafts the depth the
objective prefers, and leaves the output exactly the target's."""

import os
import random

import pytest
import torch

from helpers import DEVICES, MORE_ARCHS, perturbed, random_prompt, tiny_model
from speculant import cli, generate
from speculant.analysis.depth import fit, log_trees
from speculant.session import Session
from speculant.trees.depth import DepthPredictor, Observation, Recent, features


def test_the_predictor_learns_the_accepted_depth_and_drafts_deeper_where_more_is_accepted():
    rng = random.Random(0)
    samples = []
    for _ in range(600):  # the accepted depth follows the target's confidence, give or take a level
        p1 = rng.random()
        accepted = min(4, round(4 * p1) + rng.choice([0, 0, 0, 1]))
        samples.append((Observation([p1, (1 - p1) / 2, 1 - p1, rng.random()]), accepted))
    with pytest.raises(ValueError, match="2 logged trees are too few"):  # (one tree to train on: no spread, NaN)
        fit(samples[:2], 4)
    predictor, report = fit(samples, 4)
    assert report.accuracy > report.baseline + 0.25 and report.mean_error < 0.6 < report.baseline_error
    flat = lambda n: 1.0  # noqa: E731 - verification costs the same whatever the tree
    depths = [predictor.depth(Observation([p1, (1 - p1) / 2, 1 - p1, 0.5]), flat, 0.2, 1) for p1 in (0.05, 0.5, 0.95)]
    assert depths == sorted(depths) and depths[0] < depths[-1] == 4
    steep = lambda n: 1.0 + n  # noqa: E731 - each node costs a forward: only a sure level pays
    assert predictor.depth(Observation([0.05, 0.5, 0.95, 0.5]), steep, 0.2, 1) == 1


def test_the_hidden_state_predictor_reads_what_decides_the_depth_from_the_hidden_state():
    """64-dimensional states whose projection on one direction sets the accepted depth: the paper's predictor (an
    encoder, a head per depth) learns it, saves and loads, and drafts deeper where more is accepted."""
    generator = torch.Generator().manual_seed(0)
    direction = torch.randn(64, generator=generator)
    samples = []
    for _ in range(800):
        state = torch.randn(64, generator=generator) * 3 + 5
        level = float(torch.sigmoid((state - 5) @ direction / 8))
        samples.append((Observation([0.0] * 4, state), min(4, round(4 * level))))
    predictor, report = fit(samples, 4, "hidden")
    assert report.accuracy > report.baseline + 0.2 and report.mean_error < report.baseline_error
    flat = lambda n: 1.0  # noqa: E731
    low, high = (Observation([0.0] * 4, 5 + sign * 2 * direction / direction.norm() * 8) for sign in (-1, 1))
    assert predictor.depth(low, flat, 0.2, 1) < predictor.depth(high, flat, 0.2, 1) == 4
    at_least = predictor.at_least(high)
    assert at_least[0] == 1 and bool((at_least[1:] <= at_least[:-1]).all())
    with pytest.raises(ValueError, match="hidden state"):
        predictor.at_least(Observation([0.0] * 4))


def test_features_read_the_target_distribution_and_the_recent_acceptance():
    recent = Recent()
    x = features(torch.tensor([10.0, 0.0, 0.0, 0.0]), recent)
    assert x[0] > 0.99 and x[1] < 0.01 and x[2] < 0.01 and x[3] == 0.5
    assert features(torch.zeros(4), recent)[:3] == pytest.approx([0.25, 0.25, 1.0])
    masked = torch.tensor([0.0, 0.0, float("-inf"), float("-inf")])  # a grammar's (response_format) masked logits
    assert features(masked, recent)[:3] == pytest.approx([0.5, 0.5, 0.5])  # (entropy was NaN: depth 1 ever after)
    shallow, deep = Recent(), Recent()
    for _ in range(6):  # every level accepted, at whatever depth it drafts: the same high rate
        shallow.observe(2, 2)
        deep.observe(8, 8)
    assert shallow.rate > 0.75 and deep.rate > 0.9
    deep.observe(0, 8)  # a first-level rejection pulls it down
    assert deep.rate < 0.9


def test_trees_are_logged_within_the_target_s_positions():
    """train-depth's generations ran past a short target's positions (40 positions, a 27-token prompt, 100 new
    tokens: 94 trees logged, most of them past its context); they stop where `generate` stops."""
    target = tiny_model("llama", 3, 64, init_std=0.1)
    drafter = perturbed(target, 0.1, 3)
    prompt = random_prompt(3, 64, 9) * 3
    target.max_positions = 40
    samples = log_trees(target, drafter, [prompt], 100, 4, 1)
    assert samples and target.cache_len <= 40
    assert len(generate(target, prompt_ids=prompt, method="ar", max_new_tokens=100).token_ids) == 13


def test_a_predictor_file_is_checked_where_it_is_read(tmp_path):
    """A file of depth 0, of unknown inputs or with standardization of another width loaded without a word and
    failed at the first tree with a traceback (an empty max(), a shape mismatch)."""
    import json

    from speculant.errors import ConfigError

    DepthPredictor(3).save(tmp_path / "good.json")
    good = json.loads((tmp_path / "good.json").read_text())
    assert DepthPredictor.load(tmp_path / "good.json").max_depth == 3
    for name, edit, said in (("depth", {"max_depth": 0}, "max_depth 0"), ("inputs", {"inputs": "hiden"}, "'hiden'"),
                             ("true", {"max_depth": True}, "max_depth True"),
                             ("mean", {"state": {**good["state"], "mean": [0.0] * 3}}, "not 4 numbers")):
        (tmp_path / f"{name}.json").write_text(json.dumps({**good, **edit}))
        with pytest.raises(ConfigError, match="is not a depth predictor") as raised:
            DepthPredictor.load(tmp_path / f"{name}.json")
        assert said in str(raised.value), name


def test_only_whole_trees_are_logged(monkeypatch):
    """A tree cut to the target's last positions (fewer levels than asked) was logged as a tree of the asked
    depth: its accepted depth, capped by its cut, taught the predictor to expect less."""
    import speculant.trees.decoder as decoder

    target = tiny_model("llama", 3, 64, init_std=0.1)
    drafter = perturbed(target, 0.1, 3)
    target.max_positions = 40
    verified, verify = [], decoder.verify_step

    def counted(target, last, draft, *rest):
        verified.append(len(draft.tree) - 1)
        return verify(target, last, draft, *rest)

    monkeypatch.setattr(decoder, "verify_step", counted)
    samples = log_trees(target, drafter, [random_prompt(0, 64, 27)], 100, 4, 2)
    assert min(verified) < 8 and len(samples) == verified.count(8) > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", *MORE_ARCHS[:1]])
def test_trees_of_the_predicted_depth_equal_ar(arch, device, tmp_path, monkeypatch):
    target = tiny_model(arch, 3, 64, init_std=0.1, device=device)
    drafter = perturbed(target, 0.1, 3)
    prompts = [random_prompt(seed, 64, 6) * 2 for seed in range(6)]
    assert len(log_trees(target, drafter, prompts[:2], 24, 5, 2)) >= 4  # trees of width 2 log too
    samples = log_trees(target, drafter, prompts, 24, 5, 1)
    assert samples and all(0 <= a <= 5 and len(x.features) == 4 and x.hidden.shape == (32,) for x, a in samples)
    for kind in ("features", "hidden"):  # (the transformers backend gives hidden states too)
        predictor, _ = fit(samples, 5, kind)
        predictor.save(tmp_path / f"{kind}.json")
        predicted_trees_equal_ar(target, drafter, prompts[:3], tmp_path / f"{kind}.json", 5, (1, 2), monkeypatch)


def predicted_trees_equal_ar(target, drafter, prompts, predictor, depth, widths, monkeypatch, tokens=30):
    """Trees drafted to the depths `predictor` (a JSON file) chooses give `ar`'s output, and it chose them."""
    chosen = []
    monkeypatch.setattr(DepthPredictor, "depth", lambda self, *args, real=DepthPredictor.depth:
                        chosen.append(real(self, *args)) or chosen[-1])
    for prompt in prompts:
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=tokens).token_ids
        for width in widths:
            result = generate(target, prompt_ids=prompt, drafter=drafter, method="tree", depth=depth, width=width,
                              depth_predictor=str(predictor), max_new_tokens=tokens)
            assert result.token_ids == expected
    assert chosen and all(1 <= d <= depth for d in chosen)


def test_train_depth_writes_the_predictor_and_refuses_bad_input(tmp_path, capsys):
    from helpers import BYTE_VOCAB, byte_tokenizer

    model = tiny_model("llama", 4, BYTE_VOCAB, init_std=0.1, tokenizer=byte_tokenizer())
    model.model.save_pretrained(tmp_path / "m")
    model.tokenizer.save_pretrained(tmp_path / "m")
    out, weights = tmp_path / "depth.json", str(tmp_path / "m")
    assert cli.main(["train-depth", "--target", weights, "--drafter", weights, "--dataset", "humaneval[:4]",
                     "--max-new-tokens", "12", "--max-depth", "3", "--out", str(out)]) == 0
    assert "trees logged" in capsys.readouterr().out and DepthPredictor.load(out).max_depth == 3
    assert cli.main(["train-depth", "--target", weights, "--drafter", "maxgram", "--out", str(out)]) == 2
    assert "needs a model drafter" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):  # (a flag's own type: argparse's usage error)
        cli.main(["train-depth", "--target", weights, "--width", "0"])
    assert "argument --width: must be >= 1" in capsys.readouterr().err
    assert cli.main(["train-depth", "--target", weights, "--drafter", weights, "--width", "1000",
                     "--out", str(out)]) == 2  # (a traceback from topk, after the models loaded; now before)
    assert "--width 1000: at most 64" in capsys.readouterr().err
    (tmp_path / "long.jsonl").write_text('{"id": "long", "prompt": "%s"}\n' % ("x" * 600))  # (600 bytes: 600 ids)
    assert cli.main(["train-depth", "--target", weights, "--drafter", weights, "--prompts",
                     str(tmp_path / "long.jsonl"), "--out", str(out)]) == 2
    assert "prompt long: the prompt has 600 tokens but" in capsys.readouterr().err


@pytest.mark.parametrize("variant", ["qwen2", "llama", "llama-window"])
def test_trees_of_the_hidden_state_predicted_depth_equal_ar_on_lean(variant, tmp_path, monkeypatch):
    """On the lean backend (hidden states given), trees log the target's last hidden state at each tree's root; a
    hidden-state predictor trained on them drafts trees whose output equals `ar`, on three architectures, one
    windowed; `auto` picks it over a features predictor where both exist."""
    from helpers import BYTE_VOCAB, byte_tokenizer
    from tiny_gguf import write_tiny_gguf

    from speculant.models import load_model
    from speculant.trees.depth import predictor_path
    from speculant.methods import get_method
    from speculant.trees.method import depth_predictor

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    arch, window = {"qwen2": ("qwen2", None), "llama": ("llama", None), "llama-window": ("llama", 6)}[variant]
    paths = [tmp_path / f"{seed}.gguf" for seed in (0, 7)]
    for seed, path in zip((0, 7), paths):
        write_tiny_gguf(path, arch, seed, "k", hidden=256, window=window)
    target, drafter = (load_model(str(path), backend="lean", tokenizer=byte_tokenizer()) for path in paths)
    assert target.capabilities.hidden_states
    prompts = [random_prompt(seed, BYTE_VOCAB - 1, 8) for seed in range(6)]
    samples = log_trees(target, drafter, prompts, 24, 4, 1)
    assert samples and all(x.hidden is not None and x.hidden.shape == (256,) for x, _ in samples)
    predictor, _ = fit(samples, 4, "hidden")
    predictor.save(tmp_path / "hidden.json")
    predicted_trees_equal_ar(target, drafter, prompts[:3], tmp_path / "hidden.json", 4, (2,), monkeypatch, 24)
    read = get_method("tree").make_options({"drafter": "self", "depth_predictor": str(tmp_path / "hidden.json")})
    session = Session(target)
    assert depth_predictor(read.depth_predictor, target, drafter, session).inputs == "hidden"  # (options read it)
    for kind in ("features", "hidden"):
        fit(samples, 4, kind)[0].save(predictor_path(target, drafter, kind))
    found = depth_predictor("auto", target, drafter, session)
    assert found.inputs == "hidden"
    # read once per version of its file (a server's every tree request had read it again)
    assert depth_predictor("auto", target, drafter, session) is found
    retrained = fit(samples, 4, "hidden")[0]
    path = predictor_path(target, drafter, "hidden")
    retrained.save(path)
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    assert depth_predictor("auto", target, drafter, session) is not found


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_trees_of_the_hidden_state_predicted_depth_equal_ar_on_static(arch, tmp_path, monkeypatch):
    """The static backend gives hidden states too (its step returns the last layer's rows beside the logits, solo
    and batched alike): trees log them, and a hidden-state predictor trained on them drafts trees equal to `ar`;
    Mistral's window shorter than the generation."""
    from helpers import tiny_transformer
    from speculant.models.backends.static import StaticCausalLM, StaticWeights

    def static(seed: int, noise: float = 0.0) -> StaticCausalLM:
        model = tiny_transformer(arch, seed, vocab=64, init_std=0.1, window=6)
        if noise:
            generator = torch.Generator().manual_seed(seed + 1)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn(parameter.shape, generator=generator) * noise * parameter.std())
        return StaticCausalLM(StaticWeights(model), name=f"tiny-{seed}", span=96, width=4)

    target, drafter = static(3), static(3, noise=0.2)
    assert target.capabilities.hidden_states
    prompts = [random_prompt(seed, 64, 6) * 2 for seed in range(6)]
    samples = log_trees(target, drafter, prompts, 24, 4, 1)
    assert samples and all(x.hidden is not None and x.hidden.shape == (32,) for x, _ in samples)
    predictor, _ = fit(samples, 4, "hidden")
    predictor.save(tmp_path / "hidden.json")
    predicted_trees_equal_ar(target, drafter, prompts[:3], tmp_path / "hidden.json", 4, (2,), monkeypatch, 24)


def test_a_hidden_state_predictor_is_refused_for_a_target_without_hidden_states(tmp_path):
    """The options read the predictor and say what it needs of the target (`target_needs`): `generate` refuses a
    target whose backend gives no hidden states, naming the option, before it drafts."""
    from helpers import MarkovLM

    from speculant.errors import OptionError

    DepthPredictor(4, "hidden", 16).save(tmp_path / "hidden.json")
    target = MarkovLM(12, 0)
    assert not target.capabilities.hidden_states
    with pytest.raises(OptionError, match="reads the target's hidden states") as refused:
        generate(target, prompt_ids=[1, 2], method="tree", drafter="self", depth_predictor=str(tmp_path / "hidden.json"),
                 max_new_tokens=4)
    assert refused.value.option == "depth_predictor"


def test_a_hidden_state_predictor_for_another_hidden_size_is_refused_before_any_token(tmp_path):
    """A predictor file made for another target (its hidden states another size) is an error naming the option,
    raised before the first token (it failed inside the predictor a few tokens into the reply)."""
    from speculant.errors import OptionError

    DepthPredictor(4, "hidden", 16).save(tmp_path / "hidden.json")
    target = tiny_model("llama", 0, 64)
    assert target.capabilities.hidden_states
    tokens = []
    with pytest.raises(OptionError, match="hidden states of 16 numbers") as refused:
        for token in generate(target, prompt_ids=random_prompt(0, 64), method="tree", drafter="self", depth=3,
                              depth_predictor=str(tmp_path / "hidden.json"), max_new_tokens=8, stream=True):
            tokens.append(token)
    assert refused.value.option == "depth_predictor" and not tokens
