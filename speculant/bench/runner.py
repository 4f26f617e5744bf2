"""Run a method matrix fairly: one process, one loaded target per dtype, one warm-up per method, methods
interleaved prompt by prompt and in reverse order every other prompt and repeat (A B, B A: a drift of the machine's
speed weighs on every method alike, with one repeat too), the same seed for every method, wall time around whole
generations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from speculant.api import GenerationResult, generate
from speculant.bench.datasets import Prompt, fitted_ids
from speculant.bench.methods import MethodSpec
from speculant.bench.peers import check_response_format, peer_generate
from speculant.config import SamplingConfig
from speculant.decoding.stats import GenerationStats
from speculant.session import Session
from speculant.methods.drafting import as_keywords, with_drafters
from speculant.models import CausalLM


@dataclass
class Measurement:
    prompt_id: str
    category: str
    method: str
    repeat: int
    target: str  # the target's weights (name and dtype): outputs are comparable only on the same weights
    token_ids: list[int]
    stats: GenerationStats
    text: str | None = None  # what the tokens spell (peers that print text are compared by it)


def target_key(target: CausalLM) -> str:
    return f"{target.name} {target.numerics}"


def run_matrix(
    target_for: Callable[[str | None], CausalLM],
    methods: list[MethodSpec],
    prompts: list[Prompt],
    max_new_tokens: int,
    seed: int = 0,
    sampling: SamplingConfig = SamplingConfig(),
    repeats: int = 1,
    on_row: Callable[[Measurement], None] | None = None,
    isolated: Callable[[MethodSpec, list[int], int, dict[str, Any] | None], GenerationResult] | None = None,
) -> list[Measurement]:
    """Every method on every prompt, interleaved, `repeats` times, every other prompt and repeat in reverse method
    order (prompt i of repeat r when i + r is odd); returns the rows in run order.

    `target_for(dtype, backend)` returns the loaded target in that dtype on that backend (None: the run's
    default); it should load each once, so that all methods share the same weights. With `isolated`,
    speculant's own methods run through it (`speculant.bench.isolated`: a fresh process per generation). A
    prompt's `response_format` goes to every method (`llamacpp-cli-ar` follows JSON ones; other peers: refused).
    """
    for spec in (s for s in methods if s.peer):  # refused now, not after the first prompts ran
        for prompt in prompts:
            check_response_format(spec.method, prompt.response_format)
    sessions: dict[tuple[int, str], Session] = {}  # per target and method: what the method learns, from its own
    # generations only, so that no method finds another's drafter cache holding the prompt or its acceptance learned

    def session_for(target: CausalLM, spec: MethodSpec) -> Session:
        if (id(target), spec.label) not in sessions:
            sessions[id(target), spec.label] = Session(target)
        return sessions[id(target), spec.label]

    pools: dict[str, Any] = {}  # DSI's target servers, started once per method (processes, Ray actors)

    def pool_for(spec: MethodSpec, target: Any) -> Any:
        if spec.label not in pools:
            from speculant.decoding.dsi.executors import make_executor
            from speculant.methods.dsi import server_spec

            servers = server_spec(target, spec.options, spec.sampled(sampling))  # (its twin's padding, its devices)
            pools[spec.label] = make_executor(spec.options.executor, servers, spec.options.ray_address)
            pools[spec.label].start()
        return pools[spec.label]

    def run(spec: MethodSpec, ids: list[int], n: int, response_format: dict[str, Any] | None) -> GenerationResult:
        if isolated is not None and not spec.peer:
            return isolated(spec, ids, n, response_format)
        target = target_for(spec.dtype, spec.backend)
        dtype = getattr(spec.options, "drafter_dtype", None)
        options = with_drafters(spec.options, lambda d: session_for(target, spec).drafter(d, dtype))
        if spec.peer:
            return peer_generate(spec.method, target, ids, n, options, spec.sampled(sampling), seed, response_format)
        if spec.method == "dsi":
            options = replace(options, executor=pool_for(spec, target), ray_address=None)  # (the pool is on it)
        return generate(target, prompt_ids=ids, method=spec.method, max_new_tokens=n, seed=seed,
                        response_format=response_format, session=session_for(target, spec),
                        **as_keywords(spec.sampled(sampling)), **as_keywords(options))

    reference = target_for(None, None)
    encoded = fitted_ids(reference, prompts)
    rows = []
    try:
        for spec in methods:  # warm-up: allocator, caches, lazy initialisation, DSI's servers
            if isolated is None or spec.peer:  # an isolated generation warms its own process up
                # speculant's on the first prompt's tokens reversed, as `bench.isolated` warms up: the same lengths
                # and code paths, and no prefix that the method's drafter caches could carry into its first measured
                # run (a peer keeps nothing across generations, and llama.cpp's tools take text: the prompt itself,
                # whose text they tokenize as speculant does)
                run(spec, encoded[0] if spec.peer else encoded[0][::-1], min(8, max_new_tokens),
                    prompts[0].response_format)
        for repeat in range(repeats):
            for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
                for spec in methods if (repeat + index) % 2 == 0 else methods[::-1]:
                    result = run(spec, ids, max_new_tokens, prompt.response_format)
                    row = Measurement(prompt.id, prompt.category, spec.label, repeat, target_key(target_for(spec.dtype, spec.backend)),
                              result.token_ids, result.stats, result.text)
                    rows.append(row)
                    if on_row:
                        on_row(row)
    finally:
        for pool in pools.values():
            pool.close()
    return rows
