"""Log-probabilities of committed tokens (`logprobs=n`, `models.wrappers.logprobs`): read off the target's
own forwards, they are the target's distribution at each emitted position, the same with every method."""

import pytest
import torch
from helpers import ARCHS, every_method, perturbed, tiny_model

from speculant import generate
from speculant.errors import ConfigError


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_decoding_s_logprobs_are_the_target_s_distribution_at_each_position(arch):
    """Greedy and sampled: each token's log-probability under the target before temperature, and the likeliest three
    (sampled, tokens other than the likeliest have theirs)."""
    target = tiny_model(arch, 0, 64, init_std=0.2)
    prompt = [3, 14, 15, 9, 26]
    greedy = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=12, logprobs=3)
    sampled = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=12, logprobs=3, temperature=1.5, seed=3)
    assert any(e.top[0][0] != e.token for e in sampled.logprobs)
    for result in (greedy, sampled):
        assert [e.token for e in result.logprobs] == result.token_ids
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + result.token_ids])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # row i: the distribution of token i
        for i, entry in enumerate(result.logprobs):
            assert entry.logprob == pytest.approx(float(expected[i, entry.token]), abs=1e-4)
            top_ids = [t for t, _ in entry.top]
            assert len(top_ids) == 3 and (result is sampled or top_ids[0] == entry.token)  # greedy: the likeliest
            assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
            assert torch.topk(expected[i], 3).indices.tolist() == top_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_every_method_gives_ar_s_logprobs(arch, monkeypatch):
    from helpers import costs, invent

    target = tiny_model(arch, 1, 64, init_std=0.2)
    other = perturbed(target, 0.05, 2)
    prompt = [5, 6, 7, 8] * 3  # (repeated: what Max-Gram and suffix decoding draft from)
    invent(monkeypatch, costs(target))  # (a flat verification and cheap drafters: auto speculates)
    plain = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=20, logprobs=2)
    for label, options in every_method(other).items():
        result = generate(target, prompt_ids=prompt, max_new_tokens=20, logprobs=2, **options)
        assert result.token_ids == plain.token_ids, label
        assert result.logprobs == plain.logprobs, label  # verification rows are row-invariant: the same bits
        assert sum(result.stats.accepted_lengths) > 0, label  # (rows of accepted drafts compared)


def test_a_stream_s_logprobs_grow_with_its_tokens_and_plain_runs_have_none():
    target = tiny_model("llama", 0, 64, init_std=0.2)
    stream = generate(target, prompt_ids=[1, 2, 3], method="sd", drafter="maxgram", max_new_tokens=8, logprobs=0,
                      stream=True)
    for n, _ in enumerate(stream, 1):
        assert len(stream.logprobs) == n and stream.logprobs[-1].top == ()
    assert stream.result.logprobs == stream.logprobs
    assert generate(target, prompt_ids=[1, 2, 3], method="ar", max_new_tokens=4).logprobs is None
    small = tiny_model("llama", 0, 16)  # more alternatives asked for than the vocabulary holds: all of it (topk raised)
    assert all(len(entry.top) == 16 for entry in generate(small, prompt_ids=[1, 2, 3], method="ar", max_new_tokens=3,
                                                          logprobs=20).logprobs)


@pytest.mark.parametrize("count", [-1, 21, 2.5, True])
def test_a_bad_count_is_refused_before_the_model_loads(count):
    with pytest.raises(ConfigError, match="logprobs must be an integer in"):
        generate("no-such/model", "hi", method="ar", logprobs=count)


def test_dsi_refuses_logprobs():
    with pytest.raises(ConfigError, match="not available with dsi"):
        generate("no-such/model", "hi", method="dsi", drafter="maxgram", logprobs=1)
