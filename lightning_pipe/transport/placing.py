"""Checkpoints put into place so that a crash at any moment leaves one to resume from, and what dead saves left.

A checkpoint is written beside its target under a hidden staging name (:func:`staging`), then put into place.
A file is renamed over its target (``os.replace``: atomic). A sharded checkpoint is a directory, and no rename
replaces a directory that holds files, so :func:`put_in_place` swaps it with the target in one step where the
file system can (Linux's ``renameat2(RENAME_EXCHANGE)``: ext4, XFS, Btrfs, tmpfs, ...), and the target holds a
whole checkpoint at every moment; elsewhere (NFS refuses the swap, as may other file systems) it takes two
renames::

    target -> .<name>.old-<owner>      a crash here leaves no target: the previous checkpoint is in .old-
    .<name>.partial-<owner> -> target
    .<name>.old-<owner> removed        (after a swap: the .partial- name, holding the previous one)

The staging names say whose they are, ``<owner>`` = ``<pid>.<machine>`` (``machine``: this boot of this machine
and its pid namespace), so that what a dead save left can be told from a save in progress: :func:`sweep` clears
a folder of what processes that no longer run left behind (each crashed, restarted or requeued job leaves its
staging directory), and puts a dead save's ``.old-`` back at its target when that target is missing: the
checkpoint that was there before the interrupted save, which ``fit(ckpt_path="last")`` then finds. A staging
name is cleared when its process is provably gone: written on this machine in this boot and pid namespace, its
pid no longer running. Another machine's or another container's are cleared only once nothing in them has changed
for a day (:data:`STALE_SECONDS`: a save in progress keeps writing; a job requeued on other nodes leaves its dead
saves behind otherwise); a running process's here are never touched, nor names without an owner of this form
(earlier versions wrote the pid alone). A save never half happened: what it wrote is in place, or the previous
checkpoint is, and a sweep puts the previous one back rather than finishing a dead save.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import re
import shutil
import sys
import time

__all__: list[str] = []

log = logging.getLogger(__name__)

#: The staging kinds: a file being written, a directory being written, the previous checkpoint being replaced.
TMP, PARTIAL, OLD = ".tmp", ".partial-", ".old-"

#: The owner part of a staging name: ``<pid>.<boot>-<pid namespace>`` (see :func:`machine`).
_OWNED = re.compile(r"(?P<pid>\d+)\.(?P<machine>[0-9a-f]{12}-\d+)$")

#: DCP's metadata file, written last: what makes a staged directory a complete checkpoint.
_META = ".metadata"


@functools.lru_cache(maxsize=1)
def machine() -> str:
    """This boot of this machine and this process's pid namespace (``<boot id's first 12 hex digits>-<namespace
    inode>``), the only place where a pid says whether its process runs; empty where they cannot be read (then
    nothing this process stages can be cleared by another)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip().replace("-", "")[:12]
        namespace = re.sub(r"\D", "", os.readlink("/proc/self/ns/pid"))
    except OSError:
        return ""
    return f"{boot}-{namespace}" if len(boot) == 12 and namespace else ""


def owner() -> str:
    """This process's part of the staging names it writes."""
    return f"{os.getpid()}.{machine()}" if machine() else str(os.getpid())


def staging(path: str, kind: str) -> str:
    """Where a checkpoint for ``path`` is staged: beside it, hidden, tagged ``kind`` (:data:`TMP` for a file,
    :data:`PARTIAL` for a sharded directory, :data:`OLD` for what it replaces) and :func:`owner`, and never
    holding Lightning's ``hpc_ckpt_`` (Lightning takes the digits of every name holding it for a version, so a
    half-written ``hpc_ckpt_2.ckpt.tmp123`` would make every later resume look for version 2123)."""
    head, tail = os.path.split(os.path.normpath(path))
    return os.path.join(head, f".{tail.replace('hpc_ckpt_', 'hpc-ckpt-')}{kind}{owner()}")


def parse(name: str) -> tuple[str, str, int, str] | None:
    """A staging name's target name, kind, owner's pid and machine; None for any other name (an owner without
    a machine included: nothing can prove it dead)."""
    if not name.startswith("."):
        return None
    for kind in (PARTIAL, OLD, TMP):
        at = name.rfind(kind)
        found = _OWNED.match(name, at + len(kind)) if at > 1 else None
        if found is not None:
            return name[1:at].replace("hpc-ckpt-", "hpc_ckpt_"), kind, int(found["pid"]), found["machine"]
    return None


def _running(pid: int) -> bool:
    if pid <= 0:
        return True  # no process of its own: not provably gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (PermissionError: another user's, running)
        return True
    return True


def dead(pid: int, where: str) -> bool:
    """Whether the process ``pid`` of ``where`` (a :func:`machine`) provably no longer runs."""
    return bool(where) and where == machine() and not _running(pid)


#: How long a staging name of another machine may go unchanged before a sweep takes its save for dead: no save
#: writes nothing for a day (a file grows, a directory gains files), and a job requeued on other nodes would
#: otherwise leave its dead saves' staging names beside the checkpoints for good.
STALE_SECONDS = 24 * 3600.0


def stale(path: str, where: str) -> bool:
    """Whether ``path``, staged by a process of another machine ``where``, has not changed (nor anything under it)
    for :data:`STALE_SECONDS`: its save is over, or dead."""
    if where == machine():
        return False  # this machine's are judged by their process
    try:
        newest = max([os.lstat(path).st_mtime] + [os.lstat(os.path.join(top, name)).st_mtime
                                                  for top, _, names in os.walk(path) for name in names])
    except OSError:
        return False
    return time.time() - newest > STALE_SECONDS


def _complete(path: str) -> bool:
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, _META))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def sweep(folder: str) -> list[str]:
    """Clear ``folder`` of what saves of processes that provably no longer run left (see the module's docstring),
    a dead save's ``.old-`` put back at its target where the target is missing; what was done, one line each.
    Safe to run in several processes at once (each rename and removal happens once)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:  # no folder (yet), or a remote one
        return []
    done: list[str] = []
    for name in names:
        parsed = parse(name)
        path = os.path.join(folder, name)
        if parsed is None or not (dead(parsed[2], parsed[3]) or stale(path, parsed[3])):
            continue
        target_name, kind, pid, _ = parsed
        target = os.path.join(folder, target_name)
        try:
            if kind == OLD and not os.path.lexists(target) and _complete(path):
                os.rename(path, target)
                done.append(f"{target}: put back from {name} (the save that replaced it, by process {pid}, "
                            "died midway)")
                log.warning("checkpoint %s", done[-1])
                continue
            _remove(path)
        except OSError:  # another process swept it first
            continue
        why = "which no longer runs" if parsed[3] == machine() else "of another machine, unchanged for a day"
        done.append(f"{path}: removed (left by process {pid}, {why})")
        log.info("checkpoint staging %s", done[-1])
    return done


def recover(path: str) -> bool:
    """If ``path`` is missing, put back the checkpoint a dead save left under its ``.old-`` name (and clear what
    dead saves left beside it); whether ``path`` exists now."""
    path = os.fspath(path)
    if "://" not in path and not os.path.lexists(path):
        sweep(os.path.dirname(os.path.abspath(path)))
    return os.path.lexists(path)


@functools.lru_cache(maxsize=1)
def _renameat2() -> object:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28 and later
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return function


#: renameat2's flag to swap two paths; its ``dirfd`` for paths relative to the working directory.
_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` in one step; False (nothing done) where the system or the file system has
    no such swap; an ``OSError`` for any other failure."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"could not swap {a} and {b}: {os.strerror(code)}")


def flush(path: str) -> None:
    """Have what ``path`` holds (a file, or every file under a directory and the directory) reach the disk
    (``fsync``), before a rename puts it in place: without it, a crash of the machine soon after the rename may
    leave the name pointing at a file that was never written (ext4, XFS: the rename is journaled first)."""
    if not os.path.isdir(path):
        _fsync(path)
        return
    for top, _, names in os.walk(path):
        for name in names:
            _fsync(os.path.join(top, name))
    _fsync(path)


def replace(staged: str, path: str) -> None:
    """Rename the file ``staged`` over ``path`` (``os.replace``: atomic), its data on the disk before and the
    folder's entry after (:func:`flush`, :func:`flush_folder`)."""
    flush(staged)
    os.replace(staged, path)
    flush_folder(path)


def flush_folder(path: str) -> None:
    """Have the folder holding ``path`` record its entry on the disk (``fsync`` of the folder), after a rename."""
    _fsync(os.path.dirname(os.path.abspath(path)))


def _fsync(name: str) -> None:
    descriptor = os.open(name, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as exc:  # a file system without fsync on directories (some network ones)
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(descriptor)


def put_in_place(staged: str, path: str) -> None:
    """Put the complete directory ``staged`` at ``path``, replacing whatever is there (see the module's
    docstring: at every moment ``path`` holds the previous checkpoint or this one, or, on a file system without
    a swap, the previous one is under its ``.old-`` name, which :func:`sweep` puts back). What ``staged`` holds
    reaches the disk first (:func:`flush`), and the renames after."""
    flush(staged)
    if not os.path.lexists(path):
        os.rename(staged, path)
    elif os.path.isdir(path) and not os.path.islink(path) and exchange(staged, path):
        _remove(staged)  # the previous checkpoint, now under the staging name
    else:
        old = staging(path, OLD)
        os.rename(path, old)
        os.rename(staged, path)
        _remove(old)
    flush_folder(path)
