"""Quantized drafters: close to the original layers, same CausalLM contract, lossless speculation."""

import pytest
import torch
from torch import nn

from helpers import ARCHS, DEVICES, random_prompt, tiny_model, tiny_transformer
from speculant import generate, load_model
from speculant.errors import ConfigError
from speculant.models import quantized_copy
from speculant.models.numerics import native
from speculant.models.numerics.quant import AMXInt8Linear, Int4WeightOnlyLinear, Int8DynamicLinear, Int8WeightOnlyLinear, quantize
from speculant.trees.tree import TokenTree

VOCAB = 64
QUANTIZERS = {"int8-dynamic": Int8DynamicLinear, "int8-weight-only": Int8WeightOnlyLinear, "int8-amx": AMXInt8Linear,
              "int4": lambda linear: Int4WeightOnlyLinear(linear, 32)}
BOUNDS = {"int8-dynamic": 0.03, "int8-weight-only": 0.03, "int8-amx": 0.03, "int4": 0.15}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", QUANTIZERS)
def test_quantized_linear_stays_close(kind, device):
    if kind in ("int8-dynamic", "int8-amx") and device == "cuda":
        pytest.skip("fbgemm's and AMX's int8 kernels are CPU-only")
    if kind == "int8-amx" and native.AMX.library() is None:
        pytest.skip("no AMX on this CPU")
    torch.manual_seed(0)
    linear = nn.Linear(256, 384).to(device)
    x = torch.randn(5, 256, device=device)
    reference = linear(x)
    error = (QUANTIZERS[kind](linear)(x).float() - reference).norm() / reference.norm()
    assert error < BOUNDS[kind]
    # Weights stored transposed (as speculant's exact kernels keep them) quantize to the same layer.
    transposed = nn.Linear(256, 384).to(device)
    transposed.weight = nn.Parameter(linear.weight.detach().t().contiguous().t())
    transposed.bias = linear.bias
    torch.testing.assert_close(QUANTIZERS[kind](transposed)(x), QUANTIZERS[kind](linear)(x), atol=1e-5, rtol=0)
    # A quantizer that dropped the scales or transposed the weight would be far off.
    assert (nn.Linear(256, 384).to(device)(x) - reference).norm() / reference.norm() > 0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_model_keeps_the_causal_lm_contract(arch, quant, device):
    model = quantized_copy(tiny_model(arch, 0, VOCAB, device=device), quant)
    assert model.name.endswith("@" + quant)
    assert not any(isinstance(m, nn.Linear) for m in model.model.modules())
    a, c = random_prompt(1, VOCAB, 6), random_prompt(2, VOCAB, 3)
    model.prefill(a + [5, 6, 7])
    model.rollback(len(a))
    after_rollback = model.forward(c)
    model.rollback(0)
    fresh = model.forward(a + c)[len(a):]
    torch.testing.assert_close(after_rollback, fresh, atol=2e-2, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_speculation_with_quantized_drafter_matches_unquantized_autoregressive(arch, quant, device):
    rates = []
    for seed in range(2):
        target = tiny_model(arch, seed, VOCAB, init_std=0.1, device=device)
        prompt = random_prompt(seed, VOCAB)
        expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=24).token_ids
        for drafter in (quantized_copy(target, quant), f"self@{quant}"):
            result = generate(target, prompt_ids=prompt, drafter=drafter, k=4, max_new_tokens=24)
            assert result.token_ids == expected
            rates.append(result.stats.acceptance_rate)
    # A quantized copy agrees with its original far more often than an unrelated model (about 0 here).
    assert sum(rates) / len(rates) > 0.25


@pytest.mark.parametrize("device", DEVICES)
def test_quantized_target_is_lossless_against_itself(device):
    target = quantized_copy(tiny_model("llama", 4, VOCAB, device=device), "int8")
    prompt = random_prompt(4, VOCAB)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=25).token_ids
    assert generate(target, prompt_ids=prompt, drafter=target, k=3, max_new_tokens=25).token_ids == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_model_scores_a_token_bit_identically_in_any_forward(arch):
    # An int8 target must verify exactly as it decodes: a rounding boundary turns the last bits that
    # batched attention changes into whole int8 steps, so nothing short of equality will do.
    model = quantized_copy(tiny_model(arch, 6, VOCAB, init_std=0.1), "int8")
    prompt, tokens = random_prompt(6, VOCAB, 10), random_prompt(7, VOCAB, 12)
    by_chunk = {}
    for chunk in (1, 3, 12):
        model.prefill(prompt)
        by_chunk[chunk] = torch.cat([model.forward(tokens[i : i + chunk]) for i in range(0, len(tokens), chunk)])
    assert torch.equal(by_chunk[1], by_chunk[3]) and torch.equal(by_chunk[1], by_chunk[12])
    # A token tree: every node scores as it would at the end of its own path, decoded one token at a time.
    tree = TokenTree((7, 11, 12, 13, 14, 15), (-1, 0, 0, 1, 1, 2))
    model.prefill(prompt)
    tree_logits = model.forward(list(tree.tokens), tree=tree)
    for path in (tree.path_to(leaf) for leaf in (3, 4, 5)):
        model.prefill(prompt)
        alone = torch.cat([model.forward([tree.tokens[i]]) for i in path])
        assert torch.equal(tree_logits[path], alone)


def test_int8_picks_the_kernel_of_its_device():
    model = quantize(tiny_transformer("llama", 0, VOCAB), "int8")
    amx = native.AMX.library() is not None
    assert isinstance(model.get_output_embeddings(), AMXInt8Linear if amx else Int8DynamicLinear)
    # The weight-only form is what CUDA runs; it must agree with fbgemm's on the same weights.
    torch.manual_seed(1)
    linear = nn.Linear(64, 32)
    x = torch.randn(3, 64)
    torch.testing.assert_close(Int8WeightOnlyLinear(linear)(x), Int8DynamicLinear(linear)(x), atol=0.04, rtol=0)


def test_int8_token_output_does_not_depend_on_the_other_tokens():
    # fbgemm quantizes a whole call with one scale; an outlier token must not change its neighbours'
    # outputs, or a quantized target would verify differently than it decodes.
    torch.manual_seed(2)
    layers = [Int8DynamicLinear(nn.Linear(128, 48))] + ([AMXInt8Linear(nn.Linear(128, 48))] if native.AMX.library() else [])
    for layer in layers:
        for n_tokens in (2, 5, 16):
            x = torch.randn(n_tokens, 128)
            x[-1] *= 50
            together = layer(x)
            for i in range(n_tokens):
                assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])


def test_tied_head_is_untied_before_quantizing():
    model = tiny_transformer("qwen2", 0, VOCAB)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    embedding = model.get_input_embeddings().weight.detach().clone()
    quantize(model, "int8")
    assert isinstance(model.get_output_embeddings(), (AMXInt8Linear, Int8DynamicLinear))
    assert isinstance(model.get_input_embeddings(), nn.Embedding) and not model.config.tie_word_embeddings
    assert torch.equal(model.get_input_embeddings().weight, embedding)


def test_bad_quantization_is_refused():
    with pytest.raises(ConfigError, match="unknown quantization"):
        load_model("qwen2.5-coder-0.5b@int3")
    with pytest.raises(ConfigError, match="divisible"):
        Int4WeightOnlyLinear(nn.Linear(48, 8), 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_int4_refuses_shapes_its_kernel_cannot_run():
    with pytest.raises(ConfigError, match="group sizes"):
        Int4WeightOnlyLinear(nn.Linear(48, 8).cuda(), 16)
    with pytest.raises(ConfigError, match="divisible by 8"):
        Int4WeightOnlyLinear(nn.Linear(64, 12).cuda(), 32)


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize(("arch", "vocab"), [("llama", 97), ("gpt2", 50257)])
def test_odd_shapes_quantize_and_speculation_stays_exact(arch, vocab, quant):
    """Output sizes the kernels cannot take as they are (a vocabulary of 97, GPT-2's 50257, GPT-2's Conv1D
    layers) are padded; greedy speculation with the quantized drafter still equals ar."""
    model = tiny_transformer(arch, 5, vocab, init_std=0.1, hidden=64)
    drafter = load_model(model, quant=quant)
    kinds = {type(m).__name__ for m in drafter.model.modules()}
    assert "Conv1D" not in kinds and "Linear" not in kinds and "WeightLeftLinear" not in kinds
    target = load_model(model)
    prompt = random_prompt(5, vocab)
    expected = generate(target, prompt_ids=prompt, method="ar", max_new_tokens=20).token_ids
    result = generate(target, prompt_ids=prompt, drafter=drafter, k=4, max_new_tokens=20)
    assert result.token_ids == expected and result.stats.acceptance_rate > 0.3
    if quant == "int8":  # an int8 model is an exact target too
        reference = generate(drafter, prompt_ids=prompt, method="ar", max_new_tokens=20).token_ids
        assert generate(drafter, prompt_ids=prompt, drafter="maxgram", k=4, max_new_tokens=20).token_ids == reference


def test_a_layer_int4_cannot_take_stays_in_full_precision_and_says_so(caplog):
    layer = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 32))  # 40 inputs: not a multiple of 32
    with caplog.at_level("WARNING", logger="speculant"):
        quantize(layer, "int4")
    assert isinstance(layer[0], Int4WeightOnlyLinear) and type(layer[1]) is nn.Linear
    assert "kept 1 of 2 linear layers in full precision" in caplog.text


def test_a_group_size_is_int4_s_and_refused_where_nothing_takes_it():
    """`load_model`'s group_size was dropped without a word where nothing quantized to int4 (no quantization, int8,
    a model already loaded, where a dtype or device given is refused)."""
    model = tiny_transformer("llama", 0, 64)
    for kwargs in (dict(group_size=64), dict(quant="int8", group_size=64)):
        with pytest.raises(ConfigError, match="group_size applies to int4 quantization"):
            load_model(model, **kwargs)
    with pytest.raises(ConfigError, match="a loaded model runs as it is: group_size applies"):
        load_model(load_model(model), group_size=64)
    assert load_model(model, quant="int4", group_size=16).name == "LlamaForCausalLM@int4"  # (was "None@int4")


@pytest.mark.parametrize("args, message", [
    (("int4", 0), "group_size must be a positive integer"), (("int4", -1), "group_size must be a positive integer"),
    (("int4", 1.5), "group_size must be a positive integer"), (("int8", 7), "group_size applies to int4"),
    (("int3",), "unknown quantization 'int3'")])
def test_quantized_copy_checks_what_load_model_checks(args, message):
    """`quantized_copy`, which `load_model`'s refusal of a loaded model's quant points to, took a group size of 0
    (ZeroDivisionError), -1 (a RuntimeError) or one int8 ignores, and any model (an AttributeError for a GGUF's)."""
    with pytest.raises(ConfigError, match=message):
        quantized_copy(tiny_model("llama", 0, VOCAB), *args)
    with pytest.raises(ConfigError, match="a model on the transformers backend"):
        quantized_copy(object(), "int8")
