"""Run a method matrix fairly: one process, one loaded target, one warm-up per method, methods
interleaved prompt by prompt, the same seed for every method, wall time around whole generations."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from speculant.api import GenerationResult, encode_prompt, generate, load_drafter
from speculant.bench.datasets import Prompt
from speculant.bench.methods import MethodSpec
from speculant.bench.peers import hf_generate
from speculant.config import SamplingConfig
from speculant.decoding.dsi.executors import ServerSpec, make_executor, replica_factory
from speculant.decoding.stats import GenerationStats
from speculant.drafters.base import Drafter
from speculant.drafters.model import common_prefix_len
from speculant.models import CausalLM

T = TypeVar("T", int, float)


@dataclass
class Row:
    prompt_id: str
    category: str
    method: str
    repeat: int
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
    cost_ratios: dict[str, float] = field(default_factory=dict)  # measured c per drafter
    swi: float | None = None  # standardized wall-time improvement with those c (CS Drafting, section 5)
    ttft_s: float = 0.0
    identical_to_ar: float | None = None  # share of prompts whose output equals ar's
    common_prefix_with_ar: float | None = None  # mean tokens in common with ar before the first difference


def run_matrix(
    target_for: Callable[[str | None], CausalLM],
    methods: list[MethodSpec],
    prompts: list[Prompt],
    max_new_tokens: int,
    seed: int = 0,
    temperature: float = 0.0,
    repeats: int = 1,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Every method on every prompt, interleaved, `repeats` times; returns the rows in run order.

    `target_for(dtype)` returns the loaded target in that dtype (None: the run's default); it should
    load each dtype once, so that all methods share the same weights.
    """
    loaded: dict[tuple[str, str | None, str | None], CausalLM | Drafter] = {}

    def drafters_for(spec: MethodSpec) -> list[CausalLM | Drafter]:
        for name in spec.sources:
            key = (name, spec.target_dtype, spec.drafter_dtype)
            if key not in loaded:
                loaded[key] = load_drafter(name, target_for(spec.target_dtype), spec.drafter_dtype)
        return [loaded[name, spec.target_dtype, spec.drafter_dtype] for name in spec.sources]

    pools: dict[str, Any] = {}  # DSI's target servers, started once per method (processes, Ray actors)

    def pool_for(spec: MethodSpec, target: Any) -> Any:
        if spec.label not in pools:
            sampling = SamplingConfig(temperature)
            spec_ = ServerSpec(replica_factory(target), [str(target.device)] * spec.servers, sampling)
            pools[spec.label] = make_executor(spec.executor, spec_)
            pools[spec.label].start()
        return pools[spec.label]

    def run(spec: MethodSpec, ids: list[int], n: int) -> GenerationResult:
        target = target_for(spec.target_dtype)
        drafters = drafters_for(spec)
        if spec.method.startswith("hf-"):
            return hf_generate(spec.method, target, ids, n, spec.k, drafters[0] if drafters else None, temperature, seed)
        options: dict[str, Any] = {"k": spec.k} if spec.k is not None else {}
        if spec.method == "cascade":
            options.update(drafters=drafters, k_matrix=spec.k_matrix, leniency=spec.leniency)
        elif drafters:
            options["drafter"] = drafters[0]
        if spec.method == "tree":
            options.update(verify_width=spec.verify_width, target_profile=spec.profile)
        if spec.method == "dsi":
            options.update(servers=spec.servers, lookahead=spec.lookahead, executor=pool_for(spec, target))
        return generate(target, prompt_ids=ids, method=spec.method, draft_confidence=spec.draft_confidence,
                        depth=spec.depth, width=spec.width, max_new_tokens=n, temperature=temperature, seed=seed, **options)

    encoded = [encode_prompt(target_for(None).tokenizer, p.text, p.chat) for p in prompts]
    rows = []
    try:
        for spec in methods:  # warm-up: allocator, caches, lazy initialisation, DSI's servers
            run(spec, encoded[0], min(8, max_new_tokens))
        for repeat in range(repeats):
            for prompt, ids in zip(prompts, encoded):
                for spec in methods:
                    result = run(spec, ids, max_new_tokens)
                    row = Row(prompt.id, prompt.category, spec.label, repeat, result.token_ids, result.stats)
                    rows.append(row)
                    if on_row:
                        on_row(row)
    finally:
        for pool in pools.values():
            pool.close()
    return rows


def summarize(rows: list[Row], methods: list[MethodSpec]) -> list[MethodSummary]:
    by_method = {spec.label: [r for r in rows if r.method == spec.label] for spec in methods}
    ar_specs = [spec for spec in methods if spec.method == "ar"]
    baseline = ar_specs[0].label if ar_specs else None  # speedups are over the first ar listed
    ar_rows = {(r.prompt_id, r.repeat): r for r in by_method.get(baseline, [])} if baseline else {}
    ar_tps = _total_tps(by_method[baseline]) if baseline else None
    summaries = []
    for spec in methods:
        label, method_rows = spec.label, by_method[spec.label]
        # Agreement is checked against ar on the same target weights (same dtype) when the run has it.
        reference = next((a.label for a in ar_specs if a.target_dtype == spec.target_dtype), baseline)
        same_weights_ar = {(r.prompt_id, r.repeat): r for r in by_method.get(reference, [])} if reference else {}
        stats = [r.stats for r in method_rows]
        drafted = [d for s in stats for d in s.draft_lengths]
        accepted = [a for s in stats for a in s.accepted_lengths]
        merged = GenerationStats(
            new_tokens=sum(s.new_tokens for s in stats), target_forwards=sum(s.target_forwards for s in stats),
            target_steps=sum(s.target_steps for s in stats), target_seconds=sum(s.target_seconds for s in stats),
            drafter_forwards=_add_up(s.drafter_forwards for s in stats), drafter_steps=_add_up(s.drafter_steps for s in stats),
            drafter_seconds=_add_up(s.drafter_seconds for s in stats), draft_lengths=drafted, accepted_lengths=accepted)
        tps = _total_tps(method_rows)
        summary = MethodSummary(
            method=label,
            tokens=sum(s.new_tokens for s in stats),
            seconds=sum(s.wall_s for s in stats),
            tokens_per_s=tps,
            speedup=tps / ar_tps if ar_tps else None,
            median_speedup=statistics.median(_speed(r) / _speed(ar_rows[r.prompt_id, r.repeat])
                                             for r in method_rows) if ar_rows else None,
            mean_accepted_length=merged.mean_accepted_length,
            acceptance_rate=merged.acceptance_rate,
            acceptance_per_position=merged.acceptance_per_position,
            target_forwards=merged.target_forwards,
            drafter_forwards=merged.drafter_forwards,
            cost_ratios=merged.cost_ratios,
            swi=merged.swi,
            ttft_s=statistics.mean(s.ttft_s for s in stats),
        )
        if same_weights_ar:
            summary.identical_to_ar = statistics.mean(
                r.token_ids == same_weights_ar[r.prompt_id, r.repeat].token_ids for r in method_rows)
            summary.common_prefix_with_ar = statistics.mean(
                common_prefix_len(r.token_ids, same_weights_ar[r.prompt_id, r.repeat].token_ids) for r in method_rows)
        summaries.append(summary)
    return summaries


def _add_up(counts: Iterable[dict[str, T]]) -> dict[str, T]:
    total: dict[str, Any] = {}
    for count in counts:
        for name, value in count.items():
            total[name] = total.get(name, 0) + value
    return total


def _speed(row: Row) -> float:
    return row.stats.new_tokens / row.stats.wall_s


def _total_tps(rows: list[Row]) -> float:
    seconds = sum(r.stats.wall_s for r in rows)
    return sum(r.stats.new_tokens for r in rows) / seconds if seconds else 0.0


def summarize_by_category(rows: list[Row], methods: list[MethodSpec]) -> dict[str, list[MethodSummary]]:
    """The same summaries within each prompt category (only when there is more than one)."""
    categories = sorted({r.category for r in rows})
    if len(categories) < 2:
        return {}
    return {c: summarize([r for r in rows if r.category == c], methods) for c in categories}


def to_json(config: dict[str, Any], rows: list[Row], summaries: list[MethodSummary],
            by_category: dict[str, list[MethodSummary]]) -> dict[str, Any]:
    return {
        "config": config,
        "summary": [asdict(s) for s in summaries],
        "by_category": {c: [asdict(s) for s in summary] for c, summary in by_category.items()},
        "rows": [{"prompt_id": r.prompt_id, "category": r.category, "method": r.method, "repeat": r.repeat,
                  "token_ids": r.token_ids,
                  "stats": r.stats.to_dict()} for r in rows],
    }
