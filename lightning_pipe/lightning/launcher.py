"""Lightning's script launcher for ``PipeStrategy``: drivers run the script, stage workers serve their stage.

The launcher checks the model and settings before any process starts, then starts the processes as
Lightning's script launcher does; in each, the strategy joins the process's session
(:mod:`lightning_pipe.transport.wire.session`). Drivers return to the script and run the Lightning loop; stage
workers serve RPC until every driver is done, and never return to the script.

``start_method='fork'`` forks the other processes from the launching one where it reaches ``fit`` (or Fabric's
``launch``) instead of starting the script again in each: nothing before that point runs twice (no second import
of Lightning, no second build of the model), and each forked process then goes on as a started one would, from
the launch on. A forked process computes on one CPU thread: torch's CPU build uses GNU OpenMP, whose thread pool
hangs in a forked child that uses more than one thread once its parent has used it (docs/design.md, traps).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_pipe.transport.wire.session import PARENT_ENV, serve_until_shutdown

__all__: list[str] = []


class Launching(Protocol):
    """What the launcher asks of the strategy that owns it."""

    is_driver: bool

    def check_settings(self, trainer: pl.Trainer | None) -> None: ...

    def check_model(self, module: pl.LightningModule) -> None: ...

    def plan_auto(self, module: pl.LightningModule, trainer: pl.Trainer | None) -> None: ...

    def start_session(self) -> None: ...

    def share_cores(self) -> None: ...


class Serving:
    """Mixed in before a Lightning script launcher (the Trainer's or Fabric's): drivers run the launched function,
    stage workers serve RPC until every driver is done and never return to the script."""

    _strategy: Launching

    def serving(self, function: Callable[..., Any], model: Any = None) -> Callable[..., Any]:
        """``function`` as each process runs it: joining its session first; a stage worker serves instead (and
        gives back the memory of ``model``, the script's copy of the whole model, where it can)."""

        def role(*a: Any, **kw: Any) -> Any:
            self._strategy.start_session()
            if self._strategy.is_driver:
                return function(*a, **kw)
            if model is not None:
                # The script built the whole model here too; this process serves the stage its driver sends
                # and never returns to the script, so the model's memory is given back (best effort: a model
                # that cannot move keeps it, and nothing else changes).
                with contextlib.suppress(Exception):
                    model.to("meta")
            serve_until_shutdown()  # never returns: a worker must not continue into the user's script
            return None

        return role

    def _call_children_scripts(self) -> None:
        forking = getattr(self._strategy, "_start_method", "popen") == "fork"
        if forking:
            check_fork()
        os.environ[PARENT_ENV] = str(os.getpid())
        self._strategy.share_cores()  # before the children start, so their thread pools start at that size
        if forking:
            fork_children(self)
        else:
            super()._call_children_scripts()  # type: ignore[misc]


def check_fork() -> None:
    """Refuse ``start_method='fork'`` where a forked process could not work: CUDA already initialised here (a
    forked child cannot use it), or ``OMP_NUM_THREADS`` asking for more than the one thread a forked process can
    use."""
    if torch.cuda.is_initialized():
        raise RuntimeError("PipeStrategy(start_method='fork') cannot fork this process: it has initialised CUDA, "
                           "which a forked process cannot use. Do not touch the GPU before fit (or Fabric's "
                           "launch), or use start_method='popen'")
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    if threads.strip() != "1":
        raise ValueError(f"PipeStrategy(start_method='fork') runs each forked process on one CPU thread (GNU "
                         f"OpenMP hangs in a forked child that uses more), so OMP_NUM_THREADS={threads} cannot be "
                         "honoured there: unset it, or use start_method='popen'")


def fork_children(launcher: Any) -> None:
    """Fork local ranks ``1 .. num_processes - 1`` from this process, with the environment Lightning's launcher
    gives the scripts it starts. In the parent, ``launcher.procs`` holds a :class:`Forked` per child; each child
    returns from here as its local rank, with no children of its own and one CPU thread."""
    launcher._check_can_spawn_children()
    launcher.procs = []
    env = launcher.cluster_environment
    os.environ["MASTER_ADDR"] = env.main_address
    os.environ["MASTER_PORT"] = str(env.main_port)
    os.environ["NODE_RANK"] = str(env.node_rank())
    os.environ["LOCAL_RANK"] = str(env.local_rank())
    os.environ["WORLD_SIZE"] = str(launcher.num_processes * launcher.num_nodes)
    for local_rank in range(1, launcher.num_processes):
        sys.stdout.flush()  # what is buffered here is printed once, not once more by each child
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.environ["LOCAL_RANK"] = str(local_rank)
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
            launcher.procs = []  # the siblings are the parent's to watch
            return
        launcher.procs.append(Forked(pid))


class Forked:
    """A process forked by the launcher, with what Lightning's launcher and its observer use of a
    ``subprocess.Popen``: ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``terminate``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the process has ended (reaped here), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its code is lost
                self.returncode = 1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Signal the process, unless it has ended (its pid may be another's by then)."""
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        """``SIGKILL`` the process."""
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """``SIGTERM`` the process."""
        self.send_signal(signal.SIGTERM)


class PipeLauncher(Serving, _SubprocessScriptLauncher):
    """Lightning's script launcher, except that stage workers serve RPC instead of running the loop."""

    def __init__(self, strategy: Launching, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None,
               **kwargs: Any) -> Any:
        model = args[0] if args and isinstance(args[0], pl.LightningModule) else None
        model = model or getattr(trainer, "lightning_module", None)
        # Before any process starts (here) or on every rank (torchrun).
        if model is not None:
            self._strategy.plan_auto(model, trainer)
        self._strategy.check_settings(trainer)
        if model is not None:
            self._strategy.check_model(model)
        return super().launch(self.serving(function, model), *args, trainer=trainer, **kwargs)
