"""sampling.py and end-to-end speculative sampling against the target distribution."""

import itertools
import math

import pytest
import torch

from helpers import DEVICES, MarkovLM, random_prompt, tiny_model, total_variation
from speculant import generate
from speculant.config import SamplingConfig
from speculant.errors import ConfigError
from speculant.sampling import SAMPLE_BLOCK, logits_to_probs, next_token, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def test_temperature_zero_is_argmax_one_hot():
    probs = logits_to_probs(LOGITS, SamplingConfig(0.0))
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert next_token(LOGITS, SamplingConfig(0.0), None) == 0


def test_temperature_scales_softmax():
    torch.testing.assert_close(logits_to_probs(LOGITS, SamplingConfig(2.0)), torch.softmax(LOGITS / 2, -1))


def test_top_k_keeps_k_most_likely():
    probs = logits_to_probs(LOGITS, SamplingConfig(1.0, top_k=2))
    expected = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    torch.testing.assert_close(probs, torch.cat([expected, torch.zeros(3)]))


def test_top_p_keeps_smallest_nucleus():
    full = torch.softmax(LOGITS, -1)  # [0.55, 0.20, 0.12, 0.07, 0.03] roughly
    probs = logits_to_probs(LOGITS, SamplingConfig(1.0, top_p=0.7))
    torch.testing.assert_close(probs, torch.cat([full[:2] / full[:2].sum(), torch.zeros(3)]))
    # The most likely token survives even a tiny top-p.
    for top_p in (0.01, 1e-300):  # (1e-300: float32 rounds it to 0, below any mass)
        assert logits_to_probs(LOGITS, SamplingConfig(1.0, top_p=top_p)).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_sampling_uses_the_generator():
    config = SamplingConfig(1.0)
    draws = [[next_token(LOGITS, config, torch.Generator().manual_seed(s)) for _ in range(1)] for s in range(20)]
    again = [[next_token(LOGITS, config, torch.Generator().manual_seed(s)) for _ in range(1)] for s in range(20)]
    assert draws == again and len({d[0] for d in draws}) > 1


@pytest.mark.parametrize("vocab", [100, 2 * SAMPLE_BLOCK, 3 * SAMPLE_BLOCK + 100])
def test_a_draw_inverts_the_cdf_at_the_generator_s_uniform_over_blocks_and_their_tail(vocab):
    """`sample` within one partial block, over whole blocks, and over whole blocks and a partial one, a third of the
    tokens without mass, the total not 1: the token the one-level inversion of the fp64 CDF gives at the same
    uniform draw, never a token of mass 0."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(vocab, generator=gen) * (torch.rand(vocab, generator=gen) > 0.3) * 3
    probs[-40:] = 0.0  # the last tokens have no mass
    cdf = probs.double().cumsum(0)
    blocks = set()
    for _ in range(300):
        u = torch.rand(1, generator=torch.Generator().set_state(gen.get_state()), dtype=torch.float64) * cdf[-1]
        token = sample(probs, gen)
        assert token == int(torch.searchsorted(cdf, u, right=True)) and probs[token] > 0
        blocks.add(token // SAMPLE_BLOCK)
    assert blocks == set(range(-(-vocab // SAMPLE_BLOCK)))


@pytest.mark.parametrize(("kwargs", "why"), [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0, got -0.1"),
    (dict(temperature=math.nan), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=math.inf), "temperature must be a finite number >= 0, got inf"),
    (dict(temperature=1e-300), "temperature must be 0 .greedy. or at least 0.001"),
    (dict(top_p=0.0), "top_p must lie in .0, 1., got 0.0"), (dict(top_p=1.5), "top_p must lie in .0, 1., got 1.5"),
    (dict(top_k=0), "top_k must be >= 1, got 0")])
def test_bad_sampling_values_are_refused(kwargs, why):
    with pytest.raises(ConfigError, match=why):
        SamplingConfig(**kwargs)


VOCAB = 12
TEMPERATURE = 0.7


def exact_marginals(target, prompt, n=3, config=SamplingConfig(TEMPERATURE)):
    """Exact target distributions under `config` of each of the first n tokens (marginally), [n, V],
    by enumerating every prefix (V^(n-1) of them on a 12-token vocabulary)."""
    marginals = torch.zeros(n, VOCAB)
    prefixes = {(): 1.0}
    for i in range(n):
        grown = {}
        for prefix, weight in prefixes.items():
            if prefix:
                target.prefill(prompt)
                logits = target.forward(list(prefix))[-1]
            else:
                logits = target.prefill(prompt)
            probs = logits_to_probs(logits, config)
            marginals[i] += weight * probs.cpu()
            if i < n - 1:
                grown.update({prefix + (t,): weight * float(probs[t]) for t in range(VOCAB)})
        prefixes = grown
    return marginals


def empirical_marginals(target, prompt, draws, n=3, config=SamplingConfig(TEMPERATURE), **kwargs):
    """Distributions of the first n emitted tokens over `draws` seeded generations. Generations run
    longer than n so that tokens 2..n come from verified drafts, not from a draft cut to nothing."""
    counts = torch.zeros(n, VOCAB)
    for seed in range(draws):
        stream = generate(target, prompt_ids=prompt, max_new_tokens=n + 4, temperature=config.temperature,
                          top_k=config.top_k, top_p=config.top_p, seed=seed, stream=True, **kwargs)
        tokens = list(itertools.islice(stream, n))  # the rest of the generation is not drawn
        for i in range(n):
            counts[i, tokens[i]] += 1
    return counts / draws


def sampling_pair(seed: int = 21, device: str = "cpu", drafter_device: str | None = None, near: bool = False):
    """A target and a very different drafter (a very different q; `near`: the target's logits with a little noise)
    on the 12-token vocabulary, and a prompt: Markov models, so that thousands of generations take seconds (the
    transformers backends' own sampling runs in `test_autoregressive_sampling_matches_target_distribution`, the
    cross-vocabulary and constrained tests)."""
    target = MarkovLM(VOCAB, seed, device=device)
    noise = torch.randn(target.table.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    drafter = MarkovLM(VOCAB, seed + 1, device=drafter_device or device,
                       table=(target.table + 0.3 * noise).to(drafter_device or device) if near else None)
    return target, drafter, random_prompt(seed, VOCAB, 6)


def assert_follows_target(target, prompt, config=SamplingConfig(TEMPERATURE), n=3, **kwargs):
    """The first `n` emitted tokens of 1500 seeded generations (`generate` under `config`, with `kwargs`) follow
    the target's exact marginals: TV < 0.07, where sampling noise is about 0.03. A speculative method's drafts are
    accepted in some of them (one that drew every token from the target alone would follow it too)."""
    exact = exact_marginals(target, prompt, n, config=config)
    got = empirical_marginals(target, prompt, 1500, n, config=config, **kwargs)
    for i in range(n):
        assert total_variation(got[i], exact[i]) < 0.07, f"token {i + 1}"
    if kwargs.get("method") != "ar":
        accepted = sum(sum(generate(target, prompt_ids=prompt, max_new_tokens=7, temperature=config.temperature,
                                    top_k=config.top_k, top_p=config.top_p, seed=seed, **kwargs).stats.accepted_lengths)
                       for seed in range(20))
        assert accepted > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k, verifier, near", [(1, "block", False), (3, "block", False), (3, "token", False),
                                               (2, "block", True), (2, "token", True)])
def test_speculative_sampling_matches_target_distribution_end_to_end(k, verifier, near, device):
    """A very different drafter (a sampler ignoring p would fail; its drafts are never accepted whole) and a near
    one (its drafts of two are often accepted whole: the third token checked is then the one after them)."""
    target, drafter, prompt = sampling_pair(device=device, near=near)
    q1 = logits_to_probs(drafter.prefill(prompt), SamplingConfig(TEMPERATURE)).cpu()
    distance = total_variation(exact_marginals(target, prompt, n=1)[0], q1)
    assert distance < 0.2 if near else distance > 0.3
    assert_follows_target(target, prompt, drafter=drafter, k=k, verifier=verifier)


@pytest.mark.parametrize("config", [SamplingConfig(0.3), SamplingConfig(1.0, top_k=5), SamplingConfig(1.0, top_p=0.8)])
@pytest.mark.parametrize("method", [dict(k=3), dict(method="tree", depth=3, width=2)])
def test_block_and_tree_verification_follow_the_target_at_any_temperature_top_k_and_top_p(config, method):
    """Sampled chains verified as blocks and trees verified by multi-draft sampling, under temperatures, top-k and
    top-p: the target's (filtered) distribution."""
    target, drafter, prompt = sampling_pair()
    assert_follows_target(target, prompt, config, drafter=drafter, **method)


def test_speculative_sampling_with_early_ending_drafts_matches_target_distribution():
    target, drafter, prompt = sampling_pair()
    assert_follows_target(target, prompt, drafter=drafter, k=3, draft_confidence=0.3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_speculative_sampling_with_the_drafter_on_another_device():
    target, drafter, prompt = sampling_pair(device="cuda", drafter_device="cpu")
    assert_follows_target(target, prompt, drafter=drafter, k=3)


def test_autoregressive_sampling_matches_target_distribution():
    target = tiny_model("qwen2", 23, VOCAB, init_std=0.5)
    assert_follows_target(target, random_prompt(23, VOCAB, 6), method="ar")
