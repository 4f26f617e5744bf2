"""Projections, not measurements: a CPU bench's speculation replayed at a GPU's measured costs. The acceptance is
the CPU run's (the real catalog pair, every tree and forward recorded in each row's stats); the costs are the
compiled static steps' from a lent GPU's `scripts/gpu_static.py` run (random weights of the same shapes, so the same
costs). Each decode's device time is priced as a latency twin prices it: `ar` one compiled x1 step of the target a
token (plain decoding's fastest handle); a speculative method's every target forward ceil(rows / 16) compiled x16
steps (a tree's verify width + 1 rows), every drafter forward one compiled x16 step of the drafter, and the
drafter's prefill of the prompt (run after the first token, so in the decode) ceil(prompt / 16) of them. The host's
work between forwards is left out, so a projected speedup is an upper bound. Stage-scheduled rows would overlap
drafting with verification on a second stream, which is not priced, so they are left out.

    python scripts/gpu_projection.py docs/results/tree-breakdown/results.json [--gpu docs/results/gpu-h200-133a0c1.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict
from pathlib import Path

ROWS = 16  # the compiled steps' width on a GPU
ROOT = Path(__file__).resolve().parent.parent
LATEST = ROOT / "docs" / "results" / "gpu-h200-133a0c1.json"  # the latest lent GPU's run of every section
PRICED = ("qwen2.5-coder-1.5b", ("qwen2.5-coder-0.5b", "default", "maxgram", "suffix"))  # the target and the drafters
# whose steps the GPU's costs price (a model drafter at the 0.5B's cost; Max-Gram and suffix run no forwards)


def step_costs(gpu: dict) -> dict[str, float]:
    """Seconds of a compiled step: the target's (1.5B) at x1 and at x16, the drafter's (0.5B) at x16."""
    compiled = gpu["compiled T(W) ms"]
    return {"target x1": compiled["1.5b compiled x1"]["1"] / 1e3, "target": compiled["1.5b compiled x16"]["16"] / 1e3,
            "drafter": compiled["0.5b compiled x16"]["16"] / 1e3}


def prompt_lengths(config: dict) -> dict[str, int]:
    """Each prompt's tokens as the bench encoded them (the catalog target's tokenizer)."""
    from transformers import AutoTokenizer

    from speculant.api import encode_prompt
    from speculant.bench.datasets import load_dataset
    from speculant.models.loading import gguf_file

    tokenizer = AutoTokenizer.from_pretrained(gguf_file(config["target"]).parent)
    spec = config["prompts"] or config["dataset"]
    here = os.getcwd()
    try:
        os.chdir(ROOT)  # (a bench run in the repository names its prompt files from there)
        prompts = load_dataset(spec)
    finally:
        os.chdir(here)
    return {p.id: len(encode_prompt(tokenizer, p.text, p.chat)) for p in prompts}


def check_priced(results: dict) -> None:
    """Refuse a run these costs do not price: another target, or a method drafting with another model."""
    config = results["config"]
    if config.get("target") != PRICED[0]:
        raise SystemExit(f"the GPU's costs are {PRICED[0]}'s (target) and qwen2.5-coder-0.5b's (drafter): this run's "
                         f"target is {config.get('target')}")
    methods = {row["method"] for row in results["rows"]}
    if "ar" not in methods:
        raise SystemExit("the projection is over `ar`: this run has no `ar` rows")
    from speculant.bench.methods import split_spec
    from speculant.errors import ConfigError
    from speculant.methods.drafting import parse_drafters

    for method in sorted(methods):
        try:  # (the spec's own drafters, as bench reads them)
            given = split_spec(method)[1]
            drafters = [d.source for key in ("drafter", "drafters") for d in parse_drafters(given.get(key, ""))]
        except ConfigError as error:
            raise SystemExit(f"`{method}`: {error}") from None
        if odd := [d for d in drafters if d not in PRICED[1]]:
            raise SystemExit(f"`{method}` drafts with {odd[0]}, which the GPU's costs do not price (they are "
                             "qwen2.5-coder-0.5b's)")


def device_seconds(stats: dict, prompt: int, costs: dict[str, float]) -> float:
    """One decode's device time after its first token at these costs."""
    if not stats["target_steps"]:  # ar: one forward a token after the first
        return (stats["new_tokens"] - 1) * costs["target x1"]
    sizes = stats.get("verified_sizes") or []
    target = sum(math.ceil((size + 1) / ROWS) for size in sizes) + stats["target_steps"] - len(sizes)
    prefills = sum(stats["drafter_forwards"].values()) - sum(stats["drafter_steps"].values())
    drafter = sum(stats["drafter_steps"].values()) + prefills * math.ceil(prompt / ROWS)
    return target * costs["target"] + drafter * costs["drafter"]


def project(rows: list[dict], lengths: dict[str, int], costs: dict[str, float]) -> dict[str, dict]:
    """Per method: the projected decode tokens per second over all its rows, and the ratio to `ar`'s."""
    tokens, seconds = defaultdict(int), defaultdict(float)
    for row in rows:
        stats = row["stats"]
        if stats is None or row["method"].startswith("llamacpp") or "schedule=stage" in row["method"]:
            continue
        tokens[row["method"]] += stats["new_tokens"] - 1
        seconds[row["method"]] += device_seconds(stats, lengths[row["prompt_id"]], costs)
    rate = {method: tokens[method] / seconds[method] for method in tokens}
    return {method: {"tok/s": rate[method], "over ar": rate[method] / rate["ar"]} for method in rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a CPU bench's results.json (with `ar` among its methods)")
    parser.add_argument("--gpu", default=LATEST, type=Path,
                        help=f"a gpu_static.py run's JSON (default: {LATEST.name}, the latest lent GPU's)")
    args = parser.parse_args()
    read = {}
    for path in (args.gpu, args.results):
        try:
            read[path] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise SystemExit(f"cannot read {path}: {error}") from None
    gpu, results = read[args.gpu], read[args.results]
    if not (isinstance(results, dict) and isinstance(results.get("config"), dict)
            and isinstance(results.get("rows"), list)):
        raise SystemExit(f"{args.results} is not a bench run's results.json (its config and rows)")
    try:
        costs = step_costs(gpu)
    except (KeyError, TypeError):
        raise SystemExit(f"{args.gpu} holds no compiled T(W) of the 1.5B at x1 and x16 and the 0.5B at x16: not a "
                         "scripts/gpu_static.py run's JSON") from None
    check_priced(results)
    print(f"projected on {gpu['device']} (ms of a compiled step: target x1 {costs['target x1'] * 1e3:.2f}, target "
          f"x16 {costs['target'] * 1e3:.2f}, drafter x16 {costs['drafter'] * 1e3:.2f}; device time only)\n")
    print("| method | projected decode tok/s | over `ar` |\n|---|---|---|")
    for method, row in project(results["rows"], prompt_lengths(results["config"]), costs).items():
        print(f"| `{method}` | {row['tok/s']:.0f} | {row['over ar']:.2f}x |")


if __name__ == "__main__":
    main()
