"""Acceptance estimation for a target/drafter pair (needs torch and the models; DSI paper, Appendix F.2).

The target generates greedily; the drafter, teacher-forced on the same text, predicts every position.
Runs of exact matches between drafter and target give the geometric-fit acceptance rate
a = 1 - 1 / (1 + mean run), a run that a text's end cuts off counted as censored (`geometric_fit`); with
sampling, sum_x min(p, q) is the expected acceptance of one draft.

A drafter with another vocabulary predicts each target token as it would draft it (`CrossVocabDrafter`): greedy,
its first string-level draft token; sampling, q on the shared tokens, and the probability it loses there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from speculant.config import SamplingConfig
from speculant.sampling import logits_to_probs


@dataclass
class AcceptanceReport:
    positions: int
    agreement: float  # share of positions where the drafter's argmax is the target's token
    mean_run: float  # accepted drafts per rejection, unfinished runs censored (`geometric_fit`)
    geometric_rate: float  # a = 1 - 1 / (1 + mean run)
    per_position: list[float]  # acceptance at draft position j, given positions < j were accepted
    expected_sampling_acceptance: float | None  # mean of sum_x min(p, q), at temperature > 0
    outside_mass: float | None = None  # another vocabulary, sampling: the drafter's mean mass off the shared tokens


def geometric_fit(flags: Sequence[np.ndarray]) -> tuple[float, float]:
    """(mean run, a) of the geometric fit to the runs of matches in each text's `flags` (DSI paper, Appendix
    F.2: a = 1 - 1 / (1 + mean run)). A run a mismatch ends is one rejection after its matches; a run the text's
    end cuts off is censored, its matches counted but no rejection, so the maximum-likelihood mean run is
    matches / mismatches and a = matches / (matches + mismatches). Dropping censored runs would bias a down,
    to 0 where the only mismatch opens a text. With no mismatch, the mean run is the positions seen (a lower
    bound)."""
    matches = sum(int(np.count_nonzero(f)) for f in flags)
    mismatches = sum(len(f) for f in flags) - matches
    mean_run = matches / mismatches if mismatches else float(matches)
    return mean_run, 1 - 1 / (1 + mean_run)


def position_counts(flags: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """For draft positions j < depth: how many starting positions i reached j (matches at i .. i + j - 1)
    and how many of those also matched at i + j."""
    reached, matched = np.zeros(depth), np.zeros(depth)
    for i in range(len(flags)):
        for j in range(min(depth, len(flags) - i)):
            reached[j] += 1
            if not flags[i + j]:
                break
            matched[j] += 1
    return reached, matched


def _logits_along(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The model's logits for every position of `output`, teacher-forced: [len(output), vocab]."""
    first = model.prefill(prompt)[None]
    return torch.cat([first, model.forward(output[:-1])]) if len(output) > 1 else first


def estimate(target, drafters: Sequence, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
             depth: int = 8) -> list[AcceptanceReport]:
    """Teacher-forced predictions of each drafter along the target's greedy continuations of `prompts`
    (the target generates once for all drafters); one report per drafter. The positions past a drafter's cache (a
    small model's, after a long prompt) are mismatches: it drafts nothing there."""
    from speculant.api import generate

    outputs = [generate(target, prompt_ids=ids, method="ar", max_new_tokens=max_new_tokens).token_ids
               for ids in prompts]
    depth = min(depth, max(map(len, outputs)))  # (no draft position past the longest reply is reached)
    p_rows = [None] * len(prompts)
    if not sampling.greedy:
        p_rows = [logits_to_probs(_logits_along(target, ids, out), sampling) for ids, out in zip(prompts, outputs)]
    return [_report(drafter, target, prompts, outputs, p_rows, sampling, depth) for drafter in drafters]


def _cross_vocab_along(target, drafter, prompt: list[int], output: list[int], p: torch.Tensor | None,
                       sampling: SamplingConfig, pairs: dict) -> tuple[np.ndarray, np.ndarray | None, list[float]]:
    """Per position of `output`, for a drafter of another vocabulary: whether its greedy string-level draft starts
    with the target's token; at temperature > 0 also sum_x min(p, q) with q its shared-token distribution, and
    its mass off the shared tokens. `pairs` keeps the two vocabularies' table from prompt to prompt."""
    from speculant.drafters.cross_vocab import CrossVocabDrafter

    greedy = CrossVocabDrafter(drafter, target, SamplingConfig(), None, pairs=pairs)
    flags = np.array([greedy.propose(prompt + output[:i], 1).tokens == output[i: i + 1] for i in range(len(output))])
    if p is None:
        return flags, None, []
    sampled = CrossVocabDrafter(drafter, target, sampling, None, pairs=pairs)
    overlaps, outside = [], []
    for i in range(len(output)):
        shared = sampled.distribution(prompt + output[:i])
        overlaps.append(float(torch.minimum(p[i], shared[0].to(p.device)).sum()) if shared else 0.0)
        outside += [shared[1]] if shared else []
    return flags, np.array(overlaps), outside


def _report(drafter, target, prompts: list[list[int]], outputs: list[list[int]], p_rows: list,
            sampling: SamplingConfig, depth: int) -> AcceptanceReport:
    from speculant.drafters.vocab import same_vocabulary

    flags, overlaps, outside, pairs = [], [], [], {}
    reached, matched = np.zeros(depth), np.zeros(depth)
    for ids, output, p in zip(prompts, outputs, p_rows):
        if not same_vocabulary(target, drafter):
            flag, overlap, lost = _cross_vocab_along(target, drafter, ids, output, p, sampling, pairs)
            flags.append(flag)
            overlaps += [overlap] if overlap is not None else []
            outside += lost
        else:  # (the positions past the drafter's cache mismatches: a drafter whose cache is full drafts none)
            room = len(ids) + len(output) if drafter.max_positions is None else drafter.max_positions
            n = max(0, min(len(output), room - len(ids) + 1))
            flag, overlap = np.zeros(len(output), dtype=bool), np.zeros(len(output))
            if n:
                q_logits = _logits_along(drafter, ids, output[:n])
                flag[:n] = q_logits.argmax(-1).cpu().numpy() == np.asarray(output[:n])
                if p is not None:
                    q = logits_to_probs(q_logits.to(p.device), sampling)
                    overlap[:n] = torch.minimum(p[:n], q).sum(-1).cpu().numpy()
            flags.append(flag)
            overlaps += [overlap] if p is not None else []
        counts = position_counts(flags[-1], depth)
        reached += counts[0]
        matched += counts[1]
    all_flags = np.concatenate(flags)
    mean_run, rate = geometric_fit(flags)
    return AcceptanceReport(
        positions=len(all_flags),
        agreement=float(all_flags.mean()),
        mean_run=mean_run,
        geometric_rate=rate,
        per_position=[float(m / r) for m, r in zip(matched, reached) if r > 0],
        expected_sampling_acceptance=min(float(np.concatenate(overlaps).mean()), 1.0) if overlaps else None,  # (a
        # sum of float32 minima may pass 1 by rounding)
        outside_mass=float(np.mean(outside)) if outside else None,
    )
