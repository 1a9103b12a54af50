"""Task acceptance, exactly once (SPEC A1-A8, P1, P2), and queued follow-ups (G8)."""
import uuid
from datetime import datetime

from django.db.models import Q

from core.actors import actor_owner
from core.broadcast import broadcast
from core.errors import ApplicationError
from core.idempotency import Answer
from tasks_app.models import (
    FINAL_STATES,
    Budget,
    ConversationMessage,
    Grant,
    Integration,
    Machine,
    Operation,
    Task,
    TaskState,
)
from tasks_app.services.folders import folder_lock_holder, folder_locked_error, normalize_folder, path_within
from tasks_app.services.locking import for_key_share
from tasks_app.services.machine_choice import ANY, PoolName, machine_pick
from tasks_app.services.pools import pool_machine_ids
from tasks_app.services.transitions import budget_reserve, task_created
from tasks_app.shapes import message_event, task_dict
from tasks_app.signals import task_session_claimed


# A1: the idempotency scope of acceptance (``core.idempotency``), and of a G7 decision,
# whose digest names its task (``integration.decision_digest``).
ACCEPT_SCOPE = "task"


def task_accept(*, owner, data: dict, now: datetime) -> Answer:
    """Accept a task (A1-A8); the view runs this once per (owner, Idempotency-Key) through
    ``core.idempotency.respond_once`` (scope ``ACCEPT_SCOPE``), inside its transaction. A
    follow-up of an unfinished task is accepted in ``queued`` behind it (G8: no budget,
    no folder lock, no ``start`` message until its turn).

    ``data``: the validated fields (machine, folder, agent, prompt, session,
    deep_research, max_runtime_s, exclusive, continue_task?, isolation?; machine is a
    machine id, ``"any"`` or a pool name, C8: ``services.machine_choice``; an unknown
    pool is 400 ``pool_unknown``). Writes the task,
    operation, budget reservation, folder lock and outbox ``start`` message (with the
    idempotency record: all or nothing, A5). Refusals (A6) raise ApplicationError.
    Returns ``(201, task shape, {"task": task})`` (``task_dict``; the task ties the record).
    """
    task = create_task(owner=owner, data=data, now=now)
    return 201, task_dict(task), {"task": task}


CONTINUE_INVALID = "continue_task must be a task of yours on this machine: unfinished, or final with an agent session id"


def _continue_invalid(detail: str = CONTINUE_INVALID) -> ApplicationError:
    return ApplicationError("continue_invalid", detail)


def _followed_task(*, owner, machine, task_id) -> Task | None:
    """G6, G8: the task a follow-up follows. ``task_id`` must name a task of the same
    owner and machine; anything else (another owner's task included) is the same 400
    ``continue_invalid``, so ids leak nothing. The follow-up follows the last unfinished
    task of that conversation (from the named task down its latest follow-ups), so a
    second follow-up queues behind the first and they run in the order accepted. When
    none is unfinished it follows the named task, which must carry an agent session id
    (G6). Called under the owner's budget row lock, which every transition to
    a final state holds too (P2), so the answer cannot go stale before commit."""
    if task_id is None:
        return None
    named = Task.objects.filter(pk=task_id, owner=owner, machine=machine).first()
    if named is None:
        raise _continue_invalid()
    # Down the conversation (each task's latest follow-up), to its last unfinished task.
    task, last_unfinished = named, (named if named.state not in FINAL_STATES else None)
    while (later := Task.objects.filter(continued_from=task).order_by("-created_at", "-pk").first()) is not None:
        task = later
        if task.state not in FINAL_STATES:
            last_unfinished = task
    if last_unfinished is not None:
        return last_unfinished
    if not named.agent_session_id:
        raise _continue_invalid()
    return named


def branch_tasks(root: Task):
    """G7, G8: the tasks on ``root``'s branch: ``root`` and the follow-ups that continue
    its worktree (``branch_of``)."""
    return Task.objects.filter(Q(pk=root.pk) | Q(branch_of=root))


def _follow_up_isolation(followed: Task, requested: str | None) -> tuple[str, Task]:
    """G7, G8: a follow-up of a worktree task runs in the same worktree, on the same
    branch (the agent's session lives there). Returns ``("worktree", first task of the
    branch)``. Raises 400 ``invalid`` for ``isolation: "none"`` and ``continue_invalid``
    once the branch was merged or discarded."""
    if requested == "none":
        raise ApplicationError("invalid", "a follow-up of a worktree task runs on its branch",
                               fields={"isolation": ["a follow-up of a worktree task runs on its branch"]})
    root = followed.branch_of or followed
    if Integration.objects.filter(task__in=branch_tasks(root)).exists():
        raise _continue_invalid("continue_task's branch was already merged or discarded")
    return "worktree", root


def profile_conversation(machine: Machine, agent: str) -> str:
    """C1: how profile ``agent`` of the machine holds a conversation, as its worker last
    reported it (B10): ``"live"`` (streaming input), ``"resume"`` (a follow-up per
    message, G6) or ``"none"`` (also for a profile it never reported)."""
    for profile in machine.profiles or []:
        if isinstance(profile, dict) and profile.get("name") == agent:
            return profile.get("conversation") if profile.get("conversation") in ("live", "resume") else "none"
    return "none"


def profile_isolation(machine: Machine, agent: str) -> str:
    """G7: the isolation of profile ``agent`` as the machine's worker last reported it
    (B10), ``"none"`` when it reported none; a task's own ``isolation`` wins over it."""
    for profile in machine.profiles or []:
        if isinstance(profile, dict) and profile.get("name") == agent:
            return "worktree" if profile.get("isolation") == "worktree" else "none"
    return "none"


def create_task(*, owner, data, now) -> Task:
    """Write one accepted (or queued, G8) task from validated ``data`` inside the
    caller's transaction (A5, A6, A8, P1, P2): acceptance, and a resume conversation's
    message (C1). Raises ApplicationError for each A6 refusal; writes nothing then."""
    folder = normalize_folder(data["folder"])
    machine_id = data["machine"]
    # P1/P2: machine, then grant (FOR KEY SHARE), then the budget row (FOR UPDATE), then
    # the folder lock's per-machine lock. The budget row comes before the folder lock:
    # a queued follow-up's promotion (G8) runs inside a final transition, which holds
    # the budget row, and takes the folder lock there.
    picked = machine_id == ANY or isinstance(machine_id, PoolName)
    if picked:  # C8: the pick takes the same locks, in the same order
        if data.get("continue_task") is not None:
            raise ApplicationError("invalid", "a follow-up runs on its task's machine: name it",
                                   fields={"machine": ["a follow-up runs on its task's machine: name it"]})
        # A pool's members are read before any lock: a pool is configuration, and an
        # edit racing this acceptance is ordered before or after it (either is a
        # membership the owner set); the pick's own locks keep P1.
        among = pool_machine_ids(owner=owner, name=machine_id) if isinstance(machine_id, PoolName) else None
        pick = machine_pick(owner=owner, folder=folder, agent=data["agent"], exclusive=data["exclusive"], now=now,
                            isolation_of=lambda m: data.get("isolation") or profile_isolation(m, data["agent"]),
                            among=among)
        machine, grants, budget, folder = pick.machine, pick.grants, pick.budget, pick.folder
    else:
        machines = for_key_share(Machine.objects.filter(pk=machine_id, owner=owner))
        if not machines:
            raise ApplicationError("machine_forbidden", "no such machine among yours", status_code=403)
        machine = machines[0]
        grants = for_key_share(Grant.objects.filter(machine_id=machine.pk, revoked_at__isnull=True).order_by("pk"))
        budget = Budget.objects.select_for_update().filter(owner=owner).first()
    # A6: a bad follow-up is a bad body (400), checked once the machine is known to be the owner's.
    followed = _followed_task(owner=owner, machine=machine, task_id=data.get("continue_task"))
    covering = [g for g in grants if path_within(folder, g.path)]
    if not covering:
        raise ApplicationError("folder_not_granted", "this machine has no grant for that folder", status_code=403)
    grant = max(covering, key=lambda g: len(g.path))
    if not machine.paired:
        raise ApplicationError("machine_unpaired", "the machine is not paired", status_code=409)
    conversation = ""
    if data.get("mode") == "conversation":  # C1
        conversation = profile_conversation(machine, data["agent"])
        if conversation == "none":
            raise ApplicationError("conversation_unsupported", f"profile {data['agent']!r} of this machine can hold "
                                   "no conversation (its CLI has no streaming input and cannot resume)")

    # G7: a worktree task works on its own branch, not in the folder: no folder lock (A8
    # holds for the branch, which is the task's alone); a follow-up of one, on its branch.
    branch_of = None
    if followed is not None and followed.isolation == "worktree":
        isolation, branch_of = _follow_up_isolation(followed, data.get("isolation"))
    else:
        isolation = data.get("isolation") or profile_isolation(machine, data["agent"])
    # G8: a follow-up of an unfinished task waits in ``queued``, holding no folder lock
    # and no budget; both are checked when its turn comes (transitions.task_promote).
    queued = followed is not None and followed.state not in FINAL_STATES
    holds_lock = data["exclusive"] and isolation != "worktree" and not queued
    if holds_lock:
        holder = folder_lock_holder(machine.pk, folder)  # A8
        if holder is not None:
            raise folder_locked_error(holder)

    reserve = 0.0 if queued else float(data["max_runtime_s"])
    if not queued and not budget_reserve(budget, reserve):
        raise ApplicationError("budget_exhausted", "not enough budget left for max_runtime_s", status_code=409)

    session_id = data.get("session")
    if conversation and not session_id:
        # C6, S1: every conversation is a session, so its turns show busy and the time
        # between them idle ("waiting for you"), with B5 and N1 at each turn's end. A
        # replay answers the stored task, so it names this same session.
        session_id = uuid.uuid4()
    if session_id:
        # The sessions app makes sure the owner's session exists, or refuses (K2):
        # ``sessions_app/receivers.py`` lists what hears this and ``task_changed``.
        task_session_claimed.send(sender=Task, owner=owner, session_id=session_id, now=now,
                                  title=session_title(data["prompt"]) if conversation else "")

    task = Task.objects.create(
        id=uuid.uuid4(),
        owner=owner,
        machine=machine,
        grant=grant,
        session_id=session_id or None,
        folder=folder,
        machine_choice=str(machine_id) if picked else "",
        agent=data["agent"],
        prompt=data["prompt"],
        deep_research=data["deep_research"],
        max_runtime_s=data["max_runtime_s"],
        exclusive=data["exclusive"],
        isolation=isolation,
        mode="conversation" if conversation else "task",
        conversation=conversation,
        state=TaskState.QUEUED if queued else TaskState.ACCEPTED,
        holds_lock=holds_lock,
        reserved_s=reserve,
        continued_from=followed,
        queued_behind=followed if queued else None,
        branch_of=branch_of,
        created_at=now,
        accepted_at=None if queued else now,
        updated_at=now,
    )
    # A new task has no integration (G7): its answer needs no query to learn that.
    Task.integration.related.set_cached_value(task, None)
    Operation.objects.create(task=task, created_at=now)
    if conversation:
        conversation_opened(task, now=now)  # before the start message, which names it
    task_created(task, actor=actor_owner(owner), now=now)
    return task


SESSION_TITLE_MAX_CHARS = 60  # a board card's line on a phone (B6)


def session_title(prompt: str, *, limit: int = SESSION_TITLE_MAX_CHARS) -> str:
    """C6: the title of the session a conversation opens, from its first prompt: the
    first line that is not blank, white space collapsed, cut at a word boundary to at
    most ``limit`` characters with an ellipsis (mid-word only when the first word alone
    is longer)."""
    line = next((" ".join(ln.split()) for ln in prompt.splitlines() if ln.strip()), "")
    if len(line) <= limit:
        return line
    cut = line[:limit - 1]
    if line[limit - 1] != " " and " " in cut:
        cut = cut[:cut.rindex(" ")]
    return cut.rstrip(" ,.;:-") + "…"


def conversation_opened(task: Task, *, now: datetime) -> None:
    """C2: a new conversation task's prompt is its message 0 (so the chat shows its
    state like any other); in a resume conversation the task itself carries it."""
    message = ConversationMessage.objects.create(task=task, seq=0, text=task.prompt, created_at=now,
                                                 carrier=task if task.conversation == "resume" else None)
    broadcast(task.owner_id, message_event(message))
