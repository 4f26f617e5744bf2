"""Logits to probabilities (temperature, top-k, top-p) and sampling with an explicit torch.Generator."""

from __future__ import annotations

import torch

from speculant.config import SamplingConfig


def logits_to_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Turn logits [..., vocab] into the distribution the sampler draws from.

    Temperature 0 gives a one-hot argmax; otherwise softmax(logits / T) restricted to the top-k
    tokens (every token tied with the k-th stays, as transformers' filter keeps them) and to the nucleus of mass
    top-p (Holtzman et al., 2020; ties at its edge broken by the sort's order), renormalised.
    """
    if sampling.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        dropped = mass_before >= sampling.top_p
        dropped[..., 0] = False  # the top token always stays (a top_p that float32 rounds to 0 too)
        sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


SAMPLE_BLOCK = 512  # tokens per block of `sample`'s two-level CDF


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a distribution [vocab] (on the generator's device; its total need not be 1, but it
    must have mass) by
    inverting its CDF at one uniform draw u: the block of SAMPLE_BLOCK tokens whose cumulative mass first exceeds
    u * total, then the token within it, every sum in fp64 and no copy of the distribution, so a token of mass 0 is
    never drawn. Why not torch.multinomial: one draw from a large vocabulary cost it a sizeable share of a forward
    on the CPU, paid by every sampled token and every sampled draft token (CHANGELOG.md has the measurement)."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    flat = probs.reshape(-1)
    whole = flat.shape[0] - flat.shape[0] % SAMPLE_BLOCK
    sums = flat[:whole].view(-1, SAMPLE_BLOCK).sum(-1, dtype=torch.float64)
    if whole < flat.shape[0]:
        sums = torch.cat([sums, flat[whole:].sum(dtype=torch.float64)[None]])
    cdf = sums.cumsum(0)
    u = uniform((1,), generator, probs.device) * cdf[-1]  # < cdf[-1]: the draw is below 1
    block = min(int(torch.searchsorted(cdf, u, right=True)), len(cdf) - 1)
    start = block * SAMPLE_BLOCK
    tokens = flat[start:start + SAMPLE_BLOCK].double()
    index = int(torch.searchsorted(tokens.cumsum(0), u - (cdf[block - 1] if block else 0.0), right=True))
    if index >= len(tokens):  # the block's sum rounded above its cumsum's end: its last token with mass
        index = int(torch.nonzero(tokens)[-1])
    return start + index


def uniform(size: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """U[0, 1) draws from `generator` (on its own device), returned on `device`, in float64: a float32 draw lies on a
    2^-24 grid, so a token of smaller mass would never be drawn, or be drawn as if it had 2^-24."""
    source = generator.device if generator is not None else device
    return torch.rand(size, generator=generator, device=source, dtype=torch.float64).to(device)


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """The token a plain decoder emits after `logits` [vocab]: argmax at temperature 0, else a draw."""
    if sampling.greedy:
        return int(logits.argmax())
    return sample(logits_to_probs(logits, sampling), generator)


def seeded(device: torch.device, seed: int | None) -> torch.Generator:
    """The one generator of a generation: seeded with `seed`, or from the OS when None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
