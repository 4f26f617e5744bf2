"""The intervals every speed claim carries: a percentile bootstrap over prompts. Pure Python (no torch), so that
the scripts that print README tables from results files compute them exactly as the bench did."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

BOOTSTRAP = 2000  # resamples of the prompt set for each interval


def ratio_interval(rows: Sequence[Any], baseline: Sequence[Any], rate: Callable[[list[Any]], float],
                   prompt_of: Callable[[Any], Any], seed: int = 0) -> tuple[float, float] | None:
    """95% percentile-bootstrap interval of rate(rows) / rate(baseline), resampling prompts (`prompt_of` a row:
    each prompt's repeats stay together, so repeats narrow the interval instead of counting as new prompts)."""
    prompts = sorted({prompt_of(r) for r in rows})
    if len(prompts) < 2:
        return None
    mine = {p: [r for r in rows if prompt_of(r) == p] for p in prompts}
    theirs = {p: [r for r in baseline if prompt_of(r) == p] for p in prompts}
    rng = random.Random(seed)
    ratios = []
    for _ in range(BOOTSTRAP):
        sample = [rng.choice(prompts) for _ in prompts]
        base = rate([r for p in sample for r in theirs[p]])
        if base:
            ratios.append(rate([r for p in sample for r in mine[p]]) / base)
    if not ratios:
        return None
    ratios.sort()
    return ratios[int(0.025 * len(ratios))], ratios[min(int(0.975 * len(ratios)), len(ratios) - 1)]
