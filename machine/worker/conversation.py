"""A live conversation's input, on the worker (SPEC C1-C6, W1-W3).

The agent (Claude Code ``-p --input-format stream-json``, docs/claude-stream-input.md;
Codex ``app-server``, docs/codex-app-server.md) reads its input from the launcher's inbox
(``launcher.py``): numbered files the launcher writes to the agent's stdin in order, each
once, noting each number in ``written.log``. What a line says and what ends a turn is the
CLI's adapter's (``live_agents.py``: ``StreamJson``, ``AppServer``); what goes when is decided
here, the same for every CLI.
Here, per run, a ``ConversationPart`` of the run (``run.py``), stepped by the run's thread
(the only writer, so no two threads ever place an item):

- ``record`` (poller): a pulled ``message``, ``interrupt`` or ``end`` becomes a
  conversation item in the local database before its ack (W2; known again: W3); after
  the ack the poller hands it to the run's part (``take``), which queues it and wakes the
  run; a run without its part yet reads its items from the database when it opens;
- ``step``: the messages taken since the last step, then each new ``written.log`` number
  moves its item to ``written``: for a message,
  the ``message`` receipt ``delivered`` and the session's ``running`` marker of its turn
  go in the same commit; the k-th ``result`` line of the agent's stream answers the k-th
  written message (``answered`` receipt, ``ended`` marker: B5 and N fire at the turn's true
  end, C6; the adapter's turn ends: a ``result`` line, Codex's ``turn/completed``); then
  the next item is placed: its inbox number recorded, then its file
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

One message is one turn: the next message is placed only after the previous one's
``result``, because Claude Code merges lines written during a turn into one turn (or
into the running one). Messages go in the service's ``seq`` order with no gap; an
interrupt goes at once while a turn is open (and is ``skipped`` otherwise); ``end``
(``last_seq``: the messages to write first; for a CLI whose EOF abandons a running turn,
Codex, also after the turn's end) closes the agent's stdin, and so does ``idle_s`` seconds
with no turn open and nothing to write (C5).
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from collections import deque

from machine.files import write_atomic
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
DONE = ("placed", "written", "answered")  # a message given its place


def user_line(text: str) -> str:
    """Claude Code's stream-json user message (one line, C1)."""
    return json.dumps({"type": "user", "message": {"role": "user", "content": text}})


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
    ``{message_id, seq, text}``, an ``interrupt`` ``{interrupt_id}`` or an ``end``
    ``{last_seq}``. False when it was already known (W3)."""
    if kind == "message":
        item_id, seq, line = str(payload["message_id"]), int(payload["seq"]), user_line(payload["text"])
    elif kind == "interrupt":
        item_id, seq, line = str(payload["interrupt_id"]), None, interrupt_line(str(payload["interrupt_id"]))
    else:
        item_id, seq, line = f"end:{operation_id}", payload.get("last_seq"), None
    return store.record_item(item_id=item_id, operation_id=operation_id, kind=kind, seq=seq, line=line, wall=wall,
                             message_id=message_id)


class ConversationPart:
    """One live conversation's input (module docstring), a part of ``run`` (``run.Run``).
    ``idle_s``: seconds with no turn open and nothing to write before stdin closes (C5);
    ``agent``: the CLI's adapter (``live_agents``; Claude Code's by default).
    ``step(now)`` is True when it took a message or moved an item."""

    def __init__(self, run, *, idle_s: float, agent=None):
        self.agent = agent if agent is not None else live_agents.StreamJson()
        self.ctx, self.run = run.ctx, run
        self.idle_s = idle_s
        self.inbox = os.path.join(run.op_dir, "inbox")
        os.makedirs(self.inbox, mode=0o700, exist_ok=True)
        self.written_path = os.path.join(run.op_dir, "written.log")
        self.results = 0  # ``result`` lines in the agent's stream so far
        self.follower = OutputFollower(run.op_dir)
        self.last_activity = self.ctx.clock.monotonic()
        self.idle_due: float | None = None  # when C5 closes stdin, if nothing happens first
        self.claim_due: float | None = None  # C10: when an unanswered claim is tried again
        self.taken: deque[tuple[str, str]] = deque()  # (kind, message id) handed over by the poller

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
        ``running`` marker."""
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
        item placed. True when any of these found something."""
        found = False
        while self.taken:
            kind, message_id = self.taken.popleft()
            log.debug("operation %s: %s %s taken", self.run.operation_id, kind, message_id)
            found = True
        found = self.settle() or found
        return self._place() or found

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

    def _receipt(self, item: dict, state: str) -> dict:
        return receipt_item(self.ctx.identity, operation_id=self.run.operation_id, kind="message",
                            facts={"message_id": item["item_id"], "state": state},
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
        moved = False
        for item in self._items():
            if item["state"] != "placed" or item["placement"] not in written:
                continue
            outbox, turn_id = [], None
            if item["kind"] == "message":
                if run.payload.get("session_id") and (item["seq"] != 0 or run.turn_id is None):
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
        for line in self.follower.read_lines():
            self.agent.see(line)
        self.results = self.agent.turns_ended
        ctx, run = self.ctx, self.run
        messages = sorted((i for i in self._items() if i["kind"] == "message" and i["state"] in ("written", "answered")),
                          key=lambda i: i["placement"])
        moved = False
        for item in messages[:self.results]:
            if item["state"] != "written":
                continue
            outbox = [self._receipt(item, "answered")] + (self._marker(run.turn_id, "ended") if run.turn_id else [])
            if ctx.store.item_moved(item["item_id"], came_from="written", to="answered", outbox=outbox,
                                    wall=ctx.clock.wall()):
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
        found = False
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
        done_seqs = [i["seq"] for i in items if i["kind"] == "message" and i["state"] in DONE + ("skipped",)]
        if waiting and not turn_open and waiting[0]["seq"] == (max(done_seqs) + 1 if done_seqs else 0):
            claim = self._claim(waiting[0])
            if claim == "write":
                self._give_place(waiting[0], placed)
                return True
            if claim == "never":
                self.ctx.store.item_moved(waiting[0]["item_id"], came_from="received", to="skipped")
                log.info("operation %s: message %s was withdrawn: not written", self.run.operation_id,
                         waiting[0]["seq"])
                return True
            return found
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
            if item["seq"]:  # a message after the prompt (crash tests)
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
