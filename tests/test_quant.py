"""Quantized drafters: close to the original layers, same CausalLM contract, lossless speculation."""

import pytest
import torch
from torch import nn

from helpers import ARCHS, random_prompt, tiny_model, tiny_transformer
from speculant import generate, load_model
from speculant.errors import ConfigError
from speculant.models import quantized_copy
from speculant.models.quant import Int4WeightOnlyLinear, Int8DynamicLinear, quantize

VOCAB = 64


@pytest.mark.parametrize(("make", "bound"), [(Int8DynamicLinear, 0.03), (lambda l: Int4WeightOnlyLinear(l, 32), 0.15)])
def test_quantized_linear_stays_close(make, bound):
    torch.manual_seed(0)
    linear = nn.Linear(256, 384)
    x = torch.randn(5, 256)
    reference = linear(x)
    error = (make(linear)(x).float() - reference).norm() / reference.norm()
    assert error < bound
    # A quantizer that dropped the scales or transposed the weight would be far off.
    assert (nn.Linear(256, 384)(x) - reference).norm() / reference.norm() > 0.5


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_model_keeps_the_causal_lm_contract(arch, quant):
    model = quantized_copy(tiny_model(arch, 0, VOCAB), quant)
    assert model.name.endswith("@" + quant)
    assert not any(isinstance(m, nn.Linear) for m in model.model.modules())
    a, c = random_prompt(1, VOCAB, 6), random_prompt(2, VOCAB, 3)
    model.prefill(a + [5, 6, 7])
    model.rollback(len(a))
    after_rollback = model.forward(c)
    model.rollback(0)
    fresh = model.forward(a + c)[len(a):]
    torch.testing.assert_close(after_rollback, fresh, atol=2e-2, rtol=0)


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_speculation_with_quantized_drafter_matches_unquantized_autoregressive(arch, quant):
    rates = []
    for seed in range(2):
        target = tiny_model(arch, seed, VOCAB, init_std=0.1)
        prompt = random_prompt(seed, VOCAB)
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=24).token_ids
        for drafter in (quantized_copy(target, quant), f"self@{quant}"):
            result = generate(target, prompt_ids=prompt, drafter=drafter, k=4, max_new_tokens=24)
            assert result.token_ids == expected
            rates.append(result.stats.acceptance_rate)
    # A quantized copy agrees with its original far more often than an unrelated model (about 0 here).
    assert sum(rates) / len(rates) > 0.25


def test_quantized_target_is_lossless_against_itself():
    target = quantized_copy(tiny_model("llama", 4, VOCAB), "int8")
    prompt = random_prompt(4, VOCAB)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=25).token_ids
    assert generate(target, prompt_ids=prompt, drafter=target, k=3, max_new_tokens=25).token_ids == expected


def test_tied_head_is_untied_before_quantizing():
    model = tiny_transformer("qwen2", 0, VOCAB)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    quantize(model, "int8")
    assert isinstance(model.get_output_embeddings(), Int8DynamicLinear)
    assert isinstance(model.get_input_embeddings(), nn.Embedding)


def test_bad_quantization_is_refused():
    with pytest.raises(ConfigError, match="unknown quantization"):
        load_model("qwen2.5-coder-0.5b@int3")
    with pytest.raises(ConfigError, match="divisible"):
        Int4WeightOnlyLinear(nn.Linear(48, 8), 32)
