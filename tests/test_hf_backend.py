"""The hf CausalLM backend: prefill, incremental forward, rollback and keep against fresh prefills."""

import pytest
import torch

from helpers import ARCHS, DEVICES, perturbed, random_prompt, tiny_model, tiny_transformer
from speculant.models import load_model


def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every token of `ids` from an empty cache, as a reference."""
    model.rollback(0)
    return model.forward(ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_forward_matches_one_pass(arch, device):
    model = tiny_model(arch, seed=0, device=device)
    ids = random_prompt(1, 64, 12)
    whole = fresh_logits(model, ids)
    model.rollback(0)
    last = model.prefill(ids[:5])
    torch.testing.assert_close(last, whole[4], atol=1e-5, rtol=0)
    torch.testing.assert_close(model.forward(ids[5:9]), whole[5:9], atol=1e-5, rtol=0)
    torch.testing.assert_close(model.forward(ids[9:]), whole[9:], atol=1e-5, rtol=0)
    assert model.cache_len == len(ids)
    model.rollback(5)
    torch.testing.assert_close(model.catch_up(ids[5:], 2), whole[-2:], atol=1e-5, rtol=0)
    assert model.cache_len == len(ids)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", range(3))
def test_rollback_then_forward_equals_fresh_prefill(arch, seed):
    model = tiny_model(arch, seed)
    a, b, c = random_prompt(seed, 64, 7), random_prompt(seed + 10, 64, 5), random_prompt(seed + 20, 64, 4)
    model.prefill(a + b)
    model.rollback(len(a))
    assert model.cache_len == len(a)
    after_rollback = model.forward(c)
    torch.testing.assert_close(after_rollback, fresh_logits(model, a + c)[len(a):], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_selects_cached_positions(arch):
    model = tiny_model(arch, seed=3)
    ids = random_prompt(3, 64, 10)
    model.prefill(ids)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in model._cache.layers]
    chosen = [0, 1, 2, 5, 8]
    model.keep(3, chosen[3:])
    assert model.cache_len == len(chosen)
    for (keys, values), layer in zip(before, model._cache.layers):
        torch.testing.assert_close(layer.keys, keys[:, :, chosen], atol=0, rtol=0)
        torch.testing.assert_close(layer.values, values[:, :, chosen], atol=0, rtol=0)
    # Keeping a prefix is a rollback: the next forward matches a fresh run of that prefix.
    model.prefill(ids)
    model.keep(6, [])
    torch.testing.assert_close(model.forward([7]), fresh_logits(model, ids[:6] + [7])[-1:], atol=1e-5, rtol=0)


def test_rollback_rejects_out_of_range():
    model = tiny_model("llama", seed=0)
    model.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="cannot roll back to 4 cached positions: 3 are cached"):
        model.rollback(4)
    with pytest.raises(ValueError, match=r"keep 1 leading positions and \[5\] after them: they must ascend within "
                                         "the 3 cached"):
        model.keep(1, [5])


def test_load_model_leaves_the_callers_model_untouched():
    model = tiny_transformer("qwen2", 3, 64)
    modules = {name: type(module) for name, module in model.named_modules()}
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    attention = model.config._attn_implementation
    for dtype in (None, "fp32", "bf16"):
        loaded = load_model(model, dtype=dtype)
        loaded.prefill([1, 2, 3])
        loaded.forward([4, 5])
    assert load_model(model).dtype == torch.float32 and load_model(model, dtype="bf16").dtype == torch.bfloat16
    assert {name: type(module) for name, module in model.named_modules()} == modules
    assert all(torch.equal(p, weights[name]) and p.dtype == torch.float32 for name, p in model.named_parameters())
    assert model.config._attn_implementation == attention


def windowed_transformer(arch: str):
    """A tiny windowed model (window 8): Mistral (every layer), Gemma 3 (five windowed layers, then a global one) or
    Qwen2 with `max_window_layers` (a global layer, then a windowed one)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if arch == "qwen2":
        torch.manual_seed(1)
        config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                             max_window_layers=1, initializer_range=0.1)
        return Qwen2ForCausalLM(config).eval()
    return tiny_transformer(arch, 1, 64, init_std=0.1, layers=6 if arch == "gemma3" else 2)


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "qwen2"])
@pytest.mark.parametrize("prompt_length", [5, 13, 30])  # shorter than the window of 8, longer, far longer
def test_a_sliding_window_is_what_transformers_full_recomputation_applies(arch, prompt_length):
    """On a windowed model (windowed layers mixed with global ones: a mask per layer type), every logits row along
    the generation equals transformers' forward over the whole sequence so far (which applies the window itself),
    greedy `ar` is its greedy decoding (up to near-ties of the two summation orders), and `sd` (Max-Gram and a
    model), `tree` and `cascade` equal `ar`: rollback and tree compaction keep the window's positions."""
    from speculant import generate
    from speculant.models.windows import layer_windows

    reference = windowed_transformer(arch)
    assert 8 in layer_windows(reference.config) and (arch == "mistral") != (None in layer_windows(reference.config))
    model = load_model(reference)
    prompt = [(7 * i + 1) % 60 + 1 for i in range(prompt_length)]
    ar = generate(model, prompt_ids=prompt, method="ar", max_new_tokens=24).token_ids
    sequence, logits = list(prompt), model.prefill(prompt)
    for token in ar:
        with torch.no_grad():
            full = reference(torch.tensor([sequence])).logits[0, -1]
        torch.testing.assert_close(logits, full, atol=1e-5, rtol=0)
        top = full.topk(2).values
        if top[0] - top[1] > 1e-4:  # (a near-tie may go either way in the other summation order)
            assert token == int(full.argmax())
        sequence.append(token)
        logits = model.forward([token])[-1]
    drafter = perturbed(model, 0.1, 3)  # (agrees often, not always: chains accepted in part, then rolled back)
    expected = generate(model, prompt_ids=prompt * 2, method="ar", max_new_tokens=24).token_ids
    for method, options in [("sd", dict(drafter="maxgram", k=4)), ("sd", dict(drafter=drafter, k=3)),
                            ("tree", dict(drafter=drafter, depth=3, width=2)),
                            ("cascade", dict(drafters=(drafter, "maxgram")))]:
        result = generate(model, prompt_ids=prompt * 2, method=method, max_new_tokens=24, **options)
        assert result.token_ids == expected, method
        steps = list(zip(result.stats.accepted_lengths, result.stats.draft_lengths))
        if options.get("drafter") != "maxgram":  # (a tree drops its other branches at every step)
            assert sum(a for a, _ in steps) > 0 and (method == "tree" or any(0 < a < d for a, d in steps)), method


def test_gemma_2_s_soft_capped_attention_is_the_model_s_own_and_row_invariant():
    """Gemma 2 caps its attention scores (softcap * tanh(score / softcap)); row-invariant attention computes the cap,
    so the hf backend's logits are the model's eager forward's, greedy `ar` is its own greedy `generate`, and a row of
    a W-token forward still equals its one-token forward bit for bit."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from speculant import generate

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                          sliding_window=4, attn_logit_softcapping=0.5, initializer_range=0.5, eos_token_id=None,
                          bos_token_id=None, pad_token_id=None, attn_implementation="eager")
    reference = Gemma2ForCausalLM(config).eval()
    model, prompt = load_model(reference), random_prompt(2, 64, 11)
    with torch.no_grad():
        own = reference(torch.tensor([prompt])).logits[0]
    rows = torch.cat([model.prefill(prompt[:5])[None], model.forward(prompt[5:])])
    torch.testing.assert_close(rows, own[4:], atol=1e-5, rtol=0)
    model.rollback(5)
    assert torch.equal(torch.cat([model.forward([token]) for token in prompt[5:]]), rows[1:])
    with torch.no_grad():
        greedy = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16)
    assert generate(model, prompt_ids=prompt, method="ar", max_new_tokens=16).token_ids == greedy[0, 11:].tolist()


def test_attention_arguments_that_change_the_numbers_are_refused_not_dropped():
    """GPT-OSS's attention sinks (`s_aux`) are not computed by row-invariant attention: one ConfigError line."""
    from speculant.errors import ConfigError
    from speculant.models.numerics.invariant import row_invariant_attention

    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    out, _ = row_invariant_attention(torch.nn.Module(), query, key, key, None, sliding_window=None, position_ids=None)
    assert out.shape == (1, 3, 4, 8)
    row_invariant_attention(torch.nn.Module(), query, key, key, None, is_causal=True)
    with pytest.raises(ConfigError, match="^speculant's row-invariant attention does not compute s_aux, which Module "
                                          "passes$"):
        row_invariant_attention(torch.nn.Module(), query, key, key, None, s_aux=torch.zeros(4))
    with pytest.raises(ConfigError, match="does not compute is_causal=False, which"):
        row_invariant_attention(torch.nn.Module(), query, key, key, None, is_causal=False)
