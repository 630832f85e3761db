"""``python -m lightning_pipe``: every command helps (``--help``, status 0), and ``consolidate`` says what it was
given and what it takes instead of a traceback (status 2), or consolidates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from strategy_utils import REPO, run_command

LIGHTNING = ("pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics")


def command(*args: str, cwd=REPO) -> subprocess.CompletedProcess[str]:
    """``python -m lightning_pipe ARGS`` (stdout and stderr together), bounded in time."""
    return run_command([sys.executable, "-m", "lightning_pipe", *map(str, args)], timeout=120, expect_ok=False,
                       name="python -m lightning_pipe", cwd=cwd)


#: Runs each command line of a JSON list as ``python -m lightning_pipe`` runs it (the module as ``__main__``), one after
#: another: its exit status, what it printed (stdout and stderr together) and the Lightning modules loaded by then.
BATCH = f"""\
import contextlib, io, json, runpy, sys, traceback
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv, printed = ["lightning_pipe", *argv], io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            runpy.run_module("lightning_pipe", run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in {LIGHTNING!r})
    results.append([status, printed.getvalue(), loaded])
print(json.dumps(results))
"""


def commands(argvs: list[list[str]], cwd=REPO) -> dict[tuple[str, ...], tuple[int, str, list[str]]]:
    """Each of ``argvs`` run as ``python -m lightning_pipe ARGV`` runs it, all in one fresh process (each command a
    process of its own cost a Python start and torch's import apiece): by command line, its exit status, its
    output and the Lightning modules loaded by the time it ended."""
    result = run_command([sys.executable, "-c", BATCH, json.dumps(argvs)], timeout=120, name="commands", cwd=cwd)
    return {tuple(argv): tuple(got) for argv, got in zip(argvs, json.loads(result.stdout.splitlines()[-1]))}


HELPS = [
    (["--help"], ["timeline", "consolidate", "python -m lightning_pipe timeline trace.json timeline.png",
                  "python -m lightning_pipe consolidate ", "COMMAND --help"]),
    (["-h"], ["timeline", "consolidate"]),
    (["timeline", "--help"], ["usage: python -m lightning_pipe timeline [-h] [--last N] TRACE PNG",
                              'PipeStrategy(timeline="trace.json")', "bubble fraction", "--last N",
                              "example:\n  python -m lightning_pipe timeline trace.json timeline.png"]),
    (["consolidate", "--help"], ["usage: python -m lightning_pipe consolidate [-h] DIR FILE",
                                 'PipeStrategy(state_dict_type="sharded")', ".metadata", "load_from_checkpoint",
                                 "DIR ", "FILE ", "example:\n  python -m lightning_pipe consolidate "]),
]
WRONG = [
    ([], ["usage: python -m lightning_pipe", "timeline", "consolidate", "COMMAND --help"]),
    (["draw"], ["invalid choice: 'draw'", "timeline", "consolidate"]),
    (["consolidate", "only-one"], ["usage: python -m lightning_pipe consolidate [-h] DIR FILE",
                                   "the following arguments are required: FILE"]),
]
#: Paths given to ``consolidate`` (in the folder of ``checkpoints``) and what it says of each.
GIVEN = [
    ("full.ckpt", ["full.ckpt is a file, not a directory", "needs no consolidation", "load_from_checkpoint",
                   'PipeStrategy(state_dict_type="sharded")']),
    ("lightning_logs/version_0/checkpoints", [
        "checkpoints is a folder of checkpoints, not a sharded checkpoint (no .metadata in it): pass one of the 2",
        "\n  lightning_logs/version_0/checkpoints/epoch=0-step=4.ckpt"
        "\n  lightning_logs/version_0/checkpoints/last.ckpt"]),
    (".", ["pass one of the 2 sharded checkpoints", "\n  ./lightning_logs/version_0/checkpoints/last.ckpt"]),
    ("lightning_logs/version_0/checkpoints/last.ckpt/.metadata",
     [".metadata is a file of the sharded checkpoint", "last.ckpt: pass that directory"]),
    ("lightning_logs/version_0/checkpoints/last.ckpt/__0_0.distcp",
     ["__0_0.distcp is a file of the sharded checkpoint", "last.ckpt: pass that directory"]),
    ("lightning_logs/version_0/checkpoints/epoch=1-step=8.ckpt.partial-123",
     ["has no .metadata: it is a save that did not finish"]),
    ("missing.ckpt", ["missing.ckpt does not exist", 'PipeStrategy(state_dict_type="sharded")']),
    ("lightning_logs/version_0/checkpoints/old.ckpt", [
        "old.ckpt is a sharded checkpoint in lightning_pipe's earlier format (meta.pt and a stage-NNNNN.pt file",
        "which this version no longer reads", "torch.distributed.checkpoint directories",
        "Consolidate it with the lightning_pipe version that wrote it",
        "(python -m lightning_pipe consolidate DIR FILE)"]),
    ("lightning_logs/version_0", []),  # found below it
]
#: Outputs ``consolidate`` cannot write, and what it says.
OUTPUTS = [("lightning_logs", "lightning_logs is a directory: give the path of the file"),
                                         ("no/such/out.ckpt", "the folder of no/such/out.ckpt does not exist")]
LAST = "lightning_logs/version_0/checkpoints/last.ckpt"


def write_checkpoints(root: Path) -> tuple[Path, Path, torch.nn.Module]:
    """A training run's folder in ``root``: a one-file checkpoint, two sharded ones written by the strategy's writer
    (one process's share here; the multi-process ones below), and a save that did not finish."""
    from lightning_pipe.lightning import sharded

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    folder = root / "lightning_logs" / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    for name in ("epoch=0-step=4.ckpt", "last.ckpt"):
        sharded.save({"state_dict": model.state_dict(), "epoch": 0, "global_step": 4, "optimizer_states": []},
                     str(folder / name), hosts=None, optimizers=[])
    (folder / "epoch=1-step=8.ckpt.partial-123").mkdir()
    (folder / "epoch=1-step=8.ckpt.partial-123" / "__0_0.distcp").write_bytes(b"")
    torch.save({"state_dict": model.state_dict()}, root / "full.ckpt")
    (folder / "old.ckpt").mkdir()  # lightning_pipe's first sharded format
    torch.save({"lightning_pipe": {"format": "lightning_pipe.sharded", "version": 1}}, folder / "old.ckpt" / "meta.pt")
    return root, folder, model


@pytest.fixture
def checkpoints(tmp_path):
    return write_checkpoints(tmp_path)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> tuple[Path, dict[tuple[str, ...], tuple[int, str, list[str]]]]:
    """Every help and every refusal below, run in one process (:func:`commands`) in a folder of
    :func:`write_checkpoints`: that folder and the results by command line."""
    root, _, _ = write_checkpoints(tmp_path_factory.mktemp("commands"))
    argvs = [args for args, _ in HELPS + WRONG] + [["consolidate", "nowhere", "out.ckpt"]]
    argvs += [["consolidate", given, "out.ckpt"] for given, _ in GIVEN]
    argvs += [["consolidate", LAST, output] for output, _ in OUTPUTS]
    return root, commands(argvs, cwd=root)


def test_the_batched_command_lines_print_what_the_command_does(ran):
    """What :func:`commands` gives is what ``python -m lightning_pipe`` prints and exits with, in a process of
    its own: a help and a refusal."""
    root, results = ran
    for args in (["--help"], ["consolidate", "nowhere", "out.ckpt"]):
        alone = command(*args, cwd=root)
        assert (alone.returncode, alone.stdout) == results[tuple(args)][:2], alone.stdout


@pytest.mark.parametrize("args,says", HELPS)
def test_every_command_helps(args, says, ran):
    status, out, _ = ran[1][tuple(args)]
    assert status == 0, out
    missing = [s for s in says if s not in out]
    assert missing == [], out


@pytest.mark.parametrize("args,says", WRONG)
def test_a_wrong_command_line_shows_the_usage(args, says, ran):
    status, out, _ = ran[1][tuple(args)]
    assert status == 2, out
    assert [s for s in says if s not in out] == [], out
    assert "Traceback" not in out


@pytest.mark.parametrize("args", [["--help"], ["consolidate", "--help"], ["consolidate", "nowhere", "out.ckpt"]])
def test_help_and_refusals_load_no_lightning(args, ran):
    """The command line loads Lightning only when a command needs it: not to help, nor to refuse a path (every
    command of the batch ran before these were read: none loaded it)."""
    status, out, loaded = ran[1][tuple(args)]
    assert (loaded, status) == ([], 2 if "nowhere" in args else 0), out


@pytest.mark.parametrize("given,says", GIVEN)
def test_consolidate_says_what_it_was_given_and_what_it_takes(given, says, ran):
    root, results = ran
    status, out, _ = results[("consolidate", given, "out.ckpt")]
    assert status == 2, out
    assert "Traceback" not in out and "Error:" not in out, out
    assert out.startswith("usage: python -m lightning_pipe consolidate [-h] DIR FILE\n"
                          f"python -m lightning_pipe consolidate: error: {given}"), out
    assert [s for s in says if s not in out] == [], out
    assert not (root / "out.ckpt").exists()


@pytest.mark.parametrize("output,says", OUTPUTS)
def test_consolidate_refuses_an_output_it_cannot_write(output, says, ran):
    status, out, _ = ran[1][("consolidate", LAST, output)]
    assert status == 2 and says in out and "Traceback" not in out, out


def test_the_python_function_refuses_as_the_command_does(checkpoints):
    from lightning_pipe.lightning.sharded import consolidate_checkpoint

    root, folder, _ = checkpoints
    with pytest.raises(FileNotFoundError, match="a folder of checkpoints.*pass one of the 2"):
        consolidate_checkpoint(str(folder), str(root / "out.ckpt"))
    with pytest.raises(NotADirectoryError, match="is a file, not a directory: a one-file checkpoint"):
        consolidate_checkpoint(str(root / "full.ckpt"), str(root / "out.ckpt"))


@pytest.mark.parametrize("without", [None, "pytorch_lightning", "lightning"])
def test_consolidate_writes_the_one_file_checkpoint(without, checkpoints):
    """With both of Lightning's packages installed, and with either one alone (the other made unimportable):
    ``pip install lightning_pipe`` brings ``lightning`` only."""
    root, folder, model = checkpoints
    if without is None:
        result = command("consolidate", folder / "last.ckpt", root / "out.ckpt")
    else:
        blocked = [without, "lightning_fabric"] if without == "pytorch_lightning" else [without]
        code = (f"import runpy, sys\nsys.modules.update(dict.fromkeys({blocked!r}))\n"
                f"sys.argv = ['lightning_pipe', 'consolidate', {str(folder / 'last.ckpt')!r}, "
                f"{str(root / 'out.ckpt')!r}]\n"
                "runpy.run_module('lightning_pipe', run_name='__main__')\n")
        result = run_command([sys.executable, "-c", code], timeout=120, expect_ok=False, name="consolidate")
    assert result.returncode == 0 and f"wrote {root / 'out.ckpt'}" in result.stdout, result.stdout
    written = torch.load(root / "out.ckpt", weights_only=True)
    assert written["global_step"] == 4
    torch.testing.assert_close(written["state_dict"], model.state_dict(), rtol=0, atol=0)


@pytest.mark.timeout(900)
def test_consolidate_a_checkpoint_of_a_multi_process_run(jobs, tmp_path):
    """A sharded checkpoint written by two processes (tests/jobs.py), consolidated by the command: the one-file
    checkpoint the same run saved in full, bit for bit."""
    directory = jobs.directory("sharded-resume-full") / "ckpts" / "epoch=1.ckpt"
    result = command("consolidate", directory, tmp_path / "epoch=1.ckpt")
    assert result.returncode == 0, result.stdout
    mine = torch.load(tmp_path / "epoch=1.ckpt", weights_only=True)
    theirs = torch.load(jobs.directory("full-twin-of-sharded") / "ckpts" / "epoch=1.ckpt", weights_only=True)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "epoch", "global_step"):
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)
