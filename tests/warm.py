"""Scripts run from a warm interpreter: forked from a server that has imported torch and torchmetrics once.

Every job a test starts is a Python script, and before it does anything each one imports torch and, through
Lightning, torchmetrics (which imports transformers, scipy.signal and matplotlib where they are installed): about
7 of the 9 s of CPU that ``import lightning`` costs on the CI machine, paid again by every script. Here a script
runs in a process forked from multiprocessing's fork server, which imported those libraries once per test worker
(:data:`PRELOAD`); the script itself imports everything else as a fresh interpreter would: Lightning,
lightning_pipe (which Lightning package is loaded decides its binding), the script's own modules.

The process is the script's main process, as ``python script.py`` would be: its own session, its output in a file,
the given environment and working directory, ``sys.argv`` and ``sys.path[0]`` as the interpreter sets them, its
exit status the script's, its exit handlers run. The processes a launcher starts from it are real interpreters.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Imported once in the fork server: what every script imports, and none of Lightning or lightning_pipe.
PRELOAD = ["torch", "torch._dynamo", "torchmetrics", "transformers", "scipy.signal", "matplotlib.pyplot",
           "lightning_utilities"]

#: Environment variables read when an interpreter or these libraries start: a script given one of these runs in a
#: fresh interpreter instead.
AT_START = {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONHOME",
            "CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE"}

_context: Any = None
_base_path: list[str] | None = None


def runs_warm(argv: list[str], env: dict[str, str] | None) -> bool:
    """Whether ``argv`` is a Python script this module can run warm with the environment ``env`` adds."""
    return (len(argv) >= 2 and argv[0] == sys.executable and argv[1].endswith(".py")
            and not AT_START & set(env or {}) and "fork" in multiprocessing.get_all_start_methods())


def context() -> Any:
    """multiprocessing's fork-server context, its server importing :data:`PRELOAD` as it starts (once per test
    worker). Its processes start with the server's environment: give them the caller's (:func:`start` does)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def start(argv: list[str], cwd: Path, env: dict[str, str], out: Path) -> multiprocessing.process.BaseProcess:
    """Start ``argv`` (``[sys.executable, script, *args]``) warm in ``cwd`` with exactly the environment ``env``,
    its output (stdout and stderr) written to ``out``; the process is returned started."""
    global _base_path
    if _base_path is None:  # sys.path as `python script.py` has it after its first entry (not the test session's)
        _base_path = json.loads(subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
                                               capture_output=True, text=True, check=True, env=env).stdout)[1:]
    proc = context().Process(target=_main, args=(argv[1:], str(cwd), env, str(out), _base_path), daemon=False)
    proc.start()
    return proc


def _main(argv: list[str], cwd: str, env: dict[str, str], out: str, base_path: list[str]) -> None:
    """In the forked process: become ``python argv[0] argv[1:]`` and exit with its status."""
    import atexit
    import threading
    import traceback
    import warnings

    os.setsid()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[:] = [os.path.dirname(script), *base_path]
    options = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o]
    sys.warnoptions[:] = options
    warnings._processoptions(options)  # type: ignore[attr-defined]  # as the interpreter does with PYTHONWARNINGS
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        traceback.print_exc()
        code = 1
    # As the interpreter ends: its threads joined, then its exit handlers.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
