"""What a bench run measured, per method: speeds and speedups over `ar` from the same run (with a 95%
bootstrap interval over prompts and the median of the ratios per prompt and repeat), the decode phase after the
first token on its own, acceptance, forward counts, and agreement with `ar` on the same target weights sampling alike.
A field nobody measured (acceptance of `ar`, forwards inside a peer) stays None and prints as "-"."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from speculant.bench.bootstrap import ratio_interval
from speculant.bench.llamacpp_cli import CLI_PEERS
from speculant.bench.methods import MethodSpec
from speculant.bench.runner import Measurement
from speculant.config import SamplingConfig
from speculant.decoding.stats import GenerationStats
from speculant.models.base import common_prefix_len

T = TypeVar("T", int, float)


@dataclass
class MethodSummary:
    method: str
    target: str  # the target's weights the method ran on
    tokens: int
    seconds: float
    tokens_per_s: float  # whole requests: total tokens / total time, prefill included
    decode_tokens_per_s: float  # after the first token: tokens after the first / time after TTFT
    speedup: float | None = None  # tokens_per_s over the baseline's (see `summarize`)
    speedup_ci95: tuple[float, float] | None = None  # bootstrap over prompts (repeats kept together)
    median_speedup: float | None = None  # median of per-prompt, per-repeat ratios
    decode_speedup: float | None = None  # decode_tokens_per_s over the baseline's
    decode_speedup_ci95: tuple[float, float] | None = None
    mean_accepted_length: float | None = None  # None: nothing was drafted (ar, peers)
    acceptance_rate: float | None = None
    acceptance_per_position: list[float] = field(default_factory=list)
    target_forwards: int | None = None  # None: not counted (peers)
    drafter_forwards: dict[str, int] = field(default_factory=dict)
    cost_ratios: dict[str, float] = field(default_factory=dict)  # measured c per drafter
    swi: float | None = None  # standardized wall-time improvement with those c (CS Drafting, section 5)
    ttft_s: float = 0.0
    identical_to_ar: float | None = None  # share of prompts whose output equals ar's (same weights, same sampling)
    common_prefix_with_ar: float | None = None  # mean tokens in common with that ar before the first difference


def _add_up(counts: Iterable[dict[str, T]]) -> dict[str, T]:
    total: dict[str, Any] = {}
    for count in counts:
        for name, value in count.items():
            total[name] = total.get(name, 0) + value
    return total


def _rate(rows: list[Measurement]) -> float:
    seconds = sum(r.stats.wall_s for r in rows)
    return sum(r.stats.new_tokens for r in rows) / seconds if seconds else 0.0


def _decode_rate(rows: list[Measurement]) -> float:
    seconds = sum(max(r.stats.wall_s - r.stats.ttft_s, 0.0) for r in rows)
    return sum(max(r.stats.new_tokens - 1, 0) for r in rows) / seconds if seconds else 0.0


def _speed(row: Measurement) -> float:
    return row.stats.new_tokens / row.stats.wall_s if row.stats.wall_s > 0 else 0.0


def _law(spec: MethodSpec, sampling: SamplingConfig) -> tuple[float, int | None, float | None] | None:
    """What a method's output distribution depends on in a run of `sampling`, its own settings applied: None where it
    decodes greedily (top-k and top-p then change nothing), else its temperature, top-k and top-p (not how drafts are
    verified)."""
    own = spec.sampled(sampling)
    return None if own.greedy else (own.temperature, own.top_k, own.top_p)


def summarize(rows: list[Measurement], methods: list[MethodSpec], baseline: str | None = None,
              sampling: SamplingConfig = SamplingConfig()) -> list[MethodSummary]:
    """Per method; speedups over the method labelled `baseline` (default: the first `ar` listed that samples as the
    method does in a run of `sampling`, on the method's target weights where one does: a run may compare methods at
    several temperatures, or dtypes, each against its own `ar`)."""
    by_method = {spec.label: [r for r in rows if r.method == spec.label] for spec in methods}
    ar_specs = [spec for spec in methods if spec.method == "ar"]
    ar_labels = [spec.label for spec in ar_specs]
    summaries = []
    for spec in methods:
        mine = by_method[spec.label]
        if not mine:
            continue
        alike = [a.label for a in ar_specs if _law(a, sampling) == _law(spec, sampling)]
        mine_too = [label for label in alike if by_method[label] and by_method[label][0].target == mine[0].target]
        if baseline is None:
            base = by_method[(mine_too or alike or ar_labels)[0]] if ar_labels else []
        else:
            base = by_method[baseline]
        base_rows = {(r.prompt_id, r.repeat): r for r in base}
        stats = [r.stats for r in mine]
        merged = GenerationStats(
            new_tokens=sum(s.new_tokens for s in stats), target_forwards=sum(s.target_forwards for s in stats),
            target_steps=sum(s.target_steps for s in stats), target_seconds=sum(s.target_seconds for s in stats),
            drafter_forwards=_add_up(s.drafter_forwards for s in stats),
            drafter_steps=_add_up(s.drafter_steps for s in stats), drafter_seconds=_add_up(s.drafter_seconds for s in stats),
            draft_lengths=[d for s in stats for d in s.draft_lengths],
            accepted_lengths=[a for s in stats for a in s.accepted_lengths])
        drafted = bool(merged.draft_lengths)
        summary = MethodSummary(
            method=spec.label, target=mine[0].target, tokens=merged.new_tokens, seconds=sum(s.wall_s for s in stats),
            tokens_per_s=_rate(mine), decode_tokens_per_s=_decode_rate(mine),
            mean_accepted_length=merged.mean_accepted_length if drafted else None,
            acceptance_rate=merged.acceptance_rate, acceptance_per_position=merged.acceptance_per_position,
            target_forwards=None if spec.peer else merged.target_forwards, drafter_forwards=merged.drafter_forwards,
            cost_ratios=merged.cost_ratios, swi=None if spec.peer else merged.swi,
            ttft_s=statistics.mean(s.ttft_s for s in stats))
        if base and _rate(base):
            summary.speedup = summary.tokens_per_s / _rate(base)
            summary.speedup_ci95 = ratio_interval(mine, base, _rate, lambda r: r.prompt_id)
            summary.median_speedup = statistics.median(_speed(r) / _speed(base_rows[r.prompt_id, r.repeat])
                                                       for r in mine)
        if base and _decode_rate(base):
            summary.decode_speedup = summary.decode_tokens_per_s / _decode_rate(base)
            summary.decode_speedup_ci95 = ratio_interval(mine, base, _decode_rate, lambda r: r.prompt_id)
        # Agreement only against an ar on the same weights that samples alike: another dtype's ar is another model's
        # output, and another temperature's another distribution's.
        reference = by_method[mine_too[0]] if mine_too else None
        if reference:
            same = {(r.prompt_id, r.repeat): r.token_ids for r in reference}
            said = {(r.prompt_id, r.repeat): r.text or "" for r in reference}
            summary.identical_to_ar = statistics.mean(
                (r.text or "").startswith(said[r.prompt_id, r.repeat]) if spec.method in CLI_PEERS
                else r.token_ids == same[r.prompt_id, r.repeat] for r in mine)
            summary.common_prefix_with_ar = statistics.mean(
                common_prefix_len(r.token_ids, same[r.prompt_id, r.repeat]) for r in mine)
        summaries.append(summary)
    return summaries


def summarize_by_category(rows: list[Measurement], methods: list[MethodSpec], baseline: str | None = None,
                          sampling: SamplingConfig = SamplingConfig()) -> dict[str, list[MethodSummary]]:
    """The same summaries within each prompt category (only when there is more than one)."""
    categories = sorted({r.category for r in rows})
    if len(categories) < 2:
        return {}
    return {c: summarize([r for r in rows if r.category == c], methods, baseline, sampling) for c in categories}


def to_json(config: dict[str, Any], rows: list[Measurement], summaries: list[MethodSummary],
            by_category: dict[str, list[MethodSummary]]) -> dict[str, Any]:
    return {
        "config": config,
        "summary": [asdict(s) for s in summaries],
        "by_category": {c: [asdict(s) for s in summary] for c, summary in by_category.items()},
        "rows": [{"prompt_id": r.prompt_id, "category": r.category, "method": r.method, "repeat": r.repeat,
                  "target": r.target, "token_ids": r.token_ids, "text": r.text, "stats": r.stats.to_dict()} for r in rows],
    }


def rows_from_json(data: dict[str, Any]) -> list[Measurement]:
    """The rows `to_json` wrote (enough of each generation's stats to summarize it again)."""
    for row in data["rows"]:
        if not (isinstance(row["token_ids"], list) and all(isinstance(t, int) for t in row["token_ids"])):
            raise ValueError(f"a row's token_ids must be a list of token ids, got {row['token_ids']!r:.60}")
        for name, kind in (("prompt_id", str), ("category", str), ("method", str), ("target", str), ("repeat", int)):
            if not isinstance(row[name], kind) or isinstance(row[name], bool):
                raise ValueError(f"a row's {name} must be {kind.__name__}, got {row[name]!r:.60}")
    rows = [Measurement(r["prompt_id"], r["category"], r["method"], r["repeat"], r["target"], r["token_ids"],
                        GenerationStats.from_dict(r["stats"]), r.get("text")) for r in data["rows"]]
    categories: dict[str, str] = {}
    if odd := next((r for r in rows if categories.setdefault(r.prompt_id, r.category) != r.category), None):
        raise ValueError(f"prompt {odd.prompt_id} is of category {categories[odd.prompt_id]} in one row and "
                         f"{odd.category} in another")
    return rows
