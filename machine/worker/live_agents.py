"""How a live conversation talks to each CLI (SPEC C1, C4, C11): one small adapter per
streaming-input protocol, behind the same interface, used by ``conversation.ConversationPart``.

The conversation part decides what goes to the agent and when (one message, one turn; an
interrupt while a turn is open; ``end``); the launcher writes the lines (``launcher.py``).
An adapter only knows the protocol:

- ``parser``: the ``parsers`` name of the live stream (G2-G4);
- ``opening(folder)``: the text the launcher writes before the first inbox line ("" for
  none), written once, at the spawn (the launcher holds it across worker crashes);
- ``see(line)``: each line of the agent's output, in order from the first (a restarted
  worker reads them all again, so what an adapter knows is rebuilt); returns what the
  line says about the agent's input, for ``conversation.landings``: ``("taken", message
  id)`` (the agent took that message into a turn, C9), ``("result", None)`` (a turn
  ended), or None; ``turns_ended`` counts the turn ends seen so far;
- ``line(item, items)``: the line for a placed conversation item (``store`` row; the
  ``line`` column holds the message as Claude Code's user line, ``conversation.user_line``),
  or None when it cannot be built yet (what it needs is not in the output yet: the
  conversation part tries again at its next step; the launcher waits for the number);
- ``end_waits_for_turn``: True when closing stdin during a turn abandons the turn, so
  ``end`` waits for the turn's end.

``StreamJson``: Claude Code ``-p --input-format stream-json`` (docs/claude-stream-input.md):
the stored lines as they are (each with its message id as ``uuid``); with
``--replay-user-messages`` the echo of a user line (``isReplay``) says it was taken; a
``result`` line ends a turn; EOF lets the turn finish.

``AppServer``: Codex ``app-server`` (JSON-RPC on stdio, docs/codex-app-server.md): the
opening is ``initialize``, ``initialized`` and ``thread/start`` (the folder,
``approvalPolicy: "never"``, ``sandbox: "workspace-write"`` as the exec preset runs);
a message is ``turn/start`` in that thread (its id from ``thread/start``'s answer) with
``clientUserMessageId`` = the message id and request id ``msg:<message id>``; an interrupt
is ``turn/interrupt`` of the turn of the message placed before it (its id from that
``turn/start``'s answer); the ``item/started`` of a ``userMessage`` whose ``clientId`` is a
message id says it was taken; ``turn/completed`` ends a turn, and so does an error answer
to a ``turn/start`` (no turn will come). EOF during a turn abandons it (observed), hence
``end_waits_for_turn``.

A steered message (C9, ``delivery`` ``steer``, not the prompt) is ``turn/steer`` (request id
``steer:<message id>``) with ``expectedTurnId`` = the latest turn the output named (a
``turn/start`` or ``turn/steer`` answer, a ``turn/started``), ``clientUserMessageId`` =
the message id; accepted, its ``userMessage`` item (in the running turn) says it was
taken, as for a ``turn/start``. Refused (-32600: "no active turn to steer" when that
turn ended before Codex read the line, or "expected active turn id ..." when another
turn runs), nothing happened in the agent: its id joins ``refused`` (in the order seen).
So does an accepted steer whose turn completed without its ``userMessage`` item: Codex
drops the pending input of a turn interrupted before its next model request (observed:
no item, no turn of its own, and the next turn's model request does not carry it,
docs/codex-app-server.md). For each, the conversation part places an ``again`` item, whose line is the message's
``turn/start`` (request id ``msg:<message id>``, as a queued message's): the next turn's
prompt, or, if a turn runs by then, a steer of it (a ``turn/start`` during a turn joins
it, docs/codex-app-server.md). So the text reaches the model once either way.
"""
from __future__ import annotations

import json

Event = tuple[str, str | None]


def _json_object(line: str) -> dict | None:
    """One line of an agent's output as a JSON object, or None (text, or not an object)."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def stream_event(line: str) -> Event | None:
    """C9: what one line of Claude Code's stream says about its input: ``("taken", uuid)``
    (its echo of a user line it took, ``isReplay``), ``("result", None)`` (a turn ended),
    or None."""
    if '"result"' not in line and '"isReplay"' not in line:
        return None
    if (event := _json_object(line)) is None:
        return None
    if event.get("type") == "result":
        return ("result", None)
    if event.get("type") == "user" and event.get("isReplay") is True and isinstance(event.get("uuid"), str):
        return ("taken", event["uuid"])
    return None


def _text(line: str | None) -> str:
    """The text of a stored message line (Claude Code's user line)."""
    try:
        text = json.loads(line)["message"]["content"]
    except (TypeError, ValueError, KeyError):
        return ""
    return text if isinstance(text, str) else ""


class StreamJson:
    """Claude Code's streaming input (module docstring)."""

    parser = "claude"
    end_waits_for_turn = False

    def __init__(self):
        self.turns_ended = 0

    def opening(self, folder: str) -> str:
        return ""

    def see(self, line: str) -> Event | None:
        event = stream_event(line)
        if event == ("result", None):
            self.turns_ended += 1
        return event

    def line(self, item: dict, items: list[dict]) -> str | None:
        return item["line"]


THREAD_REQUEST = "rs-thread"


class AppServer:
    """Codex's ``app-server`` (module docstring)."""

    parser = "codex_app_server"
    end_waits_for_turn = True

    def __init__(self):
        self.turns_ended = 0
        self.thread_id: str | None = None
        self.turns: dict[str, str | None] = {}  # message id -> its turn's id (None: turn/start refused)
        self.turn_id: str | None = None  # the latest turn the output named (C9: a steer's expectedTurnId)
        self.refused: list[str] = []  # C9: the messages whose turn/steer was refused or dropped, in order
        self.steered: dict[str, list[str]] = {}  # C9: turn id -> the messages steered into it (accepted)
        self.taken: set[str] = set()  # the client ids of the user items seen
        self.completed: set[str] = set()  # the ids of the turns completed

    def opening(self, folder: str) -> str:
        lines = [
            {"id": "rs-initialize", "method": "initialize",
             "params": {"clientInfo": {"name": "runstead", "title": "RunStead", "version": "1"}}},
            {"method": "initialized"},
            {"id": THREAD_REQUEST, "method": "thread/start",
             "params": {"cwd": folder, "approvalPolicy": "never", "sandbox": "workspace-write"}},
        ]
        return "".join(json.dumps(line) + "\n" for line in lines)

    def see(self, line: str) -> Event | None:
        if not line.startswith("{") or (event := _json_object(line)) is None:
            return None
        method = event.get("method")
        if method == "turn/completed":
            self.turns_ended += 1
            turn = (event.get("params") or {}).get("turn") if isinstance(event.get("params"), dict) else None
            turn_id = turn.get("id") if isinstance(turn, dict) else None
            if isinstance(turn_id, str):
                self.completed.add(turn_id)
            for message_id in self.steered.pop(turn_id, []) if isinstance(turn_id, str) else []:
                if message_id not in self.taken and message_id not in self.refused:
                    self.refused.append(message_id)  # accepted, but the turn ended without it: dropped
            return ("result", None)
        if method == "turn/started":
            turn = (event.get("params") or {}).get("turn") if isinstance(event.get("params"), dict) else None
            if isinstance(turn, dict) and isinstance(turn.get("id"), str):
                self.turn_id = turn["id"]
            return None
        if method == "item/started":
            item = (event.get("params") or {}).get("item") if isinstance(event.get("params"), dict) else None
            if isinstance(item, dict) and item.get("type") == "userMessage" and isinstance(item.get("clientId"), str):
                self.taken.add(item["clientId"])
                return ("taken", item["clientId"])
            return None
        request = event.get("id")
        if method is not None or not isinstance(request, str):
            return None
        result = event.get("result") if isinstance(event.get("result"), dict) else {}
        if request == THREAD_REQUEST:
            thread = result.get("thread") if isinstance(result.get("thread"), dict) else {}
            self.thread_id = thread.get("id") if isinstance(thread.get("id"), str) else None
        elif request.startswith("msg:"):
            turn = result.get("turn") if isinstance(result.get("turn"), dict) else {}
            self.turns[request[4:]] = turn.get("id") if isinstance(turn.get("id"), str) else None
            self.turn_id = self.turns[request[4:]] or self.turn_id
            if "error" in event:
                self.turns_ended += 1  # refused: no turn, so nothing else will end it
                return ("result", None)
        elif request.startswith("steer:"):
            message_id = request[6:]
            if "error" in event:
                if message_id not in self.refused:
                    self.refused.append(message_id)
            elif isinstance(result.get("turnId"), str):
                self.turns[message_id] = self.turn_id = result["turnId"]
                if result["turnId"] not in self.completed:
                    self.steered.setdefault(result["turnId"], []).append(message_id)
                elif message_id not in self.taken and message_id not in self.refused:
                    self.refused.append(message_id)  # answered after its turn's end, untaken: dropped
        return None

    def line(self, item: dict, items: list[dict]) -> str | None:
        if self.thread_id is None:
            return None
        if item["kind"] == "message" and item.get("delivery") == "steer" and item.get("seq"):
            if self.turn_id is None:
                return None  # no turn named yet (the prompt's turn/start is not answered)
            return json.dumps({"id": f"steer:{item['item_id']}", "method": "turn/steer", "params": {
                "threadId": self.thread_id, "expectedTurnId": self.turn_id,
                "input": [{"type": "text", "text": _text(item["line"])}], "clientUserMessageId": item["item_id"]}})
        if item["kind"] in ("message", "again"):  # again: a refused steer's own turn/start (C9)
            message_id = item["item_id"].removeprefix("again:") if item["kind"] == "again" else item["item_id"]
            return json.dumps({"id": f"msg:{message_id}", "method": "turn/start", "params": {
                "threadId": self.thread_id, "input": [{"type": "text", "text": _text(item["line"])}],
                "clientUserMessageId": message_id}})
        if item["kind"] == "interrupt":
            before = [i for i in items if i["kind"] == "message" and i["placement"] is not None
                      and i["placement"] < item["placement"]]
            if not before:
                return None
            message_id = max(before, key=lambda i: i["placement"])["item_id"]
            if message_id in self.refused and message_id not in self.turns:
                # a refused steer (C9) whose own turn/start comes after this line: no turn of
                # its runs now; the latest turn named gets it (ended: -32600, nothing happens)
                return json.dumps({"id": f"int:{item['item_id']}", "method": "turn/interrupt", "params": {
                    "threadId": self.thread_id, "turnId": self.turn_id or ""}})
            if message_id not in self.turns:
                return None  # its turn/start (or turn/steer) is not answered yet
            # A turn that already ended (or never began) answers -32600, and nothing happens.
            return json.dumps({"id": f"int:{item['item_id']}", "method": "turn/interrupt", "params": {
                "threadId": self.thread_id, "turnId": self.turns[message_id] or ""}})
        return None


class OpencodeServe:
    """opencode's ``serve`` through RunStead's bridge (``machine/opencode_bridge.py``,
    docs/opencode-server.md): no opening (the bridge creates the session); a message is
    ``{"prompt": TEXT}``, an interrupt ``{"abort": true}`` (the session stays, C4). A
    turn ends with the first terminal assistant message answering its user message: a
    ``message.updated`` of role ``assistant`` with ``time.completed`` whose ``finish`` is
    not ``tool-calls`` (the model is done) or that carries an ``error`` (aborted, API
    error), counted once per ``parentID`` (the user message; its updates repeat, and
    ``session.idle`` is no turn end: after an abort it came twice, observed); a prompt
    the server refused (``bridge.error``) makes no turn, so it ends one too. A loop that
    stops after a tool call (a rejected permission, Q5: the last assistant message
    completed with ``finish`` ``tool-calls`` and none follows, observed) ends its turn
    when the session goes idle (``session.status`` idle or ``session.idle``). opencode
    merges prompts sent during a turn into one (observed), so one message goes at a time
    (C3 queues) and none is steered. Closing the bridge's stdin stops the server, a
    running turn with it, hence ``end_waits_for_turn``."""

    parser = "opencode_serve"
    end_waits_for_turn = True

    def __init__(self):
        self.turns_ended = 0
        self.answered: set[str] = set()  # user message ids whose turn ended
        self.last: str | None = None  # the parentID of the latest completed assistant message

    def opening(self, folder: str) -> str:
        return ""

    def see(self, line: str) -> Event | None:
        if not line.startswith("{") or (event := _json_object(line)) is None:
            return None
        kind = event.get("type")
        props = event.get("properties") if isinstance(event.get("properties"), dict) else {}
        if kind == "bridge.error" and props.get("request") == "prompt":
            self.turns_ended += 1
            return ("result", None)
        status = props.get("status") if isinstance(props.get("status"), dict) else {}
        if kind == "session.idle" or (kind == "session.status" and status.get("type") == "idle"):
            parent, self.last = self.last, None
            if parent is None or parent in self.answered:
                return None
            self.answered.add(parent)  # the loop stopped after a tool call (docstring)
            self.turns_ended += 1
            return ("result", None)
        if kind != "message.updated" or not isinstance(info := props.get("info"), dict):
            return None
        time_ = info.get("time") if isinstance(info.get("time"), dict) else {}
        parent = info.get("parentID")
        if info.get("role") != "assistant" or not isinstance(parent, str):
            return None
        self.last = parent if time_.get("completed") else None
        if parent in self.answered or not time_.get("completed"):
            return None
        if not info.get("error") and info.get("finish") in ("tool-calls", "tool_calls", None):
            return None
        self.answered.add(parent)
        self.turns_ended += 1
        return ("result", None)

    def line(self, item: dict, items: list[dict]) -> str | None:
        if item["kind"] == "message":
            return json.dumps({"prompt": _text(item["line"])})
        if item["kind"] == "interrupt":
            return json.dumps({"abort": True})
        return None


ADAPTERS = {"claude": StreamJson, "codex": AppServer, "opencode": OpencodeServe}


def for_preset(preset: str | None):
    """A fresh adapter for a profile's ``preset`` (a ``presets.PRESETS`` name with a
    ``live_argv``; anything else is taken as Claude Code's streaming input)."""
    return ADAPTERS.get(preset or "claude", StreamJson)()
