"""`speculant generate`: one prompt decoded, its text streamed as it is committed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from speculant.cache import is_file, read_text, readable
from speculant.cli.checks import check_target, resolve_method
from speculant.config import (
    ModelConfig,
    RunConfig,
    SamplingConfig,
    check_sampled,
    flag,
    from_args,
    from_flags,
    reach_ray,
)
from speculant.drafters.spec import model_free
from speculant.errors import ConfigError
from speculant.methods.drafting import held_drafters, takes_model_free, with_default_drafter
from speculant.methods.registry import all_options, get_method


def read_constraint(schema: str | None, grammar: str | None) -> Any:
    """The structured output `generate --json-schema/--grammar` asks for (None: free text); a ConfigError for a
    file that is missing or not JSON."""
    from speculant.models.wrappers.constrained import MAX_GRAMMAR_CHARS, Constraint

    path = schema or grammar
    if path is None:
        return None
    try:
        text = read_text(readable(path, f"{'schema' if schema else 'grammar'} file"), 4 * MAX_GRAMMAR_CHARS)
    except (OSError, ValueError) as error:  # (not UTF-8, or longer than any grammar compiled)
        raise ConfigError(f"cannot read {path} as text: {error}") from None
    if grammar:
        return Constraint("grammar", text)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ConfigError(f"{path} is not JSON: {type(error).__name__}: {error}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds no JSON schema object")
    return Constraint("json_schema", value)


def run_generate(args: argparse.Namespace) -> None:
    from speculant.api import check_models, check_prompt, check_request, generate
    from speculant.drafters.spec import MAXGRAM, DrafterSpec
    from speculant.session import Session
    from speculant.methods.drafting import as_keywords, with_drafters
    from speculant.models import load_model

    given = {name: getattr(args, name) for name in all_options() if getattr(args, name) is not None}
    method = get_method(from_flags(lambda: resolve_method(args.method, given), all_options()))
    options = from_flags(lambda: method.parse_options(given), all_options())
    sampling = from_args(SamplingConfig, args)
    check_sampled(sampling, args.given, flag)
    method.check_verifier(args.given, flag)
    run = from_args(RunConfig, args)
    model_config = from_args(ModelConfig, args)
    if not args.prompt.strip():
        raise ConfigError("the prompt is empty")
    check_prompt(args.prompt)  # (bytes the shell passed that are not UTF-8: Python keeps them as lone surrogates)
    check_models([args.target], held_drafters(options), takes_model_free(options))
    options = from_flags(lambda: with_default_drafter(options, args.target), all_options())
    sources = held_drafters(options)
    check_target(args.target, model_config, options)
    own = method.name == "auto" and options.drafters is None  # auto's own drafters: Max-Gram among them
    if args.bigram_corpus and not own and not any(isinstance(d, DrafterSpec) and d.kind == MAXGRAM for d in sources):
        raise ConfigError("--bigram-corpus applies to the maxgram drafter only")
    files = [readable(f, "bigram corpus file") for f in args.bigram_corpus or []]
    if empty := [str(f) for f in files if is_file(f) and f.stat().st_size == 0]:  # (a pipe's size is not known)
        raise ConfigError(f"bigram corpus file is empty: {', '.join(empty)}")
    if args.timeline and method.name != "dsi":
        raise ConfigError("--timeline applies to --method dsi only")
    constraint = read_constraint(args.json_schema, args.grammar)
    check_request(method.name, None, None, constraint)
    if getattr(options, "executor", None) == "ray":
        reach_ray(options.ray_address, "--ray-address")

    print(f"loading target {args.target} (backend {model_config.backend}, dtype {model_config.dtype}, "
          f"{model_config.device})", file=sys.stderr)
    target = load_model(args.target, dtype=model_config.dtype, device=model_config.device,
                        backend=model_config.backend, compile=model_config.compile)
    print(f"target {target.name}: {target.numerics}, {target.kernel} kernel", file=sys.stderr)
    session = Session(target)

    def load(drafter: Any) -> Any:
        if isinstance(drafter, DrafterSpec) and drafter.kind == MAXGRAM and files:
            from speculant.drafters.maxgram import MaxGramDrafter, load_bigram

            return MaxGramDrafter(load_bigram(target.tokenizer, target.vocab_size, files))
        if isinstance(drafter, DrafterSpec) and not model_free(drafter):
            print(f"loading drafter {drafter}", file=sys.stderr)
        return session.drafter(drafter, getattr(options, "drafter_dtype", None))

    if files and own:
        from speculant.methods.auto import with_own_drafters

        options = with_own_drafters(options, target)
    options = with_drafters(options, load)
    stream = generate(target, args.prompt, method=method.name, max_new_tokens=run.max_new_tokens, seed=run.seed,
                      stream=True, chat=args.chat, response_format=constraint, session=session,
                      **as_keywords(sampling), **as_keywords(options))
    if args.json:
        for _ in stream:
            pass
    else:
        from speculant.serve.text import TextStream

        text = TextStream(target.tokenizer)
        try:
            for token in stream:
                sys.stdout.write(text.push(token))
                sys.stdout.flush()
        except BaseException as error:
            if text.sent and not isinstance(error, BrokenPipeError):  # (an error's line, or the shell's prompt,
                print(flush=True)  # starts on a line of its own)
            raise
        sys.stdout.write(text.flush() + "\n")
    result = stream.result
    assert result is not None
    if args.json:
        print(json.dumps({"target": args.target, "dtype": target.numerics, "kernel": target.kernel,
                          "method": method.name, "drafters": list(map(str, sources)),
                          "text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict()},
                         indent=1))
    print(result.stats.summary(), file=sys.stderr)
    compiled = target.compile_seconds()
    if compiled is not None:  # the static backend's first compiled step (inductor caches it for later runs)
        print(f"compiled the step in {compiled:.1f} s (its first call; inductor's cache keeps it for later runs)",
              file=sys.stderr)
    if args.timeline and result.stats.dsi is not None:
        from speculant.decoding.dsi.timeline import plot_timeline

        print(f"wrote {plot_timeline(result.stats.dsi, Path(args.timeline))}", file=sys.stderr)

