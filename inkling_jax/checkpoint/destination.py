"""Taking an output directory atomically, for every writer of checkpoints (`inkling-convert`, `save_pretrained`,
the NVFP4 quantiser): `with taken(dst, src=...) as work:` fills `work`, which then becomes `dst`.

The output is built in a hidden sibling directory and renamed onto `dst` at the end with
`renameat2(RENAME_NOREPLACE)`, which fails if anything appeared at `dst` meanwhile. Replacing an earlier output of
the converter (`overwrite`: a directory holding our marker and only what the marker lists) is one
`RENAME_EXCHANGE`, after which what was swapped out is checked once more, and swapped back if it is no longer such
an output; only then is it deleted. Nothing else is ever deleted. A lock beside `dst` (`flock`, which the kernel
drops when its process dies) makes two writers of one destination one success and one clear failure, and a `dst`
that is, contains or lies inside the source is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import secrets
import shutil

MARKER = ".inkling-convert-output.json"  # in every output of inkling-convert: what --overwrite may replace
MARKER_FORMAT = "inkling-jax/convert-output/1"
_NOREPLACE, _EXCHANGE, _AT_FDCWD = 1, 2, -100  # renameat2's flags, and "relative to the working directory"
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


class DestinationError(FileExistsError):
    """The destination cannot be taken: something is (or appeared) there, another writer holds it, or it overlaps
    the source."""


@contextlib.contextmanager
def taken(dst: str, *, src: str | None = None, overwrite: bool = False, marker: dict | None = None):
    """Yields an empty work directory beside `dst`; when the block ends without an error it becomes `dst`, and
    on any error it is removed. src: refuse a `dst` that is, contains or lies inside it. marker: fields of the
    marker file written into the output (the converter's outputs carry one); overwrite: replace a `dst` that is
    an earlier output carrying the marker."""
    dst = _resolved(dst)
    if src is not None:
        _check_apart(os.path.realpath(src), dst)
    parent, name = os.path.split(dst)
    os.makedirs(parent, exist_ok=True)
    with _locked(os.path.join(parent, f".{name}.inkling-lock"), dst):
        if os.path.lexists(dst) and not overwrite:
            hint = " (pass --overwrite to replace an earlier output of inkling-convert)" if marker is not None else ""
            raise DestinationError(f"{dst}: already exists{hint}")
        if os.path.lexists(dst) and (reason := not_replaceable(dst)):
            raise DestinationError(f"{dst}: --overwrite replaces only an earlier output of inkling-convert, and this "
                                   f"{reason}; left as it is")
        _remove_abandoned(parent, name)
        work = os.path.join(parent, f".{name}.inkling-partial-{os.getpid()}.{secrets.token_hex(4)}")
        os.mkdir(work)
        try:
            yield work
            if marker is not None:
                _write_marker(work, marker)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        _publish(work, dst, overwrite)


def not_replaceable(path: str) -> str | None:
    """Why `path` is not an earlier output of inkling-convert that --overwrite may replace (None: it is one)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return "is a symbolic link" if os.path.islink(path) else "is a file"
    try:
        with open(os.path.join(path, MARKER)) as fh:
            marker = json.load(fh)
        entries = set(marker["entries"]) if marker.get("format") == MARKER_FORMAT else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        entries = None
    if entries is None:
        return f"has no {MARKER} of ours"
    extra = sorted(set(os.listdir(path)) - entries - {MARKER})
    return f"holds {extra[0]}, which inkling-convert did not write" if extra else None


def _resolved(dst: str) -> str:
    """`dst` absolute, its parent's symbolic links resolved (not dst's own: a rename replaces the link)."""
    parent, name = os.path.split(os.path.abspath(os.fspath(dst)))
    if not name:
        raise DestinationError(f"{dst}: not a path a directory can be created at")
    return os.path.join(os.path.realpath(parent), name)


def _check_apart(src: str, dst: str) -> None:
    for target in {dst, os.path.realpath(dst)}:
        common = os.path.commonpath([src, target])
        if common in (src, target):
            how = "is" if src == target else "lies inside" if common == src else "contains"
            raise DestinationError(f"{dst}: the destination {how} the source {src}; write the output elsewhere")


@contextlib.contextmanager
def _locked(lock: str, dst: str):
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise DestinationError(f"{dst}: another process{f' ({holder})' if holder else ''} is writing it; nothing "
                                   f"was done") from None
        try:
            current = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)  # its last holder removed the file after we opened it: lock the one there now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()}".encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)  # while still locked, so a process that opened this file retries (see above)
        os.close(fd)


def _remove_abandoned(parent: str, name: str) -> None:
    """Delete the work directories of earlier writers of `dst` whose process is gone (one killed with SIGKILL
    cannot clean up after itself); those of processes still alive are left alone."""
    prefix = f".{name}.inkling-partial-"
    for entry in os.listdir(parent):
        pid = entry[len(prefix):].split(".")[0] if entry.startswith(prefix) else ""
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _write_marker(work: str, fields: dict) -> None:
    entries = sorted(os.listdir(work))
    with open(os.path.join(work, MARKER), "w") as fh:
        json.dump({"format": MARKER_FORMAT, **fields, "entries": entries}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _sync_directory(work)


def _publish(work: str, dst: str, overwrite: bool) -> None:
    """Rename `work` onto `dst`: only if nothing is there, or (overwrite) swapping out an earlier output."""
    if overwrite and os.path.lexists(dst):
        try:
            _rename(work, dst, _EXCHANGE)  # `work` now holds what was at dst
        except OSError:
            shutil.rmtree(work)
            raise
        if reason := not_replaceable(work):
            _rename(work, dst, _EXCHANGE)
            shutil.rmtree(work)
            raise DestinationError(f"{dst}: changed during the run and now {reason}; left as it is, the output "
                                   f"was discarded")
        shutil.rmtree(work)
    else:
        try:
            _rename(work, dst, _NOREPLACE)
        except OSError as e:
            shutil.rmtree(work)
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise
            raise DestinationError(f"{dst}: appeared during the run; left as it is, the output was discarded") from None
    _sync_directory(os.path.dirname(dst))


def _rename(src: str, dst: str, flags: int) -> None:
    """renameat2(src, dst, flags). Where the C library or the file system lacks it: for _NOREPLACE a check then a
    rename (under the lock; rename itself refuses a non-empty directory or a file at dst), for _EXCHANGE two
    renames through a side name."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(code, os.strerror(code), dst)
    if flags == _NOREPLACE:
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
        os.rename(src, dst)
        return
    side = f"{src}.swap"
    os.rename(dst, side)
    try:
        os.rename(src, dst)
    except OSError:
        os.rename(side, dst)
        raise
    os.rename(side, src)


def _sync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
