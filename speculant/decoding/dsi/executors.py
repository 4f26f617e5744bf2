"""Where DSI's target servers run: threads, OS processes or Ray actors. The coordinator talks to all
three the same way (`start`, `submit`, `cancel`, `close`), and every server reports into the executor's
one event queue, `events`: `("result", JobResult)` or `("lost", server, reason)`. An executor can serve
many generations between `start` and `close` (servers keep their processes and caches). The algorithm
never knows which one it drives.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speculant.config import EXECUTORS, SamplingConfig, reach_ray
from speculant.decoding.dsi.jobs import Canceller, Job, ServerDied, TargetServer
from speculant.decoding.dsi.twin import Latency, PaddedModel
from speculant.errors import ConfigError, ModelNotAvailable
from speculant.models.base import CausalLM, owner_of


@dataclass
class ServerSpec:
    """How to build target server i wherever it runs; picklable when `factory` is (for processes and Ray).

    `factory(device)` returns a fresh CausalLM (its own KV cache) on `devices[i]`; `latency` turns the
    servers into a latency twin; `die_after` {server: jobs} injects a real crash of that server."""

    factory: Callable[[str], CausalLM]
    devices: list[str]
    sampling: SamplingConfig
    latency: Latency | None = None
    die_after: dict[int, int] = field(default_factory=dict)
    threads: int | None = None  # torch threads in a server process (default: the cores shared out)
    target: str = ""  # the target its replicas copy (`target_key`; "": not said): a started executor serves its own

    def build(self, index: int, canceller: Canceller, own_process: bool, device: str | None = None) -> TargetServer:
        model = self.factory(device or self.devices[index])
        if self.latency is not None:
            model = PaddedModel(model, self.latency, canceller)
        return TargetServer(index, model, self.sampling, self.die_after.get(index), own_process, canceller)


STUCK = "a target server of this executor never stopped when it closed: start another executor"


def target_key(target: CausalLM) -> str:
    """What tells a loaded target apart from any other alive (its name and identity), as `ServerSpec.target`."""
    owner = owner_of(target)
    return f"{owner.name}#{id(owner)}"


def replica_factory(target: CausalLM, servers: int = 1, drafting: bool = False) -> Callable[[str], CausalLM]:
    """`ServerSpec.factory` for a loaded target, as its backend makes replicas (`Backend.replicas`); a server's
    per-request handle gets replicas of the model it shares (they run beside its batched forwards)."""
    return owner_of(target).replicas(servers, drafting)


def report_lost(executor: Any, index: int, reason: str) -> None:
    """Remember that server `index` is gone, then tell the generation running now."""
    executor.lost[index] = reason
    executor.events.put(("lost", index, reason))


def told_lost(executor: Any, index: int) -> bool:
    """Whether server `index` is known to be gone; if so, tell the generation running now once more (a pool
    outlives a generation: one that sends a job to a server lost in an earlier one must hear of it too)."""
    if index in executor.lost:
        executor.events.put(("lost", index, executor.lost[index]))
    return index in executor.lost


class ThreadExecutor:
    """Target servers as threads of this process (torch releases the GIL inside its kernels)."""

    name = "thread"

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.inboxes: list[queue.Queue] = []
        self.cancellers: list[Canceller] = []
        self.threads: list[threading.Thread] = []
        self.events: queue.Queue = queue.Queue()
        self.lost: dict[int, str] = {}  # servers that failed, and why (`report_lost`, `told_lost`)
        self.stuck = False  # a server outlived `close` (in a forward): this executor cannot start again

    def start(self) -> None:
        """Start every server and return once all have built their model."""
        if self.stuck:
            raise ServerDied(STUCK)
        if self.threads:
            return
        ready: queue.Queue = queue.Queue()
        for index in range(len(self.spec.devices)):
            self.inboxes.append(queue.Queue())
            self.cancellers.append(Canceller())
            thread = threading.Thread(target=self._serve, args=(index, ready), daemon=True, name=f"dsi-target-{index}")
            thread.start()
            self.threads.append(thread)
        for _ in self.threads:
            index, error = ready.get()
            if error:
                raise ServerDied(f"target server {index} failed to start: {error}")

    def _serve(self, index: int, ready: queue.Queue) -> None:
        try:
            server = self.spec.build(index, self.cancellers[index], own_process=False)
        except Exception as error:  # noqa: BLE001 - reported by start()
            ready.put((index, f"{type(error).__name__}: {error}"))
            return
        ready.put((index, None))
        try:
            while (job := self.inboxes[index].get()) is not None:
                self.events.put(("result", server.run(job)))
        except Exception as error:  # noqa: BLE001 - a server failure is reported, its jobs move on
            report_lost(self, index, f"{type(error).__name__}: {error}")

    def submit(self, index: int, job: Job) -> None:
        if not told_lost(self, index):
            self.inboxes[index].put(job)

    def cancel(self, index: int, job_id: int) -> None:
        self.cancellers[index].cancel(job_id)

    def close(self) -> None:
        """Stop every server; a later `start` starts them again (where one outlives the wait, still in a forward,
        it reads this executor's queues: this one can then not start again)."""
        for inbox in self.inboxes:
            inbox.put(None)
        for thread in self.threads:
            thread.join(timeout=5)
        if any(thread.is_alive() for thread in self.threads):
            self.stuck = True
            return
        self.__init__(self.spec)  # type: ignore[misc]


def _process_main(index: int, conn: Any, canceller: Canceller, threads: int) -> None:
    """A server process: the spec comes through its pipe (torch hands each shared weight tensor over as a file
    descriptor, which a pipe passes in any number; a forkserver's start arguments take at most 256, fewer than a
    0.5B model's tensors), with the environment and cores of the process that starts the pool now (the forkserver
    kept those of the first pool's). Ctrl-C, which the terminal sends the whole process group, is the starting
    process's to act on: it closes the pool (the server, interrupted, would print its own traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec, environ, cores = conn.recv()
    os.environ.clear()
    os.environ.update(environ)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    try:
        server = spec.build(index, canceller, own_process=True)
    except Exception as error:  # noqa: BLE001 - reported by start()
        conn.send(f"{type(error).__name__}: {error}")
        return
    conn.send(None)  # ready
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            break
        if job is None:
            break
        try:
            conn.send(server.run(job))
        except (BrokenPipeError, ConnectionResetError):  # the starting process is gone: no one to answer
            break
    conn.close()
    os._exit(0)  # nothing to clean up; skip an interpreter teardown racing torch's worker threads


class ProcessExecutor:
    """One OS process per target server, so forwards truly run in parallel; transformers weights travel through
    shared memory. Servers fork from multiprocessing's forkserver, a fresh interpreter (no CUDA, none of the
    caller's state) that imported torch, this module and the first pool's replica factory's once: a fresh
    interpreter per server (`spawn`, where there is no forkserver) imports them again for each server, seconds
    apiece. A server process that exits is reported lost."""

    name = "process"

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.conns: list[Any] = []
        self.cancellers: list[Canceller] = []
        self.processes: list[Any] = []
        self.locks: list[threading.Lock] = []
        self.readers: list[threading.Thread] = []
        self.events: queue.Queue = queue.Queue()
        self.lost: dict[int, str] = {}  # as ThreadExecutor's
        self.stuck = False  # as ThreadExecutor's

    def start(self) -> None:
        if self.stuck:
            raise ServerDied(STUCK)
        if self.processes:
            return
        import torch.multiprocessing as mp

        if "forkserver" in mp.get_all_start_methods():
            context = mp.get_context("forkserver")
            factory = getattr(self.spec.factory, "func", self.spec.factory)  # (a partial's function)
            context.set_forkserver_preload([__name__, factory.__module__])  # (what its first start imports)
        else:
            context = mp.get_context("spawn")
        n = len(self.spec.devices)
        threads = self.spec.threads or max(1, (os.cpu_count() or 1) // (n + 1))
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        for index in range(n):
            parent, child = context.Pipe()
            # The id needs no lock: one aligned 64-bit word, written by the coordinator only, read at every layer.
            canceller = Canceller(context.Event(), context.Value("q", -1, lock=False))
            process = context.Process(target=_process_main, args=(index, child, canceller, threads), daemon=True,
                                      name=f"dsi-target-{index}")
            process.start()
            child.close()
            parent.send((self.spec, dict(os.environ), cores))
            self.conns.append(parent)
            self.cancellers.append(canceller)
            self.processes.append(process)
            self.locks.append(threading.Lock())
        for index, conn in enumerate(self.conns):  # every server has built its model
            try:
                error = conn.recv()
            except (EOFError, OSError):
                error = f"process exited (code {self.processes[index].exitcode})"
            if error:
                self.close()
                raise ServerDied(f"target server {index} failed to start: {error}")
        for index in range(n):
            reader = threading.Thread(target=self._read, args=(index, self.events), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _read(self, index: int, events: queue.Queue) -> None:
        while True:
            try:
                result = self.conns[index].recv()
            except (EOFError, OSError):
                process = self.processes[index]
                process.join(timeout=1)
                report_lost(self, index, f"process {process.pid} exited (code {process.exitcode})")
                return
            events.put(("result", result))

    def submit(self, index: int, job: Job) -> None:
        if told_lost(self, index):
            return
        try:
            with self.locks[index]:
                self.conns[index].send(job)
        except (OSError, ValueError):
            pass  # the reader reports the dead process

    def cancel(self, index: int, job_id: int) -> None:
        self.cancellers[index].cancel(job_id)

    def kill(self, index: int) -> None:
        """Kill a server process outright (for fault tests)."""
        self.processes[index].kill()

    def close(self) -> None:
        for index in range(len(self.processes)):
            self.submit(index, None)  # type: ignore[arg-type]  # asks the server to exit
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
        for reader in self.readers:
            reader.join(timeout=5)
        if any(reader.is_alive() for reader in self.readers):  # (as ThreadExecutor's)
            self.stuck = True
            return
        self.__init__(self.spec)  # type: ignore[misc]  # (a later `start` starts them again)


class _RayServer:
    """A target server as a Ray actor; a second concurrent call slot carries cancellations."""

    def __init__(self, spec: ServerSpec, index: int):
        self.canceller = Canceller()
        self.server = spec.build(index, self.canceller, own_process=True)

    def ready(self) -> bool:
        return True

    def run(self, job: Job) -> Any:
        return self.server.run(job)

    def cancel(self, job_id: int) -> None:
        self.canceller.cancel(job_id)

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


@dataclass
class RayUse:
    """The process's Ray connection, which every RayExecutor shares (a server's concurrent DSI requests each start
    one): joined or started by the first under the lock (two calling ray.init at once failed), and shut down when
    the last executor closes where speculant started it.

    Ray starts its local processes bound to the *thread* that spawned them (Linux's PR_SET_PDEATHSIG): started from
    a request's thread, they were killed when that request ended, under every other request still running on them.
    So `ray.init` runs on a thread of its own, `keeper`, which lives until the shutdown."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0  # executors started and not closed
    keeper: threading.Thread | None = None  # the thread that called ray.init, alive while that Ray runs (None: no
    # Ray speculant started)
    release: threading.Event = field(default_factory=threading.Event)  # lets `keeper` end after the shutdown

    def join(self, address: str | None) -> bool:
        """Count one more executor, starting or joining Ray where none is up; whether speculant started it."""
        import ray

        with self.lock:
            if not ray.is_initialized():
                reach_ray(address, "ray_address")
                self._init(address)
            self.users += 1
            return self.keeper is not None

    def leave(self) -> None:
        """Count one executor fewer; the Ray speculant started stops with the last (its workers hold memory and
        cores)."""
        import ray

        with self.lock:
            self.users -= 1
            if self.users == 0 and self.keeper is not None:
                ray.shutdown()
                self.release.set()
                self.keeper.join()
                self.keeper = None

    def _init(self, address: str | None) -> None:
        import ray

        outcome: queue.Queue = queue.Queue()
        local = {} if address else {"include_dashboard": False}  # a cluster's head has its own settings

        def keep() -> None:
            notes = logging.getLogger("ray._private")  # (on a cluster of its own, Ray's warnings that its SIGTERM
            level = notes.level  # handler waits for the main thread and that it made a token are not the user's)
            if not address:
                notes.setLevel(logging.ERROR)
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False, **local)
            except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread below
                outcome.put(error)
                return
            finally:
                notes.setLevel(level)
            outcome.put(None)
            self.release.wait()

        self.release.clear()
        keeper = threading.Thread(target=keep, name="speculant-ray", daemon=True)
        keeper.start()
        error = outcome.get()
        if isinstance(error, ConnectionError):
            raise ConfigError(f"cannot join the Ray cluster at {address}: {error}") from None
        if error is not None:
            raise error
        self.keeper = keeper


RAY_USE = RayUse()


class RayExecutor:
    """Target servers as Ray actors (`pip install speculant[ray]`); joins `address` when given, otherwise
    starts a local Ray (`RAY_USE`). CPU server i runs on the cluster's node i mod (nodes), GPU servers wherever a
    GPU is free. A lost actor is reported like a dead process."""

    name = "ray"

    def __init__(self, spec: ServerSpec, address: str | None = None):
        self.spec = spec
        self.address = address
        self.actors: list[Any] = []
        self.owns_ray = False  # it runs on a Ray speculant started (`RAY_USE`)
        self.joined = False  # counted among RAY_USE's users
        self.events: queue.Queue = queue.Queue()

    def start(self) -> None:
        if self.actors:
            return
        try:
            import ray
        except ImportError:
            raise ModelNotAvailable("executor 'ray' needs Ray: pip install 'speculant[ray]'") from None
        self.owns_ray, self.joined = RAY_USE.join(self.address), True
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(max_concurrency=2)(_RayServer)
        nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
        for index, device in enumerate(self.spec.devices):
            gpus = 1 if device.startswith("cuda") else 0
            # CPU servers round robin over the nodes (Ray's soft affinity was seen ignored); GPU servers go
            # where Ray finds a free GPU.
            where = "DEFAULT" if gpus else NodeAffinitySchedulingStrategy(nodes[index % len(nodes)], soft=False)
            self.actors.append(actor.options(num_gpus=gpus, num_cpus=0, scheduling_strategy=where)
                               .remote(self.spec, index))
        for index, actor_handle in enumerate(self.actors):  # every server has built its model
            try:
                ray.get(actor_handle.ready.remote())
            except Exception as error:  # noqa: BLE001 - RayActorError wraps the constructor's exception
                self.close()
                raise ServerDied(f"target server {index} failed to start: {str(error).splitlines()[0]}") from None

    def submit(self, index: int, job: Job) -> None:
        import ray

        ref = self.actors[index].run.remote(job)

        def collect() -> None:
            try:
                self.events.put(("result", ray.get(ref)))
            except Exception as error:  # noqa: BLE001 - RayActorError and friends: the actor is gone
                self.events.put(("lost", index, f"{type(error).__name__}: {str(error).splitlines()[0]}"))

        threading.Thread(target=collect, daemon=True).start()

    def cancel(self, index: int, job_id: int) -> None:
        self.actors[index].cancel.remote(job_id)

    def kill(self, index: int) -> None:
        import ray

        ray.kill(self.actors[index])

    def nodes(self) -> list[str]:
        """The Ray node id each server runs on."""
        import ray

        return ray.get([actor.node.remote() for actor in self.actors])

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.joined:
            self.joined = False
            RAY_USE.leave()


def make_executor(name: str, spec: ServerSpec, ray_address: str | None = None) -> Any:
    if name == "thread":
        return ThreadExecutor(spec)
    if name == "process":
        return ProcessExecutor(spec)
    if name == "ray":
        return RayExecutor(spec, ray_address)
    raise ConfigError(f"unknown executor '{name}' (choose from {', '.join(EXECUTORS)})")


__all__ = ["EXECUTORS", "ProcessExecutor", "RayExecutor", "ServerDied", "ServerSpec", "ThreadExecutor",
           "make_executor", "replica_factory", "target_key"]
