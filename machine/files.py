"""The one atomic file write of the owner's machine (worker, hooks, launcher).

Imports only ``os``: the hooks load it (I7) and the launcher runs outside the package.
"""
import os


def write_atomic(path, data: bytes | str, *, mode: int = 0o600, sync: bool = True) -> None:
    """Replace the file ``path`` (str or path-like) by ``data`` (bytes, or str written as
    UTF-8) all at once: a reader sees the old file or the new one, never a part.

    Written to ``<path>.<pid>.tmp`` in the same folder (created with ``mode`` and set to
    it exactly, so a secret is never readable by others, not even briefly), then renamed
    over ``path``. ``sync``: the data is fsynced before the rename and the folder after
    it, so the new file survives a power loss once this returns; without it (a snapshot
    that another record backs, I7) a crash may leave the old file. The temporary file is
    removed when a step fails, and the OSError raised."""
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.tmp"
    if isinstance(data, str):
        data = data.encode()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # O_CREAT's mode passes the umask, and a leftover tmp keeps its own
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync:
        _sync_folder(os.path.dirname(path) or ".")


def _sync_folder(folder: str) -> None:
    """fsync a folder (its new entry durable); a system that cannot is left as it is."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def bell_open(path) -> int:
    """A doorbell (issue 43: a waiting reader costs nothing): the FIFO ``path`` (mode
    0600, made if missing), opened for reading and writing, so it never reports an end
    of file and ``select`` on the returned descriptor blocks until someone rings. The
    caller drains it (``bell_drain``) before it looks at what the ring announced."""
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:
        pass
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def bell_drain(fd: int) -> None:
    """Read every ring waiting on doorbell ``fd`` (``bell_open``)."""
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def bell_ring(path) -> None:
    """Ring the doorbell FIFO ``path``: one byte, never blocking. Nobody listening (no
    FIFO yet, or its reader gone) or a full pipe (rings already waiting) is fine: the
    reader also looks by itself now and then."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # FileNotFoundError, ENXIO (no reader)
        return
    try:
        os.write(fd, b"\0")
    except OSError:  # EAGAIN: the pipe is full of rings not yet read
        pass
    finally:
        os.close(fd)
