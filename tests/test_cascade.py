"""Cascade speculative drafting: every cascade shape reproduces autoregressive decoding (fp32 tiny
models), sampling keeps the target distribution, and the K matrix is parsed and checked."""

import pytest
import torch

from helpers import ARCHS, DEVICES, MarkovLM, perturbed, random_prompt, tiny_model, total_variation
from speculant import generate
from speculant.config import SamplingConfig
from speculant.drafters.base import Draft, Drafter
from speculant.drafters.cascade import CascadeDrafter, default_k_matrix, parse_k_matrix
from speculant.drafters.maxgram import MaxGramDrafter, bigram_table
from speculant.drafters.model import ModelDrafter
from speculant.errors import ConfigError, OptionError
from speculant.methods import get_method
from speculant.models.wrappers.metered import Usage
from speculant.trees.tree import TokenTree
from test_sampling import VOCAB as SMALL_VOCAB, assert_follows_target

VOCAB = 64
MAX_NEW = 40

# (shape, K matrices to try: None is the default), built from a big drafter, a small one and Max-Gram.
SHAPES = {
    "maxgram": (["maxgram"], [None, "5"]),
    "model": (["big"], [None, "1", "3"]),
    "model+maxgram": (["big", "maxgram"], [None, "3,0;4", "1,3;2", "2,2;0,0"]),
    "big+small+maxgram": (["big", "small", "maxgram"], [None, "2,1,1;2,1;3", "3,0,0;0,2,0;0,0,4", "1,2,0;1,2;1"]),
}


def levels_for(names, target, seed, prompt):
    sources = {"big": perturbed(target, 0.2, seed), "small": perturbed(target, 0.5, seed + 1),
               "maxgram": MaxGramDrafter(bigram_table([prompt], VOCAB))}
    return [sources[name] for name in names]


# A leniency per cascade of several levels at which its lenient reviews keep drafts an exact review would not (with
# Max-Gram reviewed, whose q is 1, where p > 1 / leniency: these peaked models ask much of it).
LENIENT = {"model+maxgram": 30.0, "big+small+maxgram": 3.0}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("shape", "leniency"), [(shape, 1.0) for shape in SHAPES] + list(LENIENT.items()))
def test_greedy_cascades_match_autoregressive(arch, shape, leniency, device, monkeypatch):
    """The output is ar's at any leniency (only inner reviews are lenient), and a lenient review keeps drafts an
    exact one would not (a leniency that were ignored would pass the first check alone)."""
    from speculant.drafters import cascade
    from speculant.verify import verify_greedy

    kept = []  # per inner review: (tokens it kept, tokens an exact review keeps)

    def review(draft, logits, leniency=1.0, draft_probs=None):
        n, token = verify_greedy(draft, logits, leniency, draft_probs)
        kept.append((n, verify_greedy(draft, logits)[0]))
        return n, token
    monkeypatch.setattr(cascade, "verify_greedy", review)
    names, matrices = SHAPES[shape]
    accepted = 0
    for seed in range(3):
        target = tiny_model(arch, seed, VOCAB, init_std=0.1, device=device)  # peaked enough for leniency to matter
        prompt = random_prompt(seed, VOCAB, 12)
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=MAX_NEW).token_ids
        for k_matrix in matrices:
            result = generate(target, prompt_ids=prompt, method="cascade", drafters=levels_for(names, target, seed, prompt),
                              k_matrix=k_matrix, leniency=leniency, max_new_tokens=MAX_NEW)
            assert result.token_ids == expected, f"seed {seed}, K {k_matrix}"
            assert result.stats.method == "cascade"
            accepted += sum(result.stats.accepted_lengths)
    assert accepted > 0
    assert any(n > exact for n, exact in kept) == (leniency > 1), kept


def test_cascade_reports_forwards_per_level_and_swi():
    target = tiny_model("llama", 0, VOCAB, init_std=0.1)
    prompt = random_prompt(0, VOCAB, 12)
    big, small = perturbed(target, 0.2, 0), perturbed(target, 0.5, 1)
    small.name = "small"
    stats = generate(target, prompt_ids=prompt, method="cascade", drafters=[big, small, "maxgram"],
                     k_matrix="2,1,1;2,1;3", max_new_tokens=MAX_NEW).stats
    assert set(stats.drafter_forwards) == {big.name, "small"}
    assert stats.drafter_steps[big.name] > 0 and stats.drafter_seconds[big.name] > 0
    assert set(stats.cost_ratios) == {big.name, "small"}
    expected = stats.new_tokens / (stats.target_forwards + sum(
        stats.drafter_forwards[name] * stats.cost_ratios[name] for name in stats.drafter_forwards))
    assert stats.swi == pytest.approx(expected)


def test_a_user_s_drafter_is_a_cascade_level_with_a_lifecycle_of_its_own():
    """A drafter of a user's (here above Max-Gram, and a ModelDrafter subclass with a propose of its own) proposes
    at its level: the output is still `ar`'s, its usage is counted, and each generation begins and ends it."""
    target = tiny_model("llama", 0, VOCAB, init_std=0.1)
    prompt = random_prompt(0, VOCAB, 12)
    truth = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=MAX_NEW).token_ids
    calls = []

    class Echo(Drafter):  # the context's last tokens again (sampled: with its q, in float64)
        name = "echo"
        sampled = False

        def begin(self, prompt_ids):
            calls.append("begin")
            return Echo()

        def propose(self, context, k):
            tokens = context[-k:]
            q = torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).double() if self.sampled else None
            return Draft(tokens, q, {"echo": Usage(forwards=1)})

        def end(self, prompt_ids, output_ids):
            calls.append(("end", len(output_ids)))

    class Shorter(ModelDrafter):  # a model drafter proposing one token fewer
        def propose(self, context, k):
            return super().propose(context, max(k - 1, 1))

    shorter = Shorter(perturbed(target, 0.2, 0), SamplingConfig(), None)
    result = generate(target, prompt_ids=prompt, method="cascade", drafters=[shorter, Echo(), "maxgram"],
                      k_matrix="2,2,1;2,2;3", max_new_tokens=MAX_NEW)
    assert result.token_ids == truth
    assert calls == ["begin", ("end", MAX_NEW)]
    assert result.stats.drafter_forwards["echo"] > 0 and result.stats.drafter_forwards[shorter.model.name] > 0
    sampled = {}  # its rows stacked with the model level's (float32) and reviewed by it: its one-hot q in float64
    for Echo.sampled in (False, True):  # draws what no q (one-hot) draws, seed for seed
        sampled[Echo.sampled] = generate(target, prompt_ids=prompt, method="cascade", drafters=[shorter, Echo()],
                                         k_matrix="2,2;3", temperature=0.8, seed=0,
                                         max_new_tokens=MAX_NEW).token_ids
    assert sampled[True] == sampled[False] and len(sampled[True]) == MAX_NEW

    class Trees(Drafter):
        def propose(self, context, k):
            return Draft([], tree=TokenTree((context[-1], 7), (-1, 0)), path_probs=[1.0, 1.0])

    with pytest.raises(ConfigError, match="proposes token trees"):
        generate(target, prompt_ids=prompt, method="cascade", drafters=[Trees()], max_new_tokens=4)


def test_vertical_cascade_drafts_with_reviews_not_autoregression():
    """[model, maxgram] with K = [[4, 0], [0, 3]]: the model reviews 3-token Max-Gram drafts instead of
    generating, so when the bottom level proposes what the model would, 4 tokens cost one review."""
    target = tiny_model("qwen2", 3, VOCAB, init_std=0.1)
    prompt = random_prompt(3, VOCAB, 6)
    truth = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=8).token_ids

    class Oracle(MaxGramDrafter):  # proposes the target's own continuation
        def propose(self, context, k):
            done = len(context) - len(prompt)
            return Draft(truth[done : done + k])

    drafter = ModelDrafter(target.share(), SamplingConfig(), None)  # reviews exactly like the target
    cascade = CascadeDrafter([drafter, Oracle()], [[4, 0], [0, 3]], 1.0, SamplingConfig(), None)
    draft = cascade.propose(prompt, 4)
    assert draft.tokens == truth[:4]
    assert draft.usage[target.name].forwards == 2  # the first review prefills the prompt, then one forward
    assert draft.usage[target.name].steps == 1
    assert cascade.propose(prompt + truth[:4], 4).tokens == truth[4:8]


def test_k_matrix_parsing_and_checks():
    assert parse_k_matrix("4,2;6", 2) == [[4, 2], [0, 6]]
    assert parse_k_matrix("4,2;0,6", 2) == [[4, 2], [0, 6]]
    assert parse_k_matrix("3", 1) == [[3]]
    assert default_k_matrix([MaxGramDrafter()], 5) == [[5]]
    options = get_method("cascade").make_options  # (a list's rows may be short as the text's: they were refused)
    assert options({"drafters": ["self", "maxgram"], "k_matrix": [[3, 1], [2]]}).k_matrix == [[3, 1], [0, 2]]
    for text, levels in [("4,x", 1), ("4;2", 1), ("1,2,3;4", 2)]:
        with pytest.raises(ConfigError):
            CascadeDrafter([MaxGramDrafter()] * levels, parse_k_matrix(text, levels), 1.0, SamplingConfig(), None)
    target = tiny_model("llama", 0, VOCAB)
    model = ModelDrafter(target.share(), SamplingConfig(), None)
    with pytest.raises(ConfigError, match="upper triangular"):
        CascadeDrafter([model, MaxGramDrafter()], [[1, 1], [1, 1]], 1.0, SamplingConfig(), None)
    with pytest.raises(ConfigError, match="last"):
        CascadeDrafter([MaxGramDrafter(), model], [[1, 1], [0, 1]], 1.0, SamplingConfig(), None)
    with pytest.raises(ConfigError, match="leniency"):
        generate(target, prompt_ids=[1, 2], method="cascade", drafters=["maxgram"], leniency=0.5)
    with pytest.raises(ConfigError, match="option 'leniency' does not apply to method 'sd' \\(it belongs to cascade"):
        generate(target, prompt_ids=[1, 2], method="sd", drafter="maxgram", leniency=2)
    with pytest.raises(ConfigError, match="needs option 'drafters'"):
        generate(target, prompt_ids=[1, 2], method="cascade")


def test_a_k_matrix_refused_while_parsed_names_its_option():
    for text in ("4,x", "4,2", "4;2;1", "2.5,1;1"):
        with pytest.raises(OptionError, match="K matrix") as refused:
            generate(MarkovLM(8, 0), prompt_ids=[1, 2, 3], method="cascade", drafters=[MarkovLM(8, 1), "maxgram"],
                     k_matrix=text, max_new_tokens=4)
        assert refused.value.option == "k_matrix", text


def test_a_leniency_where_no_level_reviews_another_is_refused():
    """Leniency relaxes a model level's review of the levels below it: one level, Max-Gram alone, or a user's drafter
    or one of another tokenizer above Max-Gram (they propose, as Max-Gram does) review nothing, and a leniency
    there would be ignored."""

    class Echo(Drafter):
        def propose(self, context, k):
            return Draft(context[-k:])

    target = MarkovLM(8, 0)
    for drafters in (["maxgram"], [MarkovLM(8, 1)], [Echo(), "maxgram"]):
        with pytest.raises(OptionError, match="no level of this cascade reviews another") as refused:
            generate(target, prompt_ids=[1, 2, 3], method="cascade", drafters=drafters, leniency=2, max_new_tokens=4)
        assert refused.value.option == "leniency"
    assert generate(target, prompt_ids=[1, 2, 3], method="cascade", drafters=[MarkovLM(8, 1), "maxgram"], leniency=2,
                    max_new_tokens=4).token_ids == generate(target, prompt_ids=[1, 2, 3], method="ar",
                                                            max_new_tokens=4).token_ids


def test_a_cascade_drafts_no_further_than_an_end_of_sequence_token():
    """Nothing after the target's end-of-sequence token could be committed: a level whose draft ended there is not
    asked again, and a review that reads it emits nothing after it."""
    model = MarkovLM(16, 3)
    context = [1, 2, 3]
    continuation = ModelDrafter(model.share(), SamplingConfig(), None).propose(context, 6).tokens
    eos = frozenset({continuation[1]})
    assert continuation[0] not in eos and len(continuation) == 6
    stopping = model.share()
    stopping.eos_token_ids = eos  # its own drafts end there
    drafter = ModelDrafter(stopping, SamplingConfig(), None)
    draft = CascadeDrafter([drafter], [[6]], 1.0, SamplingConfig(), None, eos).propose(context, 6)
    assert draft.tokens == continuation[:2] and draft.usage[model.name].forwards == 2  # (its prefill, one forward)

    class Oracle(Drafter):  # the reviewer's own continuation
        def propose(self, context, k):
            return Draft(continuation[len(context) - 3:][:k])

    reviewer = ModelDrafter(model.share(), SamplingConfig(), None)
    for k_matrix in ([[4, 0], [0, 3]], [[1, 3], [0, 0]]):  # a review of the draft below; a horizontal tail
        cascade = CascadeDrafter([reviewer, Oracle()], k_matrix, 1.0, SamplingConfig(), None, eos)
        assert cascade.propose(context, 4).tokens == continuation[:2], k_matrix


def test_levels_on_one_loaded_drafter_count_its_forwards_once():
    """Two levels of one drafter share its meter: its forwards are counted as it ran them, not once per level."""
    drafter = ModelDrafter(MarkovLM(16, 3), SamplingConfig(), None)
    cascade = CascadeDrafter([drafter, drafter], [[2, 0], [0, 3]], 1.0, SamplingConfig(), None)
    before = drafter.model.usage
    draft = cascade.propose([1, 2, 3], 4)
    ran = drafter.model.usage - before
    assert ran.forwards > 0 and (draft.usage[drafter.name].forwards, draft.usage[drafter.name].steps) == \
        (ran.forwards, ran.steps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("k_matrix", "leniency"), [("2,1;2", 1.0), ("1,2;3", 4.0)])
def test_cascade_sampling_matches_target_distribution(k_matrix, leniency, device):
    """[model, maxgram] with lenient inner reviews: the output still follows the target exactly. Tiny transformers,
    not sampling_pair's Markov models: on those, handing the target the reviewer's p passes too."""
    target, drafter, prompt = (tiny_model("llama", 21, SMALL_VOCAB, init_std=0.5, device=device),
                               tiny_model("llama", 22, SMALL_VOCAB, init_std=0.5, device=device),
                               random_prompt(21, SMALL_VOCAB, 6))
    # A bigram chain over the whole vocabulary: Max-Gram always proposes, so every inner review is
    # lenient. Handing the target the reviewer's p instead of the lenient distribution fails here (TV ~0.13).
    levels = [drafter, MaxGramDrafter(bigram_table([list(range(SMALL_VOCAB)) + [0]], SMALL_VOCAB))]
    assert_follows_target(target, prompt, method="cascade", drafters=levels, k_matrix=k_matrix, leniency=leniency)


def test_a_reviewer_reviews_no_further_than_its_own_positions():
    """A drafter of 48 positions under a 40-token prompt: a review cuts the draft below it to the positions left,
    as the drafter's own proposals stop there, and the output is ar's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from speculant.models import HFCausalLM

    target = tiny_model("llama", 0, VOCAB, init_std=0.5)
    torch.manual_seed(1)
    short = HFCausalLM(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=48,
                                                  eos_token_id=None, bos_token_id=None)).eval(), None, name="gpt2-48")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 5  # (Max-Gram matches)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=20).token_ids
    assert generate(target, prompt_ids=prompt, method="cascade", drafters=[short, "maxgram"],
                    max_new_tokens=20).token_ids == expected


def test_a_model_drafter_drafts_what_its_positions_allow_and_runs_none_past_them():
    """m tokens after L take L + m - 1 positions (the last one drafted is never run): a drafter of 20 positions
    drafts min(k, 21 - L) tokens after L, its cache never past its positions, and sd and a cascade on it near its
    limit give ar's output, sampled ones run."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from speculant.models import HFCausalLM

    torch.manual_seed(1)
    short = HFCausalLM(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=20,
                                                  eos_token_id=None, bos_token_id=None)).eval(), None, name="gpt2-20")
    drafter = ModelDrafter(short, SamplingConfig(), None)
    cascade = CascadeDrafter([drafter, MaxGramDrafter()], [[3, 2], [0, 1]], 1.0, SamplingConfig(), None)
    for length in range(15, 23):
        assert len(drafter.propose(list(range(length)), 4).tokens) == max(0, min(4, 21 - length)), length
        assert drafter.most(list(range(length))) == max(0, 21 - length)
        assert short.cache_len <= short.max_positions == 20
        assert cascade.most(list(range(length))) is None  # (Max-Gram's part of it knows no bound)
    assert CascadeDrafter([drafter, MaxGramDrafter()], [[3, 0], [0, 1]], 1.0, SamplingConfig(), None).most(
        list(range(19))) == 2
    target = tiny_model("llama", 0, VOCAB, init_std=0.5)
    for length in (16, 18, 19, 20):
        prompt = ([1, 2, 3, 4] * 5)[:length]  # (Max-Gram matches)
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=8).token_ids
        for options in ({"method": "sd", "drafter": short, "k": 5},
                        {"method": "cascade", "drafters": [short, "maxgram"], "k_matrix": "3,2;4"}):
            assert generate(target, prompt_ids=prompt, max_new_tokens=8, **options).token_ids == expected
            assert len(generate(target, prompt_ids=prompt, max_new_tokens=8, temperature=0.9, seed=0,
                                **options).token_ids) == 8
            assert short.cache_len <= 20


def test_lenient_review_emits_the_lenient_distribution():
    """One lenient review, drawn many times, emits `lenient_distribution(p, q, l)`, which is not p:
    why the cascade hands that distribution, not the reviewer's, to the target."""
    from speculant.verify import lenient_distribution, verify_sampling

    p = torch.tensor([0.5, 0.3, 0.1, 0.1])
    q = torch.tensor([0.1, 0.1, 0.2, 0.6])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(20_000):
        draft = torch.multinomial(q, 1, generator=generator)
        n, token = verify_sampling(draft, torch.stack([p, p]), q[None], generator, leniency=3.0)
        counts[draft[0] if n else token] += 1
    expected = lenient_distribution(p, q, 3.0)
    assert total_variation(counts / counts.sum(), expected) < 0.02
    assert total_variation(expected, p) > 0.1
    assert torch.equal(lenient_distribution(p, q, 1.0), p)
