"""Folders: the K4 path rules and the A8 folder lock, shared by acceptance and by the
promotion of a queued follow-up (G8), which checks A8 when its turn comes."""
import posixpath
import unicodedata

from core.errors import ApplicationError
from tasks_app.models import Task
from tasks_app.services.locking import advisory_xact_lock


def folder_problem(folder: str) -> str | None:
    """Why ``folder`` is not an acceptable absolute path (K4), or None."""
    if not folder.startswith("/"):
        return "must be an absolute path"
    if ".." in folder.split("/") or "\x00" in folder:
        return "must not contain '..' or NUL"
    return None


def normalize_folder(folder: str) -> str:
    """An absolute, normalised POSIX path. Raises ApplicationError 400 ``invalid`` for a
    relative path or one with ``..`` components (K4)."""
    problem = folder_problem(folder)
    if problem:
        raise ApplicationError("invalid", f"folder {problem}", fields={"folder": [problem]})
    return posixpath.normpath(folder).replace("//", "/")


def path_within(path: str, root: str) -> bool:
    """True when ``path`` is ``root`` or below it (both normalised absolute paths)."""
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root if root == "/" else root + "/")


def folder_lock_key(folder: str) -> str:
    """How A8 compares folders: Unicode NFC and case-folded. The worker usually runs on a
    Mac, whose default file system treats ``Repo`` and ``repo`` (and NFC/NFD spellings of
    ``café``) as one folder; the service cannot tell, so it assumes they may be, and two
    exclusive tasks never share a folder under different spellings. Paths are stored and
    sent to the worker exactly as given."""
    return unicodedata.normalize("NFC", folder).casefold()


def folder_lock_holder(machine_id, folder: str) -> Task | None:
    """A8: the unfinished exclusive task of machine ``machine_id`` that holds ``folder``,
    an ancestor or a descendant, or None. Takes the per-machine lock first (so two
    acceptances, or an acceptance and a promotion, for nested folders cannot both pass);
    callers hold the owner's budget row already (P2: budget, then this lock)."""
    advisory_xact_lock(f"folder-lock:{machine_id}")
    mine = folder_lock_key(folder)
    for holder in Task.objects.filter(machine_id=machine_id, holds_lock=True).only("id", "folder"):
        theirs = folder_lock_key(holder.folder)
        if path_within(mine, theirs) or path_within(theirs, mine):
            return holder
    return None


def folder_locked_error(holder: Task) -> ApplicationError:
    """The A6 refusal for a folder ``holder`` locks: 409 ``folder_locked`` with its id."""
    return ApplicationError("folder_locked", "an unfinished exclusive task holds this folder, an ancestor or a "
                            "descendant", status_code=409, task_id=str(holder.id))
