"""`speculant serve`: the OpenAI-compatible server, started."""

from __future__ import annotations

import argparse
import os

from speculant.cli.checks import check_listen, check_target, resolve_method
from speculant.config import API_KEY_ENV, BACKENDS, ModelConfig, ServeConfig, from_args, from_flags
from speculant.errors import ConfigError
from speculant.methods.drafting import held_drafters, takes_model_free, with_default_drafter
from speculant.methods.registry import all_options, get_method


def run_serve(args: argparse.Namespace) -> None:
    from speculant.api import check_models
    from speculant.models.backends import capabilities_of
    from speculant.serve import serving_backend

    if args.api_key is None and API_KEY_ENV in os.environ:  # (`ps` shows a flag's value to any user; set but
        # empty, as a secret that failed to load: refused, not a server without a key)
        args.api_key = os.environ[API_KEY_ENV]
    config = from_args(ServeConfig, args)
    if "replica_cpus" in args.given and not config.on_ray:
        raise ConfigError("--replica-cpus applies to Ray Serve replicas: with --replicas above 1 or --ray-cluster")
    model_config = from_args(ModelConfig, args)
    given = {name: getattr(args, name) for name in all_options() if getattr(args, name) is not None}
    method = get_method(from_flags(lambda: resolve_method(args.method, given), all_options()))
    options = from_flags(lambda: method.parse_options(given), all_options())
    check_models([args.target], held_drafters(options), takes_model_free(options))
    options = from_flags(lambda: with_default_drafter(options, args.target), all_options())
    backend = check_target(args.target, model_config, options, serving_backend(model_config))
    if "prefix_cache_mb" in args.given and config.prefix_cache_mb and not capabilities_of(backend).reuses_prefixes:
        raise ConfigError(f"--prefix-cache-mb: the {backend} backend keeps no prompts' KV for reuse (backends that "
                          f"do: {', '.join(b for b in BACKENDS if capabilities_of(b).reuses_prefixes)})")
    served_name = config.served_name or args.target
    if config.own_ray:  # (on a cluster, its own HTTP proxy binds the port, maybe on another node)
        check_listen(config.host, config.port)
    if config.on_ray:
        from speculant.serve.replicas import serve_replicas

        serve_replicas(args.target, model_config, method.name, options, config, served_name)
    else:
        from speculant.serve.app import serve

        serve(args.target, model_config, method.name, options, config, served_name)

