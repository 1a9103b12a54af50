"""A live conversation's input, on the worker (SPEC C1-C6, W1-W3).

The agent (Claude Code ``-p --input-format stream-json``, docs/claude-stream-input.md;
Codex ``app-server``, docs/codex-app-server.md) reads its input from the launcher's inbox
(``launcher.py``): numbered files the launcher writes to the agent's stdin in order, each
once, noting each number in ``written.log``. What a line says, and what the agent's output
says about its input (a message taken, a turn ended), is the CLI's adapter's
(``live_agents.py``: ``StreamJson``, ``AppServer``); what goes when is decided here, the
same for every CLI.
Here, per run, a ``ConversationPart`` of the run (``run.py``), stepped by the run's thread
(the only writer, so no two threads ever place an item):

- ``record`` (poller): a pulled ``message``, ``interrupt`` or ``end`` becomes a
  conversation item in the local database before its ack (W2; known again: W3); after
  the ack the poller hands it to the run's part (``take``), which queues it and wakes the
  run; a run without its part yet reads its items from the database when it opens;
- ``step``: the messages taken since the last step, then each new ``written.log`` number
  (or an echo of it, below) moves its item to ``written``: for a message,
  the ``message`` receipt ``delivered`` and, when no other message's turn is open, the
  session's ``running`` marker of its turn go in the same commit; the agent's stream says
  which turn took each message and when a turn ended (``landings``, below: ``consumed``
  and ``answered`` receipts; the ``ended`` marker with the last answer while no other
  message is open: B5 and N fire at the turn's true end, C6); then the next item is
  placed: its inbox number recorded, then its file
  written (record before write, C3). A recorded number whose file is missing (a crash
  between the two) is written again: the launcher takes each number once, so the agent
  reads each message at most once, and, as long as the agent runs, exactly once. A line
  the adapter cannot build yet (Codex: the thread's or the turn's id is not in the
  output yet) is not written; the next step writes it, and the launcher waits for it.
  A message given its place goes to the run's transcript too (``parser.turn_prompt``,
  G4): its ``prompt`` entry, with its ``seq``, opens its turn there; after a restart
  every placed message again, in placement order, before the output is re-read.

Withdraw (C10): before a message (not the prompt) gets its place, the run's thread claims
its delivery on the service, a ``message`` receipt ``{"state": "claimed"}`` sent at once
(not through the outbox) whose answer it waits for: ``applied`` or ``stale`` (its own
claim before a crash: the service answers an event id byte-equal, R1) -> the message is
placed and written; ``withdrawn`` or ``undelivered`` -> it is never written (``skipped``)
and the next ``seq`` may go; anything else (the service unreachable, 5xx) -> the claim is
tried again ``CLAIM_RETRY_S`` later and the message waits. The service's claim and the
owner's withdraw are one compare-and-set on the message row
(``tasks_app.services.conversation``), so exactly one wins, and the agent reads a message
only after its claim won: a withdrawn message never reaches the agent.

A queued message (``delivery`` ``queue``, C3) is one turn: it is placed only after the
previous turn's ``result``, because Claude Code merges lines written during a turn into
one turn (or into the running one). A steered message (``steer``, C9) is placed at once,
while a turn runs (claimed first, as above): Claude Code takes it into the running turn
at its next tool boundary, or, if that turn ends first, as the next turn's prompt
(docs/claude-stream-input.md). Which one is read from the stream, not guessed: every
user line carries its message id as ``uuid``, and ``--replay-user-messages`` echoes it
when the agent takes the line (``live_agents.stream_event``); ``landings`` turns the echoes and the
``result`` lines into where each message landed (the agent reads its stdin in order, so
the earliest message not yet settled is the one whose turn runs): a message taken into
another's turn is ``consumed`` with that message's seq as ``turn_seq`` (and settled
here: ``answered`` locally, ``turn_seq`` set); one that opened its turn gets its
``turn_seq`` (a steer reports ``consumed`` too) and is ``answered`` at that turn's
``result``. So each ``result`` answers exactly one message and the ``answered``
messages count the agent's turns; nothing is written twice (each message once, by its
place) and nothing is lost (a steer the running turn did not take is the next turn).
Codex is told a steer apart (``turn/steer``), refuses one whose turn has ended, and drops
an accepted one whose turn is interrupted before it took it: then the message gets a
second line, an ``again`` item with its ``turn/start`` (``_again``); the first gave the
model nothing, so the text still reaches it once.

Order: queued messages go in the service's ``seq`` order with no gap; a steer goes once
every message before it is known here and every steer before it is placed (it may pass
queued messages waiting for their turn: they are "next", it is "now"). An interrupt goes
at once while a turn is open (and is ``skipped`` otherwise); ``end`` (``last_seq``: the
messages to write first; for a CLI whose EOF abandons a running turn, Codex, also after
the turn's end) closes the agent's stdin, and so does ``idle_s`` seconds with no turn
open and nothing to write (C5).
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from collections import deque

from machine.files import bell_ring, write_atomic
from machine.launcher import BELL
from machine.protocol.shapes import RECEIPTS_PATH

from . import faults, live_agents
from .lease import slept_s
from .process import OutputFollower
from .wire import marker_item, receipt_item

log = logging.getLogger("runstead.worker")

KINDS = ("message", "interrupt", "end")
CLAIM_RETRY_S = 1.0  # C10: a claim the service did not answer is tried again after this
CLAIM_TIMEOUT_S = 2.0  # C10: the claim's HTTP timeout (the run's thread also keeps the lease deadline, L4)
OPEN = ("placed", "written")  # a message in a turn that has not ended
QUIET_AFTER_S = 2.0  # seconds after the last write or answer before a conversation counts as quiet
DONE = ("placed", "written", "answered")  # a message given its place


def user_line(text: str, message_id: str | None = None) -> str:
    """Claude Code's stream-json user message (one line, C1); ``message_id``, when it is a
    UUID, as the line's ``uuid``, which ``--replay-user-messages`` echoes back when the
    agent takes the line (C9, docs/claude-stream-input.md)."""
    line = {"type": "user", "message": {"role": "user", "content": text}}
    try:
        line["uuid"] = str(uuid.UUID(message_id)) if message_id else None
    except ValueError:
        pass
    return json.dumps({k: v for k, v in line.items() if v is not None})


def interrupt_line(request_id: str) -> str:
    """Claude Code's interrupt control request (C4)."""
    return json.dumps({"type": "control_request", "request_id": request_id, "request": {"subtype": "interrupt"}})


def _line_text(line: str | None) -> str:
    """The text of a ``user_line``."""
    try:
        text = json.loads(line)["message"]["content"]
    except (TypeError, ValueError, KeyError):
        return ""
    return text if isinstance(text, str) else ""


def placed_prompts(items: list[dict]) -> list[tuple[int, str]]:
    """G4: ``(seq, text)`` of the messages given their place among a run's ``items``
    (the store's), in placement order: what a re-read of the run's output
    (``parsers.TextParser.turn_prompt``) needs to open its turns as the live run did."""
    placed = sorted((i for i in items if i["kind"] == "message" and i["placement"] is not None),
                    key=lambda i: i["placement"])
    return [(int(i["seq"]), _line_text(i["line"])) for i in placed]


def record(store, *, kind: str, operation_id: str, payload: dict, wall: float, message_id: str | None) -> bool:
    """Commit a pulled conversation message as an item (W2): a ``message``
    ``{message_id, seq, text[, delivery]}``, an ``interrupt`` ``{interrupt_id}`` or an ``end``
    ``{last_seq}``. False when it was already known (W3)."""
    if kind == "message":
        item_id, seq = str(payload["message_id"]), int(payload["seq"])
        line = user_line(payload["text"], item_id)
    elif kind == "interrupt":
        item_id, seq, line = str(payload["interrupt_id"]), None, interrupt_line(str(payload["interrupt_id"]))
    else:
        item_id, seq, line = f"end:{operation_id}", payload.get("last_seq"), None
    return store.record_item(item_id=item_id, operation_id=operation_id, kind=kind, seq=seq, line=line, wall=wall,
                             message_id=message_id, delivery="steer" if payload.get("delivery") == "steer" else "queue")


def landings(messages: list[dict], events: list[tuple[str, str | None]]) -> tuple[dict[str, int], set[str]]:
    """C9: where each message landed, from the agent's stream since its start.
    ``messages``: the messages given their place (``item_id``, ``seq``), in placement
    order, which is the order the agent reads them; ``events``: the adapter's ``see`` events in
    stream order. Returns ``(turn_of, answered)``: ``turn_of`` maps each message the
    agent showed it took to the seq of the message whose turn took it, ``answered`` the
    messages whose own turn ended.

    The agent reads its input in order, so at any point the earliest message not yet
    settled (answered, or taken into a turn that has ended) is the one whose turn runs:
    a message taken then joins that turn (or opens it, if it is that message), and a
    ``result`` answers it (a stream without echoes, an agent run without
    ``--replay-user-messages``, still answers one message per ``result``, as C3 did).
    Pure: the same stream gives the same answer after a restart re-reads it. Linear in
    the events and messages (settled only grows, so the running one only moves on)."""
    by_id = {m["item_id"]: m for m in messages}
    settled: set[str] = set()
    turn_of: dict[str, int] = {}
    members: dict[int, list[str]] = {}  # turn seq -> the messages taken into it
    answered: set[str] = set()
    first = 0  # messages[:first] are settled

    def running():
        nonlocal first
        while first < len(messages) and messages[first]["item_id"] in settled:
            first += 1
        return messages[first] if first < len(messages) else None

    for kind, item_id in events:
        if kind == "taken":
            if item_id in by_id and item_id not in turn_of and item_id not in settled and (owner := running()):
                turn_of[item_id] = int(owner["seq"])
                members.setdefault(int(owner["seq"]), []).append(item_id)
        elif (owner := running()) is not None:
            answered.add(owner["item_id"])
            turn_of.setdefault(owner["item_id"], int(owner["seq"]))
            settled.add(owner["item_id"])
            settled.update(members.pop(int(owner["seq"]), ()))
    return turn_of, answered


class ConversationPart:
    """One live conversation's input (module docstring), a part of ``run`` (``run.Run``).
    ``idle_s``: seconds with no turn open and nothing to write before stdin closes (C5).
    ``step(now)`` is True when it took a message or moved an item."""

    def __init__(self, run, *, idle_s: float, agent=None):
        self.agent = agent if agent is not None else live_agents.StreamJson()
        self.ctx, self.run = run.ctx, run
        self.idle_s = idle_s
        self.inbox = os.path.join(run.op_dir, "inbox")
        os.makedirs(self.inbox, mode=0o700, exist_ok=True)
        self.written_path = os.path.join(run.op_dir, "written.log")
        self.events: list[tuple[str, str | None]] = []  # C9: the adapter's ``see`` events so far, in order
        self.follower = OutputFollower(run.op_dir)
        self.last_activity = self.ctx.clock.monotonic()
        self.idle_due: float | None = None  # when C5 closes stdin, if nothing happens first
        self.claim_due: float | None = None  # C10: when an unanswered claim is tried again
        self.taken: deque[tuple[str, str]] = deque()  # (kind, message id) handed over by the poller
        # Nothing placed, written or taken at the last step, and nothing written or answered
        # for QUIET_AFTER_S (the turn's last output and progress are sent by then): the
        # agent waits on its stdin (``run.ProcessPart`` then looks less often; a take
        # wakes the run at once).
        self.quiet = False
        self.files_seen = (-1, -1)  # ``files()`` at the end of the last step

    def take(self, kind: str, message_id: str) -> None:
        """The poller's hand-over (its thread): a ``message``, ``interrupt`` or ``end``
        recorded (W2) and acknowledged; the next step gives it its place."""
        self.taken.append((kind, message_id))
        self.run.work_arrived.set()

    def open(self, *, prompt_message_id: str, prompt: str, folder: str) -> None:
        """Before the spawn: the adapter's opening (``op_dir/opening``, which the launcher
        writes first), then the prompt as message 0, the first inbox line."""
        opening = self.agent.opening(folder)
        if opening:
            write_atomic(os.path.join(self.run.op_dir, "opening"), opening)
        record(self.ctx.store, kind="message", operation_id=self.run.operation_id, wall=self.ctx.clock.wall(),
               payload={"message_id": prompt_message_id, "seq": 0, "text": prompt}, message_id=None)
        self.step(self.ctx.clock.monotonic())

    def adopted(self) -> None:
        """After a restart (``Runner.adopt``): the messages placed so far to the new
        observer's transcript (it re-reads the output from the start); the device sweep
        closed the markers this device left running (M5), so a turn still open gets a new
        ``running`` marker; the launcher's bell rung (a file the crash left unrung)."""
        bell_ring(os.path.join(self.run.op_dir, BELL))
        observer = self.run.process.observer
        for seq, text in placed_prompts(self._items()) if observer is not None else ():
            observer.parser.turn_prompt(seq, text)
        turn_open = any(i["kind"] == "message" and i["state"] == "written" for i in self._items())
        markers = self._marker(str(uuid.uuid4()), "running") if turn_open else []
        if markers:
            self.run.turn_id = markers[0]["body"]["turn_id"]
            self.ctx.enqueue(markers)

    def step(self, now: float) -> bool:
        """The messages taken, receipts for what was written and answered, then the next
        item placed. True when any of these found something. A quiet conversation whose
        files did not grow, with nothing taken or due, is left as it is (no query of the
        store: 100 waiting conversations cost next to nothing, issue 43)."""
        due = self.next_due(now)
        if self.quiet and not self.taken and (due is None or now < due) and self.files() == self.files_seen:
            return False
        found = False
        while self.taken:
            kind, message_id = self.taken.popleft()
            log.debug("operation %s: %s %s taken", self.run.operation_id, kind, message_id)
            found = True
        found = self.settle() or found
        found = self._place() or found
        self.quiet = (not found and not self.taken and now - self.last_activity >= QUIET_AFTER_S
                      and not any(i["state"] in ("received", *OPEN) for i in self._items()))
        self.files_seen = self.files()
        return found

    def files(self) -> tuple[int, int]:
        """The sizes of ``written.log`` (the launcher's) and the agent's output: what the
        launcher and the agent did, at the price of two ``stat`` calls."""
        sizes = []
        for path in (self.written_path, self.follower.path):
            try:
                sizes.append(os.stat(path).st_size)
            except OSError:
                sizes.append(-1)
        return sizes[0], sizes[1]

    def next_due(self, now: float) -> float | None:
        """C5: when an idle conversation ends, if nothing happens first; C10: when an
        unanswered claim is tried again."""
        due = [d for d in (self.idle_due, self.claim_due) if d is not None]
        return min(due) if due else None

    def settle(self) -> bool:
        """The receipts (and markers) of what was written and answered so far; True when
        an item moved."""
        written = self._written()
        return self._answered() or written

    # --- what happened ------------------------------------------------------------------------

    def _items(self) -> list[dict]:
        return self.ctx.store.items(self.run.operation_id)

    def _receipt(self, item: dict, state: str, **facts) -> dict:
        return receipt_item(self.ctx.identity, operation_id=self.run.operation_id, kind="message",
                            facts={"message_id": item["item_id"], "state": state, **facts},
                            slept=slept_s(self.run.lease.granted, self.ctx.clock), event_id=f"message:{item['item_id']}:{state}")

    def _marker(self, turn_id: str, state: str) -> list[dict]:
        session_id = self.run.payload.get("session_id")
        if not session_id:
            return []
        return [marker_item(self.ctx.identity, session_id=str(session_id), turn_id=turn_id, state=state,
                            deep_research=self.run.payload.get("deep_research", False))]

    def _written(self) -> bool:
        try:
            with open(self.written_path) as f:
                written = {int(n) for n in f.read().split()}
        except (OSError, ValueError):
            written = set()
        ctx, run = self.ctx, self.run
        taken = {item_id for kind, item_id in self.events if kind == "taken"}
        moved = False
        items = self._items()
        for item in items:
            if item["state"] != "placed" or (item["placement"] not in written and item["item_id"] not in taken):
                continue
            outbox, turn_id = [], None
            if item["kind"] == "message":
                # C9: a message written while another's turn is open (a steer) starts no turn
                # of its own now: it joins that one or opens the next without a gap (no blip).
                others_open = any(i["kind"] == "message" and i["state"] in OPEN and i["item_id"] != item["item_id"]
                                  and (i["turn_seq"] is None or i["turn_seq"] == i["seq"]) for i in items)
                if run.payload.get("session_id") and not others_open and (item["seq"] != 0 or run.turn_id is None):
                    # a new turn (the first one's marker went with the ``running`` receipt),
                    # sent before the receipt: a message seen delivered has its session busy
                    turn_id = str(uuid.uuid4())
                    outbox += self._marker(turn_id, "running")
                outbox.append(self._receipt(item, "delivered"))
            if ctx.store.item_moved(item["item_id"], came_from="placed", to="written", outbox=outbox, turn_id=turn_id,
                                    wall=ctx.clock.wall()):
                run.turn_id = turn_id or run.turn_id
                self.last_activity = ctx.clock.monotonic()
                ctx.wake_sender()
                moved = True
        return moved

    def _answered(self) -> bool:
        """What the agent's stream shows (C3, C9: ``landings``): a message taken into a
        turn is ``consumed`` (a steer, or one that joined another's turn; reported with
        ``turn_seq``), one whose own turn ended ``answered``; the ``ended`` marker goes
        with the last answer while no other message is open (B5, N: the turn's true end)."""
        for line in self.follower.read_lines():
            if (event := self.agent.see(line)) is not None:
                self.events.append(event)
        ctx, run = self.ctx, self.run
        messages = sorted((i for i in self._items() if i["kind"] == "message" and i["placement"] is not None),
                          key=lambda i: i["placement"])
        turn_of, answered = landings(messages, self.events)
        moved = False
        for item in messages:
            item_id, seq = item["item_id"], int(item["seq"])
            turn_seq = turn_of.get(item_id)
            if item["state"] != "written" or turn_seq is None or item["turn_seq"] is not None:
                continue
            joined = turn_seq != seq  # it joined another's turn: that is all that happens to it
            outbox = [self._receipt(item, "consumed", turn_seq=turn_seq)] \
                if joined or item["delivery"] == "steer" else []
            if ctx.store.item_moved(item_id, came_from="written", to="answered" if joined else "written",
                                    turn_seq=turn_seq, outbox=outbox, wall=ctx.clock.wall()):
                log.info("operation %s: message %s taken into the turn of message %s", run.operation_id, seq, turn_seq)
                ctx.wake_sender()
                moved = True
        for item in messages:
            if item["item_id"] not in answered or item["state"] != "written":
                continue
            still_open = any(i["state"] in OPEN and i["item_id"] not in answered and i["item_id"] != item["item_id"]
                             and turn_of.get(i["item_id"], i["seq"]) == i["seq"] for i in messages)
            outbox = [self._receipt(item, "answered")]
            if run.turn_id and not still_open:
                outbox += self._marker(run.turn_id, "ended")
            if ctx.store.item_moved(item["item_id"], came_from="written", to="answered", outbox=outbox,
                                    turn_seq=None, wall=ctx.clock.wall()):
                self.last_activity = ctx.clock.monotonic()
                ctx.wake_sender()
                moved = True
        return moved

    def final_extras(self, extra: dict) -> dict:
        """The run's final facts (J1) as a conversation reports them: a last turn that
        ended because the owner interrupted it (C4: an interrupt written after its
        message) is no error of the agent's, so its ``agent_result`` (Claude Code:
        ``error_during_execution``) says ``interrupted``, not ``is_error``."""
        result = extra.get("agent_result")
        if not isinstance(result, dict) or result.get("is_error") is not True \
                or result.get("subtype") != "error_during_execution":
            return extra
        items = self._items()
        last = max((i["placement"] for i in items if i["kind"] == "message" and i["state"] == "answered"), default=None)
        if last is None or not any(i["kind"] == "interrupt" and i["state"] == "written" and i["placement"] > last
                                   for i in items):
            return extra
        return {**extra, "agent_result": {**result, "is_error": False, "subtype": "interrupted"}}

    # --- what comes next ----------------------------------------------------------------------

    def _place(self) -> bool:
        """Give the next item its place (module docstring); True when one was placed or
        skipped. Notes ``idle_due`` (C5) while nothing is open or waiting."""
        self.idle_due = None
        items = self._items()
        placed = [i for i in items if i["placement"] is not None]
        for item in placed:
            if item["state"] == "placed" and not os.path.exists(self._path(item["placement"])):
                self._write(item)  # recorded, never written: a crash between the two (C3)
        if any(i["kind"] == "end" and i["placement"] is not None for i in items):
            return False  # stdin is closed (or about to be): nothing more
        found = self._again(items, placed)
        turn_open = any(i["kind"] == "message" and i["state"] in OPEN for i in items)
        for item in items:
            if item["kind"] == "interrupt" and item["state"] == "received":
                found = True
                if turn_open:
                    self._give_place(item, placed)
                else:
                    self.ctx.store.item_moved(item["item_id"], came_from="received", to="skipped")
                    log.info("operation %s: interrupt with no turn running: nothing to stop", self.run.operation_id)
        waiting = sorted((i for i in items if i["kind"] == "message" and i["state"] == "received"),
                         key=lambda i: i["seq"])
        known = {i["seq"] for i in items if i["kind"] == "message"}
        done = {i["seq"] for i in items if i["kind"] == "message" and i["state"] in DONE + ("skipped",)}
        first_not_done = next(n for n in range(len(done) + 1) if n not in done)
        # C9: a steer goes now, while a turn runs, once every message before it is known here
        # and every steer before it is written; a queued message waits for no open turn and
        # every message before it written (a steer may thus pass queued messages: they wait
        # for a turn of their own, it joins the running one).
        steer = next((i for i in waiting if i["delivery"] == "steer"), None)  # the first steer waiting
        if steer is not None and set(range(steer["seq"])) <= known:
            return self._deliver(steer, placed) or found
        queued = next((i for i in waiting if i["delivery"] != "steer"), None)
        if queued is not None and not turn_open and queued["seq"] == first_not_done:
            return self._deliver(queued, placed) or found
        end = next((i for i in items if i["kind"] == "end"), None)
        if end is not None:
            last_seq = end["seq"] if end["seq"] is not None else -1
            if all(i["seq"] > last_seq for i in waiting) and not (turn_open and self.agent.end_waits_for_turn):
                self._give_place(end, placed)
                return True
        elif not turn_open and not waiting:
            if self.ctx.clock.monotonic() - self.last_activity < self.idle_s:
                self.idle_due = self.last_activity + self.idle_s
                return found
            log.info("operation %s: no message for %.1f s: the conversation ends (C5)", self.run.operation_id,
                     self.idle_s)
            record(self.ctx.store, kind="end", operation_id=self.run.operation_id, payload={"last_seq": None},
                   wall=self.ctx.clock.wall(), message_id=None)
            self._give_place(self._items()[-1], placed)
            return True
        return found

    def _again(self, items: list[dict], placed: list[dict]) -> bool:
        """C9: each steer the agent refused or dropped (``agent.refused``: Codex's
        ``turn/steer`` when the turn it was to join had ended, or was interrupted before it
        took the steer) is given again, once, as its own turn: an
        ``again`` item (``item_id`` ``again:<message id>``, the message's ``seq`` and
        ``line``; its line is the adapter's ``turn/start``) recorded, then placed and
        written like any item (record before write: a restart re-reads the refusal and
        finds the item known). The message itself stays ``written`` until the agent shows
        it took it (``landings``). True when one was recorded or placed."""
        refused = getattr(self.agent, "refused", ())
        by_id = {i["item_id"]: i for i in items}
        found = False
        for message_id in refused:
            message = by_id.get(message_id)
            if message is None or f"again:{message_id}" in by_id:
                continue
            self.ctx.store.record_item(item_id=f"again:{message_id}", operation_id=self.run.operation_id, kind="again",
                                       seq=message["seq"], line=message["line"], wall=self.ctx.clock.wall(),
                                       delivery="steer")
            log.info("operation %s: the steer of message %s was refused or dropped by the agent: it is the next turn",
                     self.run.operation_id, message["seq"])
            found = True
        for item in self._items() if found else items:
            if item["kind"] == "again" and item["state"] == "received":
                self._give_place(item, placed)
                found = True
        return found

    def _deliver(self, item: dict, placed: list[dict]) -> bool:
        """Claim ``item``'s delivery (C10) and, if the claim won, place and write it; True
        when it was placed or skipped (withdrawn), False when the claim waits."""
        claim = self._claim(item)
        if claim == "write":
            self._give_place(item, placed)
            return True
        if claim == "never":
            self.ctx.store.item_moved(item["item_id"], came_from="received", to="skipped")
            log.info("operation %s: message %s was withdrawn: not written", self.run.operation_id, item["seq"])
            return True
        return False

    def _claim(self, item: dict) -> str:
        """C10 (module docstring): ``write``, ``never`` or ``later``, as the service answers
        the claim of ``item``'s delivery. The prompt (seq 0) is the task's own: no claim."""
        self.claim_due = None
        if not item["seq"]:
            return "write"
        receipt = self._receipt(item, "claimed")
        service = self.ctx.connect()
        try:
            answer = service.send("POST", RECEIPTS_PATH, receipt["body"], timeout_s=CLAIM_TIMEOUT_S)
        finally:
            service.close()
        body = answer.body if isinstance(answer.body, dict) else {}
        if answer.kind == "ok" and (body.get("outcome") == "applied" or body.get("reason") == "stale"):
            return "write"
        if answer.kind == "ok" and body.get("reason") in ("withdrawn", "undelivered"):
            return "never"
        if answer.kind == "revoked":
            self.ctx.on_revoked()
        log.warning("operation %s: the claim of message %s was answered %s %s: it waits", self.run.operation_id,
                    item["seq"], answer.status, answer.text[:200])
        self.claim_due = self.ctx.clock.monotonic() + CLAIM_RETRY_S
        return "later"

    def _give_place(self, item: dict, placed: list[dict]) -> None:
        n = max((i["placement"] for i in placed), default=-1) + 1
        if self.ctx.store.item_moved(item["item_id"], came_from="received", to="placed", placement=n):
            placed.append({**item, "placement": n})
            if item["kind"] == "message":
                self._to_transcript(item)
            if item["kind"] == "message" and item["seq"]:  # a message after the prompt (crash tests)
                faults.fault("conversation_after_record_before_write")
            self._write({**item, "placement": n})

    def _to_transcript(self, item: dict) -> None:
        """G4: a placed message's prompt entry (with its ``seq``) opens its turn in the
        run's transcript (``parsers.TextParser.turn_prompt``)."""
        observer = self.run.process.observer
        if observer is not None:
            observer.parser.turn_prompt(int(item["seq"]), _line_text(item["line"]))

    def _path(self, n: int) -> str:
        return os.path.join(self.inbox, f"{n:010d}.json")

    def _write(self, item: dict) -> None:
        if item["kind"] == "end":
            body = {"close": True}
        else:
            line = self.agent.line(item, self._items())
            if line is None:
                return  # not yet (module docstring): the next step's ``_place`` writes it
            body = {"line": line}
        write_atomic(self._path(item["placement"]), json.dumps(body))
        bell_ring(os.path.join(self.run.op_dir, BELL))
