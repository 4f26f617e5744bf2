"""`dsi`: distributed speculative inference (Timor et al. 2025, Algorithm 1 with lookahead): target
servers verify in parallel while the drafter keeps drafting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from speculant.cache import readable
from speculant.config import (EXECUTORS, LEAST_LATENCY_MS, MOST_LATENCY_MS, MOST_SERVERS, REQUEST_MOST, as_number,
                              check_ray_address, latency_fits, number, option)
from speculant.drafters.spec import model_free
from speculant.errors import ConfigError, OptionError
from speculant.methods.drafting import DrafterOptions, as_drafters, parse_drafters
from speculant.methods.registry import Request, register


def drafts_with_a_model(options: DSIOptions) -> bool:
    """Whether a model drafts (it then needs cores beside the servers) rather than a registered drafter (Max-Gram)
    or a Drafter object."""
    from speculant.drafters.base import Drafter

    return any(not (isinstance(d, Drafter) or model_free(d)) for d in options.drafters or (options.drafter,))


def drafter_pads(twin: Any, drafters: int) -> tuple[Any, ...]:
    """The twin's drafter latency for each of `drafters` drafters (one given: the same for each; None: no twin)."""
    if twin is None:
        return (None,) * drafters
    return twin[1] * drafters if len(twin[1]) == 1 else twin[1]


def parse_devices(text: str) -> tuple[str, ...]:
    return tuple(device for device in text.split(",") if device)


def parse_twin(text: str) -> tuple[Any, Any]:
    """`30,3` or `30,3,120` (target TPOT, drafter, target TTFT in ms; with several drafters, one drafter
    latency each: `30,1/5`), or two `speculant profile` JSONs `target.json,drafter.json` (TTFT, TPOT and
    T(W) each) -> (target Latency, drafter Latency or a tuple of them)."""
    from speculant.decoding.dsi.twin import Latency
    from speculant.latency import LatencyProfile

    parts = text.split(",")
    if len(parts) == 2 and all(part.endswith(".json") for part in parts):
        target, drafter = (Latency.from_profile(LatencyProfile.load(readable(part, "profile"))) for part in parts)
        return target, drafter
    try:
        values = [number(v) for v in parts[:1] + parts[2:]]
        drafters = [number(v) for v in parts[1].split("/")] if len(parts) > 1 else []
    except ValueError:
        values = drafters = []
    zero = values[1:] + drafters  # (a TTFT and a drafter's latency may be 0)
    if len(values) not in (1, 2) or not drafters or not all(map(latency_fits, values[:1] + [v for v in zero if v])):
        raise ConfigError(f"twin takes T,D or T,D,TTFT in ms (numbers from {LEAST_LATENCY_MS:g} to {MOST_LATENCY_MS}; "
                          f"D and TTFT may be 0; D1/D2/.. for several drafters), got '{text}'")
    latencies = tuple(Latency.from_ms(d) for d in drafters)
    return (Latency.from_ms(values[0], values[1] if len(values) == 2 else None),
            latencies[0] if len(latencies) == 1 else latencies)


@dataclass(frozen=True)
class DSIOptions(DrafterOptions):
    EITHER = (("drafter", "drafters"),)  # one or the other, the second where given (`registry.parse_values`)

    drafters: Any = option(None, "several drafters of increasing cost instead of one, e.g. maxgram,qwen2.5-coder-0.5b@int4: "
                           "each drafts at its own pace and a costlier one's draft replaces a cheaper one's (DSI's "
                           "Algorithm 1 with m > 2 models); the first sets the lookahead", parse=parse_drafters)
    servers: int = option(1, "target servers verifying in parallel (the speculation-parallelism degree)", operator=True)
    lookahead: int | None = option(None, "drafts per verification job (default: the smallest the servers keep up "
                                   "with, planned from the latencies)", most=REQUEST_MOST)
    executor: Any = option("thread", "where target servers run: thread, process or ray (or a started executor; "
                           "process from a script: under `if __name__ == '__main__':`, as Python's spawned processes "
                           "import the script again)", operator=True)
    target_devices: Any = option(None, "one device per target server, e.g. cpu,cpu or cuda:0,cuda:1 (default: the "
                                 "target's device for each)", parse=parse_devices, operator=True)
    twin_latency: Any = option(None, "latency twin: pad every target forward to T ms (its first to TTFT) and every "
                               "drafter forward (a drafted token, for a drafter that runs no model) to D ms: "
                               "T,D[,TTFT], or TARGET.json,DRAFTER.json (speculant profile files)",
                               parse=parse_twin, operator=True)
    ray_address: str | None = option(None, "with executor ray: join this cluster (default: start one)", operator=True)

    @property
    def target_needs(self) -> tuple[tuple[str, str, str], ...]:
        """The target's capabilities these options need (`drafting.needs`): replicas for the target servers, unless
        a started executor brings servers of its own."""
        if not isinstance(self.executor, str):
            return ()
        return (("replicates", "DSI needs replicas of the target for its target servers", "method"),)

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafters", as_drafters(self.drafters))
        super().__post_init__()
        if not 1 <= self.servers <= MOST_SERVERS:
            raise OptionError("servers", f"servers must be in 1..{MOST_SERVERS}, got {self.servers}")
        if self.lookahead is not None and self.lookahead < 1:
            raise OptionError("lookahead", f"lookahead must be >= 1, got {self.lookahead}")
        if isinstance(self.executor, str) and self.executor not in EXECUTORS:
            raise OptionError("executor", f"unknown executor '{self.executor}' (choose from {', '.join(EXECUTORS)})")
        if not isinstance(self.executor, str) and not hasattr(self.executor, "spec"):
            raise OptionError("executor", f"executor is one of {', '.join(EXECUTORS)} or a started executor "
                              f"(`decoding.dsi.executors`), not {self.executor!r}")
        if self.ray_address is not None and self.executor != "ray":
            raise ConfigError("ray_address names a Ray cluster: give 'executor' ray with it")
        check_ray_address(self.ray_address, "ray_address")
        if isinstance(self.target_devices, str):
            object.__setattr__(self, "target_devices", parse_devices(self.target_devices))
        if self.target_devices is not None and not (isinstance(self.target_devices, (list, tuple)) and
                                                    all(isinstance(d, str) for d in self.target_devices)):
            raise OptionError("target_devices",
                              "target_devices is a list of devices (cpu, cuda:N) or one text of them, comma "
                              f"separated, not {self.target_devices!r}")
        if self.target_devices is not None and len(self.target_devices) != self.servers:
            raise ConfigError(f"{len(self.target_devices)} target devices given for {self.servers} servers")
        if self.target_devices is not None:  # (here, so that a device that is not there is refused before loading)
            from speculant.models import resolve_device

            for device in self.target_devices:
                resolve_device(device)
        if self.drafters is not None and len(self.drafters) < 1:
            raise ConfigError("drafters needs at least one drafter")
        if isinstance(self.twin_latency, (tuple, list)) and all(as_number(ms) is not None for ms in self.twin_latency):
            object.__setattr__(self, "twin_latency", ",".join(str(as_number(ms)) for ms in self.twin_latency))  # (ms)
        if isinstance(self.twin_latency, str):
            object.__setattr__(self, "twin_latency", parse_twin(self.twin_latency))
        twin = self.twin_latency
        if isinstance(twin, tuple) and len(twin) == 2 and not isinstance(twin[1], tuple):
            twin = (twin[0], (twin[1],))  # (kept as the target's latency and a tuple of the drafters')
            object.__setattr__(self, "twin_latency", twin)
        if twin is not None and not (isinstance(twin, tuple) and len(twin) == 2 and hasattr(twin[0], "step_s") and all(
                hasattr(pad, "step_s") for pad in twin[1])):
            raise OptionError("twin_latency",
                              f"twin_latency is text ('30,3'), milliseconds ((30, 3)) or a pair of Latency objects "
                              f"(the second may be a tuple of them, one per drafter), not {twin!r}")
        if twin is not None:
            drafters = len(self.drafters or (self.drafter,))
            if len(twin[1]) not in (1, drafters):
                raise OptionError("twin_latency",
                                  f"twin latency gives {len(twin[1])} drafter latencies for {drafters} drafter(s)")
            from speculant.decoding.dsi.plan import plan  # (before anything loads: the plan the twin's latencies refuse)

            plan(self.servers, self.lookahead, twin[0].step_s, twin[1][0].step_s)


@register("dsi", DSIOptions, "distributed speculative inference: servers verify while the drafter drafts on")
def build(request: Request, options: DSIOptions) -> Any:
    """DSI over `servers` target servers on `target_devices`, run by `executor`, with one drafter or several
    (`drafters`); with `twin_latency` (target, drafter latencies) every forward is padded to them. The
    lookahead is planned from the twin's latencies, or from one measured forward of the target and of the
    first drafter, unless given. A started executor (`decoding.dsi.executors`) runs
    the servers instead and stays open for the next generation."""
    from speculant.decoding.dsi.engine import dsi
    from speculant.decoding.dsi.executors import make_executor, target_key
    from speculant.decoding.dsi.plan import measure_step, plan
    from speculant.decoding.dsi.twin import PacedDrafter, PaddedModel
    from speculant.decoding.run import ending
    from speculant.drafters.base import Drafter
    from speculant.drafters.cross_vocab import model_drafter
    from speculant.sampling import seeded

    target, twin = request.target, options.twin_latency
    names = options.drafters or (options.drafter,)
    pads = drafter_pads(twin, len(names))
    drafters, costs, sources, begun, models = [], [], [], [], []
    for index, (name, pad) in enumerate(zip(names, pads)):
        source = request.session.drafter(name, options.drafter_dtype)
        if not isinstance(source, Drafter) and any(source is other for other in sources):
            raise ConfigError(f"drafters: {source.name} is given twice (each drafter drafts on a thread of its own, "
                              "from its own model's cache)")
        sources.append(source)
        if isinstance(source, Drafter):  # Max-Gram and other model-free drafters cost next to nothing, but in the twin
            begun.append(source.begin(request.prompt_ids))
            drafters.append(begun[-1] if pad is None or not pad.step_s else PacedDrafter(begun[-1], pad))
            costs.append(0.0 if pad is None else pad.step_s)
            models.append(None)
            continue
        source = source.beside(options.servers)
        # each drafter thread its own stream (a generator's seed is 64 bits: the largest seed a request gives wraps)
        seed = None if request.seed is None else (request.seed + 1 + index) % 2**64
        drafts_from = request.session.cache(source) if pad is None else PaddedModel(source, pad)
        models.append(source if pad is None else drafts_from)
        drafters.append(model_drafter(drafts_from, target, request.sampling, seeded(target.device, seed),
                                      pairs=request.session.vocab_pairs))
        costs.append(pad.step_s if pad is not None else None)
    if twin is not None:
        target_s, drafter_s = twin[0].step_s, costs[0]
    elif options.lookahead is None:
        target_s = measure_step(target, request.prompt_ids)
        drafter_s = costs[0]
        if drafter_s is None:  # timed on its own tokens of the prompt (another vocabulary: the text re-tokenized)
            own = drafters[0].own_ids(request.prompt_ids)
            drafter_s = measure_step(sources[0], own) if own else target_s
            if not isinstance(sources[0], Drafter):
                request.session.cache(sources[0]).forget()
    else:
        target_s = drafter_s = None
    lookahead = plan(options.servers, options.lookahead, target_s, drafter_s).lookahead
    common = (drafters, request.prompt_ids, request.max_new_tokens, lookahead, request.sampling,
              request.generator, target.eos_token_ids)
    if not isinstance(options.executor, str):  # servers already running, kept for the next generation
        pool = options.executor
        built = pool.spec.target != ""  # (by `server_spec`; a pool of one's own ServerSpec may pad as it likes)
        for differs, what in ((built and pool.spec.target != target_key(target), "another target"),
                              (pool.spec.sampling != request.sampling, "other sampling settings"),
                              (len(pool.spec.devices) != options.servers, "another server count"),
                              (options.target_devices is not None and list(options.target_devices) != pool.spec.devices,
                               "other target_devices"),
                              ((built or twin) and pool.spec.latency != (twin[0] if twin else None),
                               "another twin_latency")):
            if differs:
                raise ConfigError(f"the given executor's servers were built for {what}")
        return ending(dsi(pool, *common, close_executor=False, drafter_models=models), begun, request.prompt_ids)
    servers = make_executor(options.executor, server_spec(target, options, request.sampling), options.ray_address)
    return ending(dsi(servers, *common, drafter_models=models), begun, request.prompt_ids)


def server_spec(target: Any, options: DSIOptions, sampling: Any) -> Any:
    """The target servers `options` ask for (`decoding.dsi.executors.ServerSpec`): `servers` replicas of `target` on
    `target_devices` (default: the target's device), sampling as `sampling`, each forward padded to the twin's target
    latency where `twin_latency` is given. What `build` starts per generation, and a bench run once per method."""
    from speculant.decoding.dsi.executors import ServerSpec, replica_factory, target_key

    devices = list(options.target_devices or [str(target.device)] * options.servers)
    twin = options.twin_latency
    return ServerSpec(replica_factory(target, len(devices), drafts_with_a_model(options)), devices, sampling,
                      twin[0] if twin else None, target=target_key(target))
