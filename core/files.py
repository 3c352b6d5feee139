"""Files that are never half-written, directories we may write into, and deletions that are never half-done.

Every output of the project (configs, manifests, metrics summaries, reports) goes through
``atomic_write_text``/``atomic_write_bytes``: a temporary file in the same directory, fsync, then an
atomic rename, so a crash never leaves a truncated file under its final name.

Output directories carry a marker file, ``.pretrain-output.json`` (``{"kind": KIND}``, KIND one of
``run``, ``release``, ``corpus``, ``sweep``, ``report``, ``demo``). ``claim_output_dir`` (every command that writes: ``train``,
``finetune``, ``sweep``, ``prepare``, ``report``, ``demo``; ``export`` through ``check_output_dir``) writes
only into a directory that is new, empty, or marked with the same kind; a user's folder is refused,
never emptied — also one that merely looks like ours (a ``config.yaml`` next to ``checkpoints/``): a
directory an older version wrote is adopted only once its owner adds the marker (``mark_command``).

Reading is confined the same way: ``inside`` refuses a file of a corpus, run dir or release that
resolves outside it (a symlink out), and ``copy_tree`` copies regular files only, never a link.
``lock_dir`` keeps a second job out of a directory one job is writing (an advisory ``flock`` on its
``.lock``, released when the process ends however it ends). ``discard`` deletes by renaming into a ``.trash-*`` sibling first, and ``replace_dir`` swaps a
finished directory in with one atomic exchange, so a kill at any moment leaves either the old or the
new directory under its name — never a missing or half-deleted one.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import os
import shlex
import shutil
import socket
import stat
import tempfile
import time
import uuid
from pathlib import Path

from core.errors import ConfigError

__all__ = ["atomic_write_text", "atomic_write_bytes", "sha256_file", "MARKER", "OutputDirError", "output_kind",
           "claim_output_dir", "check_output_dir", "mark_command", "inside", "tree_inside", "copy_file", "copy_tree",
           "OutsideError", "discard", "clean_trash", "replace_dir", "fsync_dir", "lock_dir", "unlock_dir"]

MARKER = ".pretrain-output.json"
LOCK = ".lock"

log = logging.getLogger(__name__)

_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and an atomic rename."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644 & ~_UMASK)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise




def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


class OutputDirError(ConfigError):
    """An output directory we may not write into (a user's folder, or one of another kind)."""


def output_kind(path: str | os.PathLike) -> str | None:
    """The kind recorded in ``path``'s marker, or None (no marker / unreadable marker)."""
    marker = Path(path) / MARKER
    if marker.is_symlink():  # a marker is a file we wrote, never a link to one
        return None
    try:
        return str(json.loads(marker.read_text(encoding="utf-8"))["kind"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_output_dir(path: str | os.PathLike, kind: str, *, what: str, overwrite: bool = False,
                     reuse: bool = False) -> bool:
    """Refuse ``path`` unless it is missing, empty, or ours of the same ``kind``; True if it holds one of ours.

    ``reuse``: an existing directory of the same kind is written into (run dirs, corpora);
    otherwise it is replaced only with ``overwrite`` (releases).
    """
    p = Path(path)
    if not p.exists():
        return False
    if not p.is_dir() or p.is_symlink():
        raise OutputDirError(f"{what} {p} exists and is not a directory we created (a file or a symlink). "
                             f"Choose a new path; nothing was written.")
    if not any(p.iterdir()):
        return False
    found = output_kind(p)
    if found is None:
        raise OutputDirError(f"{what} {p} is not empty and was not created by pretrain (no {MARKER} marker); "
                             f"refusing to write into or replace it, so nothing of yours is overwritten. Choose a "
                             f"new or empty directory, or move its contents away yourself. If it is a {kind} directory an "
                             f"older pretrain wrote (before markers), mark it as one yourself: {mark_command(p, kind)}")
    if found != kind:
        raise OutputDirError(f"{what} {p} holds a pretrain {found} directory, not a {kind}; refusing to write into "
                             f"or replace it. Choose another path.")
    if not reuse and not overwrite:
        raise OutputDirError(f"{what} {p} already holds a {kind}; pass --overwrite to replace it (the old one is "
                             f"deleted only after the new one is complete), or choose a new path.")
    return True


def mark_command(path: str | os.PathLike, kind: str) -> str:
    """The shell command that marks ``path`` as our ``kind`` directory (for one an older version wrote)."""
    return f"echo '{{\"kind\": \"{kind}\"}}' > {shlex.quote(str(Path(path) / MARKER))}"


def claim_output_dir(path: str | os.PathLike, kind: str, *, what: str) -> Path:
    """Create (or re-open) ``path`` as our ``kind`` directory, writing the marker; refuse anything else.

    The one gate of every command that writes: a directory is ours only by its marker, never by its
    contents looking like ours (a user's folder with a ``config.yaml`` and ``checkpoints/`` is refused).
    """
    p = Path(path)
    check_output_dir(p, kind, what=what, reuse=True)
    p.mkdir(parents=True, exist_ok=True)
    if output_kind(p) != kind:
        atomic_write_text(p / MARKER, json.dumps({"kind": kind}) + "\n")
    return p


class OutsideError(ConfigError):
    """A file of a corpus, run dir or release that resolves outside it (a symlink out, or ``..``)."""


def inside(root: str | os.PathLike, path: str | os.PathLike, *, what: str) -> Path:
    """``path`` (absolute, or relative to ``root``), refused unless it resolves inside ``root``.

    Links that stay inside are fine; one that leads out (or a ``..`` name) is refused before the file
    is opened, so nothing outside the directory the user named is read.
    """
    top = Path(os.path.realpath(root))
    p = Path(root) / path
    real = Path(os.path.realpath(p))
    if real != top and top not in real.parents:
        raise OutsideError(f"{p} ({what}) resolves to {real}, outside {top}: a file must lie inside the directory it "
                           f"belongs to, not be a symlink (or '..' path) to elsewhere. Copy the file in instead of "
                           f"linking it, or use a directory written by pretrain.")
    return p


def tree_inside(root: str | os.PathLike, directory: str | os.PathLike, *, what: str, links: bool = True) -> Path:
    """``directory`` (absolute, or relative to ``root``: ``"."`` is ``root`` itself) and every file and folder
    in it, refused unless each resolves inside ``root``.

    ``links=False``: any symlink in it is refused, even one that stays inside (a directory that is
    copied into checkpoints, where links are never followed).
    """
    d = inside(root, directory, what=what)
    for dirpath, dirnames, filenames in os.walk(os.path.abspath(d), followlinks=False):  # absolute: never re-joined to root
        for name in [*dirnames, *filenames]:
            entry = Path(dirpath) / name
            inside(root, entry, what=f"a file of {what}")
            if not links and entry.is_symlink():
                raise OutsideError(f"{entry} (a file of {what}) is a symlink; this directory is copied into checkpoints, "
                                   f"where links are never followed. Replace the link with the file itself.")
    return d


def copy_file(src: str | os.PathLike, dst: str | os.PathLike, *, what: str) -> None:
    """Copy regular file ``src`` to ``dst``; a symlink (or a device, a fifo) is refused, never followed."""
    try:
        fd = os.open(src, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        if os.path.islink(src):
            raise OutsideError(f"{src} ({what}) is a symlink; links are never followed or copied. Replace it with the "
                               f"file itself.") from None
        raise
    with os.fdopen(fd, "rb") as fin:
        if not stat.S_ISREG(os.fstat(fin.fileno()).st_mode):
            raise OutsideError(f"{src} ({what}) is not a regular file; only regular files are copied.")
        with open(dst, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike, *, what: str) -> None:
    """Copy directory ``src`` to new ``dst``: regular files and directories only; a link is refused, never followed."""
    src, dst = Path(src), Path(dst)
    if src.is_symlink():
        raise OutsideError(f"{src} ({what}) is a symlink; links are never followed or copied.")
    for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
        here = Path(dirpath)
        (dst / here.relative_to(src)).mkdir(parents=True, exist_ok=True)
        for name in dirnames:
            if (here / name).is_symlink():
                raise OutsideError(f"{here / name} (in {what} {src}) is a symlink; links are never followed or copied. "
                                   f"Replace it with the folder itself.")
        for name in filenames:
            copy_file(here / name, dst / (here / name).relative_to(src), what=f"in {what} {src}")


def discard(path: str | os.PathLike) -> None:
    """Delete a file or directory: first renamed to a ``.trash-*`` sibling (atomic), then removed."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        return
    trash = p.parent / f".trash-{p.name}-{uuid.uuid4().hex[:8]}"
    os.replace(p, trash)
    fsync_dir(p.parent)
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)


def clean_trash(parent: str | os.PathLike) -> None:
    """Finish deletions a killed process left half-done (``.trash-*`` entries of ``parent``)."""
    p = Path(parent)
    for t in p.glob(".trash-*") if p.is_dir() else []:
        if t.is_dir() and not t.is_symlink():
            shutil.rmtree(t, ignore_errors=True)
        else:
            t.unlink(missing_ok=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def replace_dir(new: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Put directory ``new`` at ``dst``; an existing ``dst`` is swapped out atomically, then discarded.

    Linux ``renameat2(RENAME_EXCHANGE)`` swaps the two names in one step; elsewhere the old one is
    renamed to trash first (a kill between the two renames leaves it recoverable under ``.trash-*``).
    """
    new, dst = Path(new), Path(dst)
    if not dst.exists():
        os.replace(new, dst)
        fsync_dir(dst.parent)
        return
    if _exchange(new, dst):  # dst now holds the new tree, `new` the old one
        fsync_dir(dst.parent)
        discard(new)
        return
    trash = dst.parent / f".trash-{dst.name}-{uuid.uuid4().hex[:8]}"
    os.replace(dst, trash)
    os.replace(new, dst)
    fsync_dir(dst.parent)
    shutil.rmtree(trash, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE)
    return rc == 0


def fsync_dir(path: Path) -> None:
    """Make a rename or new entry in ``path`` durable (the directory's own metadata)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_dir(directory: str | os.PathLike, *, what: str, fix: str) -> int | None:
    """Hold an exclusive lock on ``directory`` (ours already) for this process; return its descriptor.

    A second job there (the same command started twice, a rerun while an orphaned one still trains)
    would interleave its metrics with the first's and overwrite its checkpoints: it is refused, naming
    the holder. ``flock`` ends with the process, so a killed job never leaves a stale lock. A
    filesystem without locks (Lustre mounted without ``flock``) gets a warning, not a refusal.
    """
    path = Path(directory) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode("utf-8", errors="replace").strip() or "a process"
        os.close(fd)
        raise ConfigError(f"{directory} is in use: {holder} is writing this {what} now. Two jobs in one {what} would "
                          f"mix their metrics and overwrite each other's checkpoints. Wait for it to end (or stop "
                          f"it), or {fix}.") from None
    except OSError as exc:
        os.close(fd)
        log.warning("Cannot lock %s (%s): nothing stops a second job from writing it at the same time.", path, exc)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    return fd


def unlock_dir(fd: int | None) -> None:
    """Release ``lock_dir``'s lock (the file stays: removing it would let two jobs lock different files)."""
    if fd is not None:
        os.close(fd)
