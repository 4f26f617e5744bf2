"""One generation in a process of its own (`speculant bench --isolate`): speculant's methods measured as
llama.cpp's tools are, a fresh process per generation with a warm-up generation first (on other tokens), and
as a user meets them (`speculant generate` is a process of its own). On a shared VM a long-lived process that has
loaded several models decodes slower than a fresh process running the same code (docs/results/cpu.md), which would
count against whichever side runs in the bench's own process."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from typing import Any

from speculant.errors import ConfigError, SpeculantError

TIMEOUT_S = 1800  # one generation, the model's loading included
REFUSED = 2  # the exit status of a generation speculant refused (a SpeculantError), its message the last line


def isolated_generate(request: dict[str, Any]) -> Any:
    """Run `request` (see `main`) in a fresh Python process; its GenerationResult."""
    from speculant.api import GenerationResult
    from speculant.decoding.stats import GenerationStats

    done = subprocess.run([sys.executable, "-m", "speculant.bench.isolated"], input=json.dumps(request),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode == REFUSED:  # speculant refused the request there: its one line
        said = done.stderr.strip().splitlines() or ["no message"]
        raise ConfigError(f"{said[-1]} (in the isolated generation of {request['method']})")
    if done.returncode != 0:
        raise RuntimeError(f"an isolated generation of {request['method']} failed: {done.stderr.strip()[-400:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return GenerationResult(out["token_ids"], out["text"], GenerationStats.from_dict(out["stats"]))


def main() -> None:
    """Read {target, dtype, device, backend, method (a bench method spec), prompt_ids, max_new_tokens,
    temperature, top_k, top_p, verifier, seed, response_format} from stdin; load, warm up, generate; print the result as
    one JSON line."""
    from speculant.api import generate
    from speculant.bench.methods import parse_method
    from speculant.config import sampling_of
    from speculant.methods.drafting import as_keywords, with_drafters
    from speculant.models import load_model
    from speculant.session import Session

    request = json.loads(sys.stdin.read())
    spec = parse_method(request["method"])
    target = load_model(request["target"], dtype=spec.dtype or request["dtype"], device=request["device"],
                        backend=spec.backend or request["backend"],
                        compile=request.get("compile", False) and (spec.backend or request["backend"]) == "static")
    session = Session(target)
    options = with_drafters(spec.options, lambda d: session.drafter(d, getattr(spec.options, "drafter_dtype", None)))
    ids, n = request["prompt_ids"], request["max_new_tokens"]
    run = sampling_of(request)
    asked = {**as_keywords(spec.sampled(run)), "seed": request.get("seed"),  # (the method's own settings in place)
             "response_format": request.get("response_format")}
    # The warm-up runs the prompt's tokens reversed: the same lengths and code paths, and no prefix that a cache
    # kept across generations (auto's drafters keep theirs) could carry into the measured run.
    generate(target, prompt_ids=ids[::-1], method=spec.method, max_new_tokens=min(8, n), session=session, **asked,
             **as_keywords(options))
    result = generate(target, prompt_ids=ids, method=spec.method, max_new_tokens=n, session=session, **asked,
                      **as_keywords(options))
    stats = {**asdict(result.stats), "dsi": None}
    print(json.dumps({"token_ids": result.token_ids, "text": result.text, "stats": stats}))


if __name__ == "__main__":
    try:
        main()
    except SpeculantError as error:  # (one line, as the CLI gives it)
        print(" ".join(line.strip() for line in str(error).splitlines()), file=sys.stderr)
        sys.exit(REFUSED)
