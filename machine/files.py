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
