"""This process's place in a pipeline job, for the life of the process: its stage group and RPC session.

Every process of a pipeline job joins, once for its whole life:

- a default process group that is its *stage group* (stage ``i`` of every pipeline: of every replica, at every
  tensor rank),
  rendezvoused through one world store with a per-stage prefix: the drivers' default group is exactly
  the drivers (Lightning's world), a stage worker's is exactly the group whose gradients it averages;
- ``torch.distributed.rpc`` over all processes.

Under torchelastic (torchrun) the world store is the agent's, which outlives the workers: a restarted attempt
(``--max-restarts``) would read the dead attempt's keys (the addresses of processes that are gone) and fail to
connect. Each attempt's processes first agree on a fresh token (:func:`_agree_on_attempt`) and keep every key of
the attempt, RPC's included, under it.

Drivers run the user's script; at exit they shut RPC down (a barrier with every process). Stage workers
block in that same shutdown barrier while RPC threads serve their stage (:func:`serve_until_shutdown`), then
exit without returning to the script. A failing driver aborts every other process
(:func:`abort_world`); processes started by the launcher exit if it dies.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from lightning_pipe.transport.topology import Topology
from lightning_pipe.transport.wire.shm import shared_memory_links

__all__: list[str] = []

#: Set by the launcher in the processes it starts: the launching process's id (orphans exit when it dies).
PARENT_ENV = "LIGHTNING_PIPE_LAUNCHER_PID"


class _Session:
    """This process's place in the job: set once, shared by every Trainer and strategy in it."""

    topology: Topology | None = None
    rank: int = -1
    failed = False
    rpc_down = False
    store: Any = None  # the world store: process groups beyond the stage groups rendezvous through it
    backend = "gloo"
    pg_timeout = timedelta(minutes=30)


SESSION = _Session()


def worker_name(rank: int) -> str:
    """The RPC name of process ``rank``."""
    return f"worker{rank}"


def sender_groups(store: Any, token: str, rank: int, size: int, timeout: float) -> list[Any]:
    """``size`` gloo groups of the ``size`` processes (this one ``rank``), one per sending process (each TCP
    connection then carries data one way), met under ``token`` in ``store``: a :class:`DataPlane`'s."""
    return [dist.ProcessGroupGloo(dist.PrefixStore(f"lightning_pipe/plane/{token}/{sender}/", store), rank, size,
                                  timedelta(seconds=timeout)) for sender in range(size)]


def plane_groups(store: Any, token: str, rank: int, size: int, timeout: float, shared: bool) -> list[Any]:
    """What process ``rank`` of a data plane of ``size`` processes sends and receives through, one per sending
    process: rings in shared memory where ``shared`` and every process can have them (one machine), else gloo
    groups. A collective: every process calls it with the same ``shared``."""
    links = shared_memory_links(store, token, rank, size, timeout) if shared else None
    return [links] * size if links is not None else sender_groups(store, token, rank, size, timeout)


def start_session(topology: Topology, rank: int, main_address: str, main_port: int, *, backend: str,
                  pg_timeout: timedelta, rpc_timeout: float, rpc_threads: int = 16,
                  devices: Sequence[torch.device | None] | None = None) -> None:
    """Join the stage process group and RPC (once per process; later calls must agree).

    ``devices[r]``: the device of process ``r`` if it runs on this machine (None: another machine). Between
    processes on this machine's GPUs, RPC sends CUDA tensors from GPU to GPU (TensorPipe device maps: CUDA
    IPC), not through host memory. Between machines tensors go through host memory either way, so no map.
    """
    if SESSION.topology is not None:
        if (SESSION.topology, SESSION.rank) != (topology, rank):
            raise RuntimeError(f"this process already runs as rank {SESSION.rank} of {SESSION.topology}; a "
                               f"later Trainer asked for rank {rank} of {topology}: use the same devices, "
                               "num_nodes and balance for every Trainer of one script")
        return
    os.environ["MASTER_ADDR"] = main_address
    os.environ["MASTER_PORT"] = str(main_port)
    if main_address in ("127.0.0.1", "localhost", "::1"):
        # A job on one machine: RPC (TensorPipe) and collectives (gloo) listen on loopback only, even where
        # the host name resolves to an outside address.
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    stage = topology.stage_of(rank)
    # One store for the world (torchrun's agent store, or one hosted by rank 0); per-stage prefixes keep the
    # stage groups apart. Separate init_method="env://" rendezvous would race for the port and can silently
    # pair processes of different stages.
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=topology.world, timeout=pg_timeout))
    attempt = _attempt_prefix(store, rank, topology.world, pg_timeout)
    if attempt is not None:
        store = dist.PrefixStore(attempt, store)
    dist.init_process_group(backend, store=dist.PrefixStore(f"lightning_pipe/stage{stage}", store),
                            rank=topology.pipeline_of(rank), world_size=topology.pipelines, timeout=pg_timeout)
    # RPC rendezvouses on its own (init_rpc changes the timeout of the store it is given), under this attempt's
    # prefix where there is one. The "uv" (TCP) transport: TensorPipe's shared-memory transport busy-polls,
    # costing each idle process about a quarter of a core, which stages computing on CPU cannot spare.
    init_method = "env://" if attempt is None else f"{_RPC_SCHEME}://?prefix={attempt}/rpc"
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=rpc_timeout,
                                              num_worker_threads=rpc_threads, _transports=["uv"])
    mine = devices[rank] if devices is not None else None
    if mine is not None and mine.type == "cuda":
        for peer, device in enumerate(devices or ()):
            if peer != rank and device is not None and device.type == "cuda":
                options.set_device_map(worker_name(peer), {mine: device})
    # The store first: this process serves RPCs (which may build groups through it) before init_rpc returns.
    SESSION.rank, SESSION.store, SESSION.backend, SESSION.pg_timeout = rank, store, backend, pg_timeout
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=topology.world, rpc_backend_options=options)
    SESSION.topology = topology
    _start_orphan_watchdog()
    if topology.is_driver(rank):
        previous = sys.excepthook

        def hook(*exc_info: Any) -> None:  # an uncaught error: no barrier at exit, the others are aborted
            SESSION.failed = True
            previous(*exc_info)

        sys.excepthook = hook
        atexit.register(_driver_exit)


_RPC_SCHEME = "lightning-pipe"
_ATTEMPT_KEY = "lightning_pipe/attempt"


def _attempt_prefix(store: Any, rank: int, world: int, timeout: timedelta) -> str | None:
    """The prefix of this attempt's keys in the world store, or None where the store is this job's alone.

    Under torchelastic the store is the agent's (``TORCHELASTIC_USE_AGENT_STORE``): it outlives the workers, so a
    restarted attempt finds every key of the dead one, and gloo and RPC would connect to addresses of processes
    that are gone. ``TORCHELASTIC_RESTART_COUNT`` cannot tell attempts apart: each node's agent counts its own
    restarts (a node whose workers were healthy restarts them without counting), so the nodes of one attempt may
    disagree. The processes agree on a fresh token instead."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None  # a store hosted by rank 0 of this very job (our launcher, SLURM, plain env://)
    return f"{_ATTEMPT_KEY}/{_agree_on_attempt(store, rank, world, timeout)}"


def _agree_on_attempt(store: Any, rank: int, world: int, timeout: timedelta) -> str:
    """A token every process of this attempt returns, and no process of an earlier attempt saw.

    Rank 0 publishes a fresh token and waits for every other rank to join it, then says go. Another rank takes
    the published token (which may be a dead attempt's until rank 0 of this one publishes), joins it, and waits
    for go: a token whose go was given before it joined, or that is replaced while it waits, is a dead
    attempt's. Every process of an attempt starts after every process of the one before has ended (the agents
    stop their workers before they rendezvous again), so a live rank 0 is this attempt's."""
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(_ATTEMPT_KEY, token)
        if world > 1:
            store.wait([f"{_ATTEMPT_KEY}/{token}/joined/{r}" for r in range(1, world)], timeout)
        store.set(f"{_ATTEMPT_KEY}/{token}/go", "1")
        return token
    deadline = time.monotonic() + timeout.total_seconds()
    dead: set[str] = set()
    pause = _Backoff()  # polls: a store wait that times out logs a warning each time
    while time.monotonic() < deadline:
        token = store.get(_ATTEMPT_KEY).decode()  # waits for the first attempt's rank 0
        go = f"{_ATTEMPT_KEY}/{token}/go"
        if token in dead or store.check([go]):  # given before this process joined: a dead attempt's
            dead.add(token)
            pause()
            continue
        store.set(f"{_ATTEMPT_KEY}/{token}/joined/{rank}", "1")
        while time.monotonic() < deadline:
            if store.check([go]):
                return token
            if store.get(_ATTEMPT_KEY).decode() != token:  # rank 0 of this attempt published its own
                dead.add(token)
                break
            pause()
    raise TimeoutError(f"rank {rank} waited {timeout} for rank 0 of this attempt to publish its rendezvous")


class _Backoff:
    """Sleeps 50 ms, then longer each call up to 1 s: quick when rank 0 is, light on the store when it is not."""

    def __init__(self) -> None:
        self.seconds = 0.05

    def __call__(self) -> None:
        time.sleep(self.seconds)
        self.seconds = min(1.0, self.seconds * 1.5)


def _rpc_rendezvous(url: str, **kwargs: Any) -> Any:
    """RPC's rendezvous under this attempt's prefix (``lightning-pipe://?prefix=P``): a store client of its own
    (``init_rpc`` sets its timeout to RPC's), its keys under ``P``."""
    query = dict(parse_qsl(urlparse(url).query))
    rank, world = int(query["rank"]), int(query["world_size"])
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, **kwargs))
    yield dist.PrefixStore(query["prefix"], store), rank, world


try:
    dist.register_rendezvous_handler(_RPC_SCHEME, _rpc_rendezvous)
except RuntimeError:  # registered already (this module loaded again)
    pass


def _driver_exit() -> None:
    try:
        rpc.shutdown(graceful=not SESSION.failed)  # graceful: a barrier with every process
        SESSION.rpc_down = True
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - at exit there is nobody else to tell
        print(f"[lightning_pipe rank {SESSION.rank}] RPC shutdown failed: {exc!r}", file=sys.stderr, flush=True)
        os._exit(1)


def _start_orphan_watchdog() -> None:
    """Processes started by our launcher exit if the launching process (global rank 0) disappears."""
    parent = os.environ.get(PARENT_ENV)
    if parent is None or int(parent) != os.getppid():
        return  # not a child of our launcher (rank 0 itself, torchrun, SLURM: their agents do this)

    def watch() -> None:
        while not SESSION.rpc_down:  # once past the shutdown barrier the launcher may exit first
            threading.Event().wait(1.0)
            if os.getppid() != int(parent) and not SESSION.rpc_down:
                print(f"[lightning_pipe rank {SESSION.rank}] the launching process died; exiting",
                      file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="lightning_pipe.watchdog").start()


def _abort_process(reason: str) -> None:
    print(f"[lightning_pipe rank {SESSION.rank}] aborting: {reason}", file=sys.stderr, flush=True)
    threading.Timer(0.2, os._exit, args=(1,)).start()  # let the RPC reply go out first


def abort_world(reason: str, error: BaseException | None = None) -> None:
    """Tell every other process to exit with status 1 (best effort), and mark this one failed.

    ``error``, the failure, is printed here first, with its notes (which stage, which process): as the other
    processes exit, a launcher that watches them (Lightning's kills every process of the job within 5 s of
    one exiting with an error) may end this one before its traceback is printed."""
    topology = SESSION.topology
    if topology is None or SESSION.failed:
        return
    SESSION.failed = True
    if error is not None:
        text = "".join(traceback.format_exception_only(error)).rstrip()
        print(f"[lightning_pipe rank {SESSION.rank}] failed, stopping every process of the job:\n{text}",
              file=sys.stderr, flush=True)
    futures = []
    for rank in range(topology.world):
        if rank != SESSION.rank:
            try:
                futures.append(rpc.rpc_async(worker_name(rank), _abort_process,
                                             args=(f"rank {SESSION.rank} failed: {reason}",), timeout=2))
            except Exception:  # noqa: BLE001 - a process already gone needs no telling
                pass
    for future in futures:
        try:
            future.wait()
        except Exception:  # noqa: BLE001
            pass


def serve_until_shutdown() -> None:
    """A stage worker's life after setup: RPC threads serve while this thread waits in the shutdown barrier,
    which passes when every driver has finished; then the process exits (this never returns)."""
    code = 0
    try:
        rpc.shutdown(graceful=True)
        SESSION.rpc_down = True
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        print(f"[lightning_pipe rank {SESSION.rank}] shutdown failed: {exc!r}", file=sys.stderr, flush=True)
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
