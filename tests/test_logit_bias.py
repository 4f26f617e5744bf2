"""`logit_bias` (`models.wrappers.biased`): added to the target's logits, which verify, so every method equals `ar`
on the same biased target token for token."""

import pytest
from helpers import ARCHS, DRAFTS_ACCEPTED, costs, every_method, invent, perturbed, tiny_model

from speculant import generate
from speculant.errors import ConfigError


@pytest.mark.parametrize("arch", ARCHS)
def test_every_method_equals_biased_ar_and_a_banned_token_never_comes(arch, monkeypatch):
    target = tiny_model(arch, 3, 64, init_std=0.2)
    other = perturbed(target, 0.05, 4)
    prompt = [9, 8, 7, 6]
    plain = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=20).token_ids
    banned = max(set(plain), key=plain.count)  # the token plain decoding emits most
    bias = {banned: -100, (banned + 1) % 64: 2.5}
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=20, logit_bias=bias).token_ids
    assert banned not in expected and expected != plain
    invent(monkeypatch, costs(target))  # (auto speculates)
    for label, options in every_method(other).items():
        result = generate(target, prompt_ids=prompt, max_new_tokens=20, logit_bias=bias, **options)
        assert result.token_ids == expected, label
        assert label not in DRAFTS_ACCEPTED or sum(result.stats.accepted_lengths) > 0, label


@pytest.mark.parametrize("bias,message", [({64: 1.0}, "token ids must lie"), ({-1: 1.0}, "token ids must lie"),
                                          ({3: 101}, "values must lie"), ({3: "x"}, "values must be numbers")])
def test_bad_biases_are_refused(bias, message):
    with pytest.raises(ConfigError, match=message):
        generate(tiny_model("llama", 0, 64), prompt_ids=[1, 2], method="ar", max_new_tokens=2, logit_bias=bias)
