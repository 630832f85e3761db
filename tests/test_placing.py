"""Checkpoints put into place crash-safely, and what dead saves left cleared: only theirs, never a live one's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_pipe.transport import placing


def _checkpoint(path: Path, tag: str) -> Path:
    """A complete sharded checkpoint's directory (DCP's .metadata in), its file saying which it is."""
    path.mkdir()
    (path / ".metadata").write_text("index")
    (path / "__0_0.distcp").write_text(tag)
    return path


def _which(path: Path) -> str:
    return (path / "__0_0.distcp").read_text()


def _dead_pid() -> int:
    """The pid of a process of this machine that has exited (and been reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           timeout=60, check=True)
    return int(child.stdout)


def _name(target: str, kind: str, pid: int, machine: str | None = None) -> str:
    return f".{target}{kind}{pid}.{placing.machine() if machine is None else machine}"


needs_proc = pytest.mark.skipif(not placing.machine(), reason="no /proc boot id and pid namespace on this system")


@needs_proc
def test_a_staging_name_says_whose_it_is_and_where_it_goes():
    staged = placing.staging("/ckpts/hpc_ckpt_2.ckpt", placing.PARTIAL)
    name = os.path.basename(staged)
    assert "hpc_ckpt_" not in name  # no version for Lightning's requeue to read (tests/test_restart.py)
    assert placing.parse(name) == ("hpc_ckpt_2.ckpt", placing.PARTIAL, os.getpid(), placing.machine())
    assert placing.parse("last.ckpt") is None and placing.parse(".last.ckpt.partial-123") is None  # no owner
    assert placing.parse(".metadata.tmp") is None


@needs_proc
@pytest.mark.timeout(120)
def test_a_sweep_clears_only_what_provably_dead_processes_left(tmp_path):
    """Each crashed, restarted or requeued job leaves its staging directory behind: the next save, resume or launch
    clears those of processes that no longer run on this machine, and puts back a checkpoint a dead save was
    replacing (its target missing). A running process's staging (a save in progress: this test's own pid), another
    machine's or container's (its process may run there), one named by an earlier version (a pid alone) and a
    name that is no staging name are left as they are."""
    dead = _dead_pid()
    _checkpoint(tmp_path / "epoch=1.ckpt", "epoch 1")
    _checkpoint(tmp_path / _name("last.ckpt", placing.OLD, dead), "the last one before the crash")
    _checkpoint(tmp_path / _name("last.ckpt", placing.PARTIAL, dead), "the one being put in its place")
    _checkpoint(tmp_path / _name("epoch=1.ckpt", placing.OLD, dead), "what epoch 1 replaced")  # target there
    (tmp_path / _name("epoch=0.ckpt", placing.TMP, dead)).write_bytes(b"half a file")
    kept = [_name("epoch=2.ckpt", placing.PARTIAL, os.getpid()),  # a save in progress
            _name("epoch=3.ckpt", placing.PARTIAL, dead, "0123456789ab-4026531836"),  # another machine's
            f".epoch=4.ckpt.partial-{dead}",  # an earlier version's: nothing proves its process dead
            ".hidden", "notes.txt"]
    for name in kept:
        (tmp_path / name).mkdir()

    done = placing.sweep(str(tmp_path))

    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "epoch=1.ckpt", "last.ckpt"]), done
    assert _which(tmp_path / "last.ckpt") == "the last one before the crash"
    assert _which(tmp_path / "epoch=1.ckpt") == "epoch 1"
    assert len(done) == 4 and sum("put back" in line for line in done) == 1, done
    assert placing.sweep(str(tmp_path)) == []  # nothing left to do


@needs_proc
def test_recover_puts_back_a_missing_checkpoint_only(tmp_path):
    dead = _dead_pid()
    _checkpoint(tmp_path / _name("last.ckpt", placing.OLD, dead), "before")
    assert placing.recover(str(tmp_path / "last.ckpt"))
    assert _which(tmp_path / "last.ckpt") == "before"
    assert not placing.recover(str(tmp_path / "never.ckpt"))


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "two-renames"])
def test_put_in_place_replaces_a_checkpoint_and_leaves_nothing_else(tmp_path, monkeypatch, swap):
    """Swapped in one step where the file system can (the target whole at every moment), by two renames where it
    cannot: the same result, the staging directory gone either way."""
    if not swap:
        monkeypatch.setattr(placing, "exchange", lambda a, b: False)
    elif not placing.exchange(str(_checkpoint(tmp_path / "a", "a")), str(_checkpoint(tmp_path / "b", "b"))):
        pytest.skip("this file system has no swap (renameat2's RENAME_EXCHANGE)")
    else:
        assert _which(tmp_path / "a") == "b" and _which(tmp_path / "b") == "a"  # swapped, both whole
        for name in ("a", "b"):
            placing._remove(str(tmp_path / name))
    target = _checkpoint(tmp_path / "last.ckpt", "old")
    staged = _checkpoint(Path(placing.staging(str(target), placing.PARTIAL)), "new")
    placing.put_in_place(str(staged), str(target))
    assert _which(target) == "new" and os.listdir(tmp_path) == ["last.ckpt"]
    staged = _checkpoint(Path(placing.staging(str(tmp_path / "first.ckpt"), placing.PARTIAL)), "first")
    placing.put_in_place(str(staged), str(tmp_path / "first.ckpt"))  # nothing to replace: one rename
    assert _which(tmp_path / "first.ckpt") == "first" and sorted(os.listdir(tmp_path)) == ["first.ckpt", "last.ckpt"]


class _SlowIO:
    """A ``CheckpointIO`` that takes a while to write (a large checkpoint, a slow disk)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):  # noqa: ANN001, ANN201
        import time

        import torch

        time.sleep(0.3)
        torch.save(checkpoint, path)


def test_a_save_through_lightnings_async_checkpoint_io_is_renamed_into_place_once_written(tmp_path):
    """``AsyncCheckpointIO`` writes in a thread and returns at once: the rename over the target came before the
    write had finished (the staged file missing: the save failed, or later a half-written file put in place).
    Now its write is waited for, and the file in place is whole."""
    import torch
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_pipe.lightning.checkpoints import save_atomically

    io = AsyncCheckpointIO(_SlowIO())
    target = tmp_path / "last.ckpt"
    save_atomically(lambda p: io.save_checkpoint({"w": torch.arange(3)}, p), str(target), io)
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.arange(3))
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # nothing staged left behind
    save_atomically(lambda p: io.save_checkpoint({"w": torch.ones(2)}, p), str(target), io)  # a next save works too
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(2))


def test_a_checkpoint_reaches_the_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """A rename journaled before the data it names: after a crash of the machine the target may be an empty
    file. The staged file (a one-file save) or every file of a staged directory is flushed before the rename,
    and the folder after it."""
    from lightning_pipe.lightning.checkpoints import save_atomically

    events: list[str] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}"),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(f"rename {b}"), real_replace(a, b))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(f"rename {b}"), real_rename(a, b))[1])
    target = tmp_path / "one.ckpt"
    save_atomically(lambda p: Path(p).write_text("weights"), str(target))
    staged = [e for e in events if e.startswith("fsync") and ".tmp" in e]
    assert staged and events.index(staged[0]) < events.index(f"rename {target}")
    assert events[-1] == f"fsync {tmp_path}"  # the folder's new entry
    events.clear()
    staged_dir = _checkpoint(tmp_path / ".dir.partial-1", "new")
    placing.put_in_place(str(staged_dir), str(tmp_path / "dir"))
    renames = [k for k, e in enumerate(events) if e.startswith("rename")]
    flushed = [k for k, e in enumerate(events) if e.endswith("__0_0.distcp") or e.endswith(".metadata")]
    assert len(flushed) == 2 and max(flushed) < min(renames)
    assert _which(tmp_path / "dir") == "new"


def test_another_machines_staging_left_unchanged_for_a_day_is_cleared(tmp_path):
    """A job requeued on other nodes left its dead saves' staging names (another machine's) beside the checkpoints
    for good: nothing here can tell whether their process runs. One in which nothing has changed for a day is taken
    for dead now (a save in progress keeps writing), its previous checkpoint put back where the target is missing;
    a fresh one of another machine stays."""
    other = "0123456789ab-4026531836"
    old_partial = _checkpoint(tmp_path / _name("epoch=5.ckpt", placing.PARTIAL, 4242, other), "dead midway")
    old_tmp = tmp_path / _name("epoch=6.ckpt", placing.TMP, 4243, other)
    old_tmp.write_bytes(b"half a file")
    old_old = _checkpoint(tmp_path / _name("last.ckpt", placing.OLD, 4244, other), "the last before the crash")
    fresh = _checkpoint(tmp_path / _name("epoch=7.ckpt", placing.PARTIAL, 4245, other), "being written")
    day_ago = time.time() - placing.STALE_SECONDS - 60
    for path in (old_partial, old_tmp, old_old):
        for inner in [path, *path.rglob("*")]:
            os.utime(inner, (day_ago, day_ago))

    done = placing.sweep(str(tmp_path))

    assert sorted(os.listdir(tmp_path)) == sorted([fresh.name, "last.ckpt"]), done
    assert _which(tmp_path / "last.ckpt") == "the last before the crash"
    assert sum("of another machine, unchanged for a day" in line for line in done) == 2, done
