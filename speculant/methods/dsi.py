"""`dsi`: distributed speculative inference (Timor et al. 2025, Algorithm 1 with lookahead): target
servers verify in parallel while the drafter keeps drafting."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculant.config import EXECUTORS, option
from speculant.errors import ConfigError
from speculant.methods.drafting import DrafterOptions
from speculant.methods.registry import Request, register


def parse_devices(text: str) -> tuple[str, ...]:
    return tuple(device for device in text.split(",") if device)


def parse_twin(text: str) -> tuple[Any, Any]:
    """`30,3` or `30,3,120` (target TPOT, drafter, target TTFT in ms), or two `speculant profile` JSONs
    `target.json,drafter.json` (TTFT, TPOT and T(W) each) -> (target, drafter) Latency."""
    from speculant.decoding.dsi.twin import Latency
    from speculant.latency import LatencyProfile

    parts = text.split(",")
    if len(parts) == 2 and all(part.endswith(".json") for part in parts):
        if missing := [part for part in parts if not Path(part).is_file()]:
            raise ConfigError(f"profile not found: {', '.join(missing)}")
        target, drafter = (Latency.from_profile(LatencyProfile.load(Path(part))) for part in parts)
        return target, drafter
    try:
        values = [float(v) for v in parts]
    except ValueError:
        values = []
    if len(values) not in (2, 3) or min(values) < 0:
        raise ConfigError(f"twin takes T,D or T,D,TTFT in ms (numbers >= 0), got '{text}'")
    return Latency.from_ms(values[0], values[2] if len(values) == 3 else None), Latency.from_ms(values[1])


@dataclass(frozen=True)
class DSIOptions(DrafterOptions):
    servers: int = option(1, "target servers verifying in parallel (the speculation-parallelism degree)")
    lookahead: int | None = option(None, "drafts per verification job (default: the smallest the servers keep up "
                                   "with, planned from the latencies)")
    executor: Any = option("thread", "where target servers run: thread, process or ray (or a started executor)")
    target_devices: Any = option(None, "one device per target server, e.g. cpu,cpu or cuda:0,cuda:1 (default: the "
                                 "target's device for each)", parse=parse_devices)
    twin_latency: Any = option(None, "latency twin: pad every target forward to T ms (its first to TTFT) and every drafter "
                       "forward to D ms: T,D[,TTFT], or TARGET.json,DRAFTER.json (speculant profile files)",
                       parse=parse_twin)
    ray_address: str | None = option(None, "with executor ray: join this cluster (default: start one)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.servers < 1:
            raise ConfigError(f"servers must be >= 1, got {self.servers}")
        if self.lookahead is not None and self.lookahead < 1:
            raise ConfigError(f"lookahead must be >= 1, got {self.lookahead}")
        if isinstance(self.executor, str) and self.executor not in EXECUTORS:
            raise ConfigError(f"unknown executor '{self.executor}' (choose from {', '.join(EXECUTORS)})")
        if isinstance(self.target_devices, str):
            object.__setattr__(self, "target_devices", parse_devices(self.target_devices))
        if self.target_devices is not None and len(self.target_devices) != self.servers:
            raise ConfigError(f"{len(self.target_devices)} target devices given for {self.servers} servers")
        if isinstance(self.twin_latency, str):
            object.__setattr__(self, "twin_latency", parse_twin(self.twin_latency))


@register("dsi", DSIOptions, "distributed speculative inference: servers verify while the drafter drafts on")
def build(request: Request, options: DSIOptions) -> Any:
    """DSI over `servers` target servers on `target_devices`, run by `executor`; with `twin` (target, drafter
    latencies: `twin_latency`) every forward is padded to them. The lookahead is planned from the twin's latencies, or from
    one measured forward of each model, unless given. A started executor (`decoding.dsi.executors`) runs
    the servers instead and stays open for the next generation."""
    from speculant.decoding.dsi.engine import dsi
    from speculant.decoding.dsi.executors import ServerSpec, make_executor, replica_factory
    from speculant.decoding.dsi.plan import measure_step, plan
    from speculant.decoding.dsi.twin import PaddedModel
    from speculant.drafters.base import Drafter
    from speculant.drafters.model import ModelDrafter
    from speculant.drafters.spec import load_drafter
    from speculant.models import resolve_device
    from speculant.sampling import seeded

    target, twin = request.target, options.twin_latency
    source = load_drafter(options.drafter, target, options.drafter_dtype)
    if isinstance(source, Drafter):
        draft_source, drafter_s = source, 0.0  # Max-Gram and other model-free drafters cost next to nothing
    else:
        model = source if twin is None else PaddedModel(source, twin[1])
        draft_generator = seeded(target.device, None if request.seed is None else request.seed + 1)
        draft_source, drafter_s = ModelDrafter(model, request.sampling, draft_generator), None
    devices = list(options.target_devices or [str(target.device)] * options.servers)
    for device in devices:
        resolve_device(device)
    if twin is not None:
        target_s, drafter_s = twin[0].step_s, twin[1].step_s
    elif options.lookahead is None:
        target_s = measure_step(target, request.prompt_ids)
        drafter_s = measure_step(source, request.prompt_ids) if drafter_s is None else drafter_s
    else:
        target_s = drafter_s = None
    lookahead = plan(options.servers, options.lookahead, target_s, drafter_s).lookahead
    common = (draft_source, request.prompt_ids, request.max_new_tokens, lookahead, request.sampling,
              request.generator, target.eos_token_ids)
    if not isinstance(options.executor, str):  # servers already running, kept for the next generation
        pool = options.executor
        if pool.spec.sampling != request.sampling or len(pool.spec.devices) != options.servers:
            raise ConfigError("the given executor's servers were built for other sampling settings or server count")
        return dsi(pool, *common, close_executor=False)
    spec = ServerSpec(replica_factory(target, len(devices)), devices, request.sampling, twin[0] if twin else None)
    return dsi(make_executor(options.executor, spec, options.ray_address), *common)
