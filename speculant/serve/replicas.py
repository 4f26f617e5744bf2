"""`speculant serve --replicas N`: the same OpenAI app from N processes behind one port, as a Ray Serve
deployment (https://docs.ray.io/en/latest/serve/).

Each replica is a Ray actor that loads its own target and drafters and runs the app of `serve.app` with its
own engine (continuous batching inside it); Ray's HTTP proxy on `--port` spreads requests over the replicas
(to the less loaded of two). On a local cluster (the default) replicas share this machine's cores, each
reserving `--replica-cpus` of them (Ray sets its kernels' thread count to that); with `--ray-cluster` they go
wherever that cluster has room, on several machines.

Each replica counts its own metrics: `/metrics` through the port answers from whichever replica the proxy chose (its
`x-speculant-replica` header names it), so its counters jump between replicas' and are not the deployment's totals.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from typing import Any

from speculant.config import ModelConfig, ServeConfig, reach_ray
from speculant.errors import ConfigError
from speculant.serve.app import build_app

APP = "speculant"  # the Ray Serve application's and deployment's name
QUIET = {"log_level": "WARNING"}  # Ray Serve's controller, proxy and replicas log each step at INFO


class Replica:
    """One replica's app: built when Ray starts the replica (its models load there, not in the driver)."""

    def __init__(self, target: str, model: ModelConfig, method: str, options: Any, config: ServeConfig,
                 served_name: str):
        self.settings = (target, model, method, options, config, served_name)

    def __serve_build_asgi_app__(self) -> Any:  # noqa: N807 - Ray Serve's hook for an app made in the replica
        from ray import serve

        return build_app(*self.settings, replica=serve.get_replica_context().replica_id.unique_id)


def serve_replicas(target: str, model: ModelConfig, method: str, options: Any, config: ServeConfig,
                   served_name: str) -> None:
    """Deploy `config.replicas` replicas and serve until SIGTERM or Ctrl-C, then take the deployment down."""
    reach_ray(config.ray_cluster, "--ray-cluster")
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError("--replicas and --ray-cluster need Ray Serve: pip install 'speculant[ray]'") from None
    local = config.own_ray  # then a cluster of its own, never one that another process started
    try:
        ray.init(address=config.ray_cluster or "local", log_to_driver=True, configure_logging=False,
                 **({"include_dashboard": False} if local else {}))
    except ConnectionError as error:
        raise ConfigError(f"cannot join the Ray cluster at {config.ray_cluster}: {error}") from None
    cpus = ray.cluster_resources().get("CPU", 0)
    if local and config.replicas * config.replica_cpus > cpus:
        ray.shutdown()
        raise ConfigError(f"{config.replicas} replicas of {config.replica_cpus:g} CPUs do not fit this machine's "
                          f"{cpus:g} (lower --replicas or --replica-cpus)")
    gpus = 0 if model.device == "cpu" else 1
    deployment = serve.deployment(
        serve.ingress()(Replica), name=APP, num_replicas=config.replicas,
        max_ongoing_requests=config.max_batch + config.max_queue,  # the engine queues and answers 429 itself
        ray_actor_options={"num_cpus": config.replica_cpus, "num_gpus": gpus})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # let the `finally` below take the deployment down
    try:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the driver's own progress lines
        serve.start(http_options={"host": config.host, "port": config.port}, logging_config=QUIET)
        try:
            serve.run(deployment.bind(target, model, method, options, config, served_name), name=APP,
                      route_prefix="/", logging_config=QUIET)
        except RuntimeError as error:  # a replica failed to start: Ray's message ends with the cause
            raise ConfigError(f"the replicas did not start: {str(error).strip().splitlines()[-1]}") from None
        print(f"serving {served_name} from {config.replicas} replicas on http://{config.host}:{config.port}/v1 "
              f"(Ray Serve; {'a local cluster' if local else config.ray_cluster})", file=sys.stderr)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        if local:
            serve.shutdown()  # the whole local cluster goes with this process
        else:
            serve.delete(APP)  # the cluster's own Serve instance stays
        ray.shutdown()
