"""Run a method matrix fairly: one process, one loaded target, one warm-up per method, methods
interleaved prompt by prompt, the same seed for every method, wall time around whole generations."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from speculant.api import encode_prompt, generate
from speculant.bench.datasets import Prompt
from speculant.bench.methods import MethodSpec
from speculant.decoding.stats import GenerationStats
from speculant.models import CausalLM, dtype_name, load_model


@dataclass
class Row:
    prompt_id: str
    method: str
    token_ids: list[int]
    stats: GenerationStats


@dataclass
class MethodSummary:
    method: str
    tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float | None  # total tokens / total time, over `ar` from the same run
    median_speedup: float | None  # median of per-prompt ratios
    mean_accepted_length: float
    acceptance_rate: float | None
    acceptance_per_position: list[float]
    target_forwards: int
    drafter_forwards: dict[str, int] = field(default_factory=dict)
    ttft_s: float = 0.0
    identical_to_ar: float | None = None  # share of prompts whose output equals ar's
    common_prefix_with_ar: float | None = None  # mean tokens in common with ar before the first difference


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_matrix(
    target: CausalLM,
    methods: list[MethodSpec],
    prompts: list[Prompt],
    max_new_tokens: int,
    seed: int = 0,
    temperature: float = 0.0,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Every method on every prompt, interleaved; returns the rows in run order."""
    drafters: dict[tuple[str, str], Any] = {}
    dtype = dtype_name(target.dtype)

    def drafter_for(spec: MethodSpec) -> Any:
        if spec.drafter is None:
            return None
        key = (spec.drafter, spec.drafter_dtype or dtype)
        if key not in drafters:
            drafters[key] = load_model(spec.drafter, dtype=key[1], device=str(target.device))
        return drafters[key]

    def run(spec: MethodSpec, ids: list[int], n: int):
        return generate(target, prompt_ids=ids, drafter=drafter_for(spec), method=spec.method, k=spec.k,
                        max_new_tokens=n, temperature=temperature, seed=seed)

    encoded = [encode_prompt(target.tokenizer, p.text) for p in prompts]
    for spec in methods:  # warm-up: allocator, caches, lazy initialisation
        run(spec, encoded[0], min(8, max_new_tokens))
    rows = []
    for prompt, ids in zip(prompts, encoded):
        for spec in methods:
            result = run(spec, ids, max_new_tokens)
            row = Row(prompt.id, spec.label, result.token_ids, result.stats)
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


def summarize(rows: list[Row], methods: list[MethodSpec]) -> list[MethodSummary]:
    by_method = {spec.label: [r for r in rows if r.method == spec.label] for spec in methods}
    baseline = next((spec.label for spec in methods if spec.method == "ar"), None)
    ar_rows = {r.prompt_id: r for r in by_method.get(baseline, [])} if baseline else {}
    ar_tps = _total_tps(by_method[baseline]) if baseline else None
    summaries = []
    for label, method_rows in by_method.items():
        stats = [r.stats for r in method_rows]
        drafted = [d for s in stats for d in s.draft_lengths]
        accepted = [a for s in stats for a in s.accepted_lengths]
        merged = GenerationStats(draft_lengths=drafted, accepted_lengths=accepted)
        forwards: dict[str, int] = {}
        for s in stats:
            for name, count in s.drafter_forwards.items():
                forwards[name] = forwards.get(name, 0) + count
        tps = _total_tps(method_rows)
        summary = MethodSummary(
            method=label,
            tokens=sum(s.new_tokens for s in stats),
            seconds=sum(s.wall_s for s in stats),
            tokens_per_s=tps,
            speedup=tps / ar_tps if ar_tps else None,
            median_speedup=statistics.median(ar_rows[r.prompt_id].stats.wall_s / r.stats.wall_s
                                             * r.stats.new_tokens / ar_rows[r.prompt_id].stats.new_tokens
                                             for r in method_rows) if ar_rows else None,
            mean_accepted_length=merged.mean_accepted_length,
            acceptance_rate=merged.acceptance_rate,
            acceptance_per_position=merged.acceptance_per_position,
            target_forwards=sum(s.target_forwards for s in stats),
            drafter_forwards=forwards,
            ttft_s=statistics.mean(s.ttft_s for s in stats),
        )
        if ar_rows:
            summary.identical_to_ar = statistics.mean(r.token_ids == ar_rows[r.prompt_id].token_ids for r in method_rows)
            summary.common_prefix_with_ar = statistics.mean(
                common_prefix(r.token_ids, ar_rows[r.prompt_id].token_ids) for r in method_rows)
        summaries.append(summary)
    return summaries


def _total_tps(rows: list[Row]) -> float:
    seconds = sum(r.stats.wall_s for r in rows)
    return sum(r.stats.new_tokens for r in rows) / seconds if seconds else 0.0


def markdown_table(summaries: list[MethodSummary]) -> str:
    def fmt(value: float | None, pattern: str) -> str:
        return "-" if value is None else pattern.format(value)

    lines = ["| method | tok/s | speedup | median speedup | mean accepted length | acceptance | identical to ar | TTFT s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        lines.append(f"| {s.method} | {s.tokens_per_s:.2f} | {fmt(s.speedup, '{:.2f}x')} | "
                     f"{fmt(s.median_speedup, '{:.2f}x')} | {s.mean_accepted_length:.2f} | "
                     f"{fmt(s.acceptance_rate, '{:.0%}')} | {fmt(s.identical_to_ar, '{:.0%}')} | {s.ttft_s:.2f} |")
    return "\n".join(lines)


def to_json(config: dict[str, Any], rows: list[Row], summaries: list[MethodSummary]) -> dict[str, Any]:
    return {
        "config": config,
        "summary": [asdict(s) for s in summaries],
        "rows": [{"prompt_id": r.prompt_id, "method": r.method, "token_ids": r.token_ids,
                  "stats": r.stats.to_dict()} for r in rows],
    }
