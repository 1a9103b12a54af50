"""The history checker (issue 42): verifies a run's record (``tests.history.record``)
against the contract, from the record alone: no access to the service's tables. No Django.

Each check returns ``Violation``s; ``check(lines)`` runs them all. The rules:

- ``double_start`` (W3, X4): no operation started twice by an agent (by operation id and
  by task);
- ``acceptance`` (A5, SPEC 2, U): every acknowledged acceptance is visible (a read found
  it) and its last read says a final state or ``unknown``;
- ``replay`` (A2, A3, A4): per path and Idempotency-Key, at most one body was answered
  2xx, and every 2xx answer to that body is byte-equal (status and bytes) to the first;
- ``states`` (SPEC 2): the states read of a task only move forward (a read that began
  after another ended never says an earlier state; a final state never changes), and
  every transition of its event history is one of SPEC 2's;
- ``start_after_stop`` (P1, P3, J7, L1): every agent start has a lease (a ``starting``
  event) granted before any acknowledged cancel of its task and before any acknowledged
  revocation of its grant or unpairing of its machine that began after its acceptance;
- ``approvals`` (Q2): each approval has at most one decision (one key won, all answers
  agree), and the agent acted on that one;
- ``merges`` (G7): each task integrated at most once (one key won; one action), and the
  base branch holds a task's commit at most once, and only when a merge may have won;
- ``messages`` (C2, C3, T2, C10): every message, a conversation's or a session's (T2: the
  Stop hook's block is what its agent receives), reached its agent at most once, in ``seq``
  order (a steer, C9, may pass messages queued for turns of their own), and one reported
  ``answered`` reached it; a message whose withdraw won never
  reached it, and no later read says it was delivered;
- ``busy`` (S1, S3): no session read says idle inside a span where a turn ran or a held
  job was pending (``busy_spans``).

A queued follow-up may end the run ``queued`` when the task it follows ended it
``unknown`` (G8: its turn comes when that one is final).

``python -m tests.history.checker RECORD`` prints each violation with the timeline of its
operations and exits 1 on any.
"""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

FINAL = ("succeeded", "failed", "failed_lease_lost", "cancelled", "not_started", "abandoned")
RANK = {"queued": 0, "accepted": 1, "delivered": 2, "starting": 3, "running": 4, "unknown": 5,
        **{state: 6 for state in FINAL}}
J6 = {"succeeded", "failed", "failed_lease_lost", "cancelled", "not_started"}
# SPEC 2: from -> the states an event may move it to (the same state: a history-only event).
TRANSITIONS = {
    None: {"queued", "accepted"},
    "queued": {"accepted", "cancelled", "not_started"},
    "accepted": {"delivered", "starting", "cancelled", "not_started"},
    "delivered": {"starting", "cancelled", "not_started"},
    "starting": {"running", "unknown"} | J6,
    "running": {"unknown"} | J6,
    "unknown": J6 | {"abandoned"},
}
DECIDED = {"allowed": "allow", "denied": "deny"}


@dataclass
class Violation:
    check: str
    rule: str
    detail: str
    ops: list = field(default_factory=list)  # ids of the operations involved

    def __str__(self):
        return f"[{self.check}] {self.rule}: {self.detail}"


def epoch(iso: str | None) -> float | None:
    return None if not iso else datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def body(op: dict):
    """The answer's JSON (parsed once per operation), or None."""
    if "_parsed" not in op:
        try:
            op["_parsed"] = json.loads(op.get("body") or "null")
        except ValueError:
            op["_parsed"] = None
    return op["_parsed"]


def acked(op: dict) -> bool:
    return op.get("status") is not None and 200 <= op["status"] < 300


def process(line: dict):
    return line.get("proc") or line["pid"]


class History:
    """The record, indexed."""

    def __init__(self, lines: list[dict]):
        self.ops = sorted((x for x in lines if x["type"] == "op"), key=lambda o: o["t1"])
        self.by_id = {o["id"]: o for o in self.ops}
        self.agent = [x for x in lines if x["type"] == "agent"]
        self.repos = [x for x in lines if x["type"] == "repo"]
        self.faults = [x for x in lines if x["type"] == "fault"]
        self.submits = [o for o in self.ops if o["f"] == "submit"]
        self.accepted: dict[str, dict] = {}  # task id -> its first acknowledged acceptance
        self.prompt_task: dict[str, str] = {}
        for op in self.submits:
            answer = body(op)
            if acked(op) and isinstance(answer, dict) and answer.get("id"):
                self.accepted.setdefault(answer["id"], op)
                self.prompt_task[(op.get("json") or {}).get("prompt")] = answer["id"]
        self._reads: dict[str, list] = defaultdict(list)
        self._detail: dict[str, dict] = {}
        for op in self.ops:
            answer = body(op) if op.get("status") == 200 and op["f"] in ("read", "cancel") else None
            if isinstance(answer, dict) and answer.get("id"):
                self._reads[answer["id"]].append(op)
                if op["f"] == "read" and "events" in answer:
                    self._detail[answer["id"]] = answer
        # agent process -> its task, and operation -> task. A process is its log file
        # (``proc``): pids are reused over a long run.
        self.pid_task: dict = {}
        self.op_task: dict[str, str] = {}
        for line in self.agent:
            if line["ev"] == "start":
                task = line.get("task") or self.prompt_task.get(line.get("prompt"))
                if task:
                    self.pid_task[process(line)] = task
                    if line.get("op"):
                        self.op_task[line["op"]] = task

    def task_of_agent(self, line: dict) -> str | None:
        return self.pid_task.get(process(line)) or self.op_task.get(line.get("op")) or line.get("task")

    def reads(self, task_id: str) -> list[dict]:
        """Acknowledged answers that show the task's live state (not acceptance snapshots,
        which A2 keeps at acceptance time)."""
        return self._reads.get(task_id, [])

    def detail(self, task_id: str) -> dict | None:
        """The last full read (with ``events``) of the task."""
        return self._detail.get(task_id)


def check_double_start(h: History) -> list[Violation]:
    out = []
    by_op, by_task = defaultdict(list), defaultdict(list)
    for line in h.agent:
        if line["ev"] == "start":
            if line.get("op"):
                by_op[line["op"]].append(line)
            task = h.task_of_agent(line)
            if task:
                by_task[task].append(line)
    seen = set()
    for key, starts in [*by_op.items(), *by_task.items()]:
        pids = sorted({s["pid"] for s in starts})
        procs = tuple(sorted({str(process(s)) for s in starts}))
        if len(starts) > 1 and procs not in seen:
            seen.add(procs)
            task = h.task_of_agent(starts[0])
            out.append(Violation("double_start", "W3/X4", f"{key} started {len(starts)} times (pids {pids})",
                                 [h.accepted[task]["id"]] if task in h.accepted else []))
    return out


def check_acceptances(h: History) -> list[Violation]:
    out = []
    gone = defaultdict(list)
    for op in h.ops:
        if op["f"] == "read" and op.get("status") == 404:
            gone[op["path"].split("/")[-2]].append(op)
    for task_id, submit in h.accepted.items():
        reads = h.reads(task_id)
        missing = [o for o in gone.get(task_id, []) if o["t0"] > submit["t1"]]
        if missing:
            out.append(Violation("acceptance", "A5", f"acknowledged task {task_id} answered 404 to a read",
                                 [submit["id"], missing[0]["id"]]))
        if not reads:
            out.append(Violation("acceptance", "A5", f"acknowledged task {task_id} was never read", [submit["id"]]))
            continue
        last = reads[-1]
        state = body(last)["state"]
        if state == "queued" and waits_on_unknown(h, body(last)):
            continue  # G8: a follow-up waits while the task it follows waits for its owner (U)
        if state not in FINAL and state != "unknown":
            out.append(Violation("acceptance", "SPEC 2/U", f"task {task_id} ended the run in {state!r}, neither final "
                                 "nor unknown", [submit["id"], last["id"]]))
    return out


def waits_on_unknown(h: History, task: dict, depth: int = 0) -> bool:
    """Whether a queued task's chain ends in a task whose last read says ``unknown``."""
    behind = h.reads(task.get("queued_behind") or "")
    if not behind or depth > 50:
        return False
    last = body(behind[-1])
    return last["state"] == "unknown" or (last["state"] == "queued" and waits_on_unknown(h, last, depth + 1))


def canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def check_replays(h: History) -> list[Violation]:
    out = []
    groups = defaultdict(list)
    for op in h.ops:
        if op.get("key") and op["method"] == "POST":
            groups[(op["path"], op["key"])].append(op)
    for (path, key), ops in groups.items():
        answered = defaultdict(list)
        for op in ops:
            if acked(op):
                answered[canonical(op.get("json"))].append(op)
        if len(answered) > 1:
            firsts = [group[0]["id"] for group in answered.values()]
            out.append(Violation("replay", "A3", f"{path} key {key!r}: {len(answered)} different bodies answered 2xx",
                                 firsts))
        for sent, group in answered.items():
            first = group[0]
            for other in group[1:]:
                if (other["status"], other["body"]) != (first["status"], first["body"]):
                    out.append(Violation("replay", "A2/A4", f"{path} key {key!r}: answer {other['status']} differs from "
                                         f"the first {first['status']} (not byte-equal)", [first["id"], other["id"]]))
        for op in ops:
            refused = body(op) if op.get("status") == 422 else None
            if refused and refused.get("error") == "idempotency_key_reused" and canonical(op.get("json")) in answered:
                out.append(Violation("replay", "A2", f"{path} key {key!r}: the same body was refused as a reuse",
                                     [answered[canonical(op.get('json'))][0]["id"], op["id"]]))
    return out


def check_states(h: History) -> list[Violation]:
    out = []
    for task_id, submit in h.accepted.items():
        reads = h.reads(task_id)
        for i, a in enumerate(reads):
            for b in reads[i + 1:]:
                if b["t0"] <= a["t1"]:
                    continue  # concurrent: either order is possible
                sa, sb = body(a)["state"], body(b)["state"]
                if RANK[sb] < RANK[sa] or (sa in FINAL and sb != sa):
                    out.append(Violation("states", "SPEC 2", f"task {task_id} read {sa!r} then {sb!r}",
                                         [submit["id"], a["id"], b["id"]]))
                    break
        detail = h.detail(task_id)
        for event in (detail or {}).get("events", []):
            old, new = event.get("old_state") or None, event.get("new_state")
            if old == new:
                continue
            if new not in TRANSITIONS.get(old, set()):
                out.append(Violation("states", "SPEC 2", f"task {task_id} event {old!r} -> {new!r} ({event.get('reason')})",
                                     [submit["id"]]))
    return out


def lease_time(h: History, task_id: str) -> float | None:
    for event in (h.detail(task_id) or {}).get("events", []):
        if event.get("new_state") == "starting":
            return epoch(event.get("at"))
    return None


def under(folder: str, root: str) -> bool:
    return folder == root or folder.startswith(root.rstrip("/") + "/")


def check_start_after_stop(h: History) -> list[Violation]:
    out = []
    starts = {}
    for line in h.agent:
        task = h.task_of_agent(line) if line["ev"] == "start" else None
        if task and task in h.accepted:
            starts.setdefault(task, line)
    stops = [op for op in h.ops if op["f"] in ("cancel", "revoke", "unpair") and acked(op)]
    for task_id, start in starts.items():
        submit = h.accepted[task_id]
        sent = submit.get("json") or {}
        leased = lease_time(h, task_id)
        if leased is None:
            out.append(Violation("start_after_stop", "L1", f"task {task_id} started (pid {start['pid']}) with no lease "
                                 "in its history", [submit["id"]]))
            continue
        queued = (body(submit) or {}).get("state") == "queued"
        for op in stops:
            if not acked(op) or op["t1"] >= leased:
                continue
            args = op.get("args") or {}
            if op["f"] == "cancel" and op["path"].endswith(f"/{task_id}/cancel/"):
                rule = "J7"
            elif op["f"] == "revoke" and not queued and op["t0"] > submit["t1"] and args.get("machine") == sent.get(
                    "machine") and under(sent.get("folder", ""), args.get("path", "")):
                rule = "P1/P3"
            elif op["f"] == "unpair" and not queued and op["t0"] > submit["t1"] and args.get("machine") == sent.get(
                    "machine"):
                rule = "P1/P3"
            else:
                continue
            out.append(Violation("start_after_stop", rule, f"task {task_id}: lease granted at {leased:.3f}, after the "
                                 f"{op['f']} acknowledged at {op['t1']:.3f}; the agent started (pid {start['pid']})",
                                 [submit["id"], op["id"]]))
    return out


def check_approvals(h: History) -> list[Violation]:
    out = []
    decides = defaultdict(list)
    for op in h.ops:
        if op["f"] == "decide":
            decides[(op.get("args") or {}).get("approval")].append(op)
    acted = defaultdict(list)
    for line in h.agent:
        if line["ev"] == "acted" and line.get("decision"):
            acted[line.get("task")].append(line)
    for approval_id, ops in decides.items():
        states, winners, task = set(), set(), None
        for op in ops:
            answer = body(op) or {}
            shown = answer.get("approval", answer) if op.get("status") == 409 else answer
            if op.get("status") in (200, 409) and shown.get("state") in DECIDED:
                states.add(shown["state"])
                task = task or shown.get("task")
            if op.get("status") == 200 and not op.get("replayed"):
                winners.add(op["key"])
        ids = [o["id"] for o in ops]
        if len(states) > 1 or len(winners) > 1:
            out.append(Violation("approvals", "Q2", f"approval {approval_id}: decisions {sorted(states)} from keys "
                                 f"{sorted(winners)}", ids))
        if len(states) == 1:
            want = DECIDED[next(iter(states))]
            for line in acted.get(task, []):
                if line["decision"] != want:
                    out.append(Violation("approvals", "Q2/Q3", f"approval {approval_id} was {want!r}, the agent of task "
                                         f"{task} acted on {line['decision']!r}", ids))
    return out


def commit_name(prompt: str | None) -> str | None:
    found = re.search(r"\[\[commit:(.*?)\]\]", prompt or "")
    return found.group(1) if found else None


def check_merges(h: History) -> list[Violation]:
    out = []
    by_task = defaultdict(list)
    for op in h.ops:
        if op["f"] == "integrate":
            by_task[op["path"].split("/")[-3]].append(op)
    for task_id, ops in by_task.items():
        winners = {op["key"] for op in ops if op.get("status") == 200 and not op.get("replayed")}
        actions = {(op.get("json") or {}).get("action") for op in ops if acked(op)}
        if len(winners) > 1 or len(actions) > 1:
            out.append(Violation("merges", "G7", f"task {task_id} integrated by {len(winners)} keys, actions "
                                 f"{sorted(a for a in actions if a)}", [o["id"] for o in ops]))
    subjects = defaultdict(int)
    for repo in h.repos:
        for subject in repo["subjects"]:
            subjects[subject] += 1
    for task_id, submit in h.accepted.items():
        name = commit_name((submit.get("json") or {}).get("prompt"))
        if not name:
            continue
        ops = by_task.get(task_id, [])
        may_merge = any(o["json"].get("action") == "merge" and (acked(o) or o.get("status") is None) for o in ops)
        if subjects[name] > 1 or (subjects[name] and not may_merge):
            out.append(Violation("merges", "G7", f"task {task_id}: its commit {name!r} is {subjects[name]} time(s) on the "
                                 f"base branch; a merge {'may have' if may_merge else 'never'} won",
                                 [submit["id"], *[o["id"] for o in ops]]))
    return out


def check_messages(h: History) -> list[Violation]:
    out = []
    seq_of = {}  # (task, text) -> seq, from acknowledged sends
    sends = {}
    for op in h.ops:
        if op["f"] in ("message", "smessage") and acked(op):
            task = op["path"].split("/")[-3]  # a task's or a session's id
            seq_of[(task, op["json"]["text"])] = body(op)["seq"]
            sends.setdefault((task, op["json"]["text"]), op)
    received = defaultdict(list)  # task or session -> its agent's message lines
    for line in h.agent:
        if line["ev"] == "message":
            task = h.task_of_agent(line)
            if task:
                received[task].append(line)
    for task, lines in received.items():
        counts = defaultdict(int)
        last_seq, last_text = -1, None
        for line in lines:
            text = line["text"]
            counts[text] += 1
            if counts[text] == 2:
                op = sends.get((task, text))
                out.append(Violation("messages", "C3", f"task {task}: message {text!r} reached the agent twice",
                                     [op["id"]] if op else []))
            seq = seq_of.get((task, text))
            if seq is not None:
                # C9: a steer goes into the running turn, past messages queued for turns of
                # their own; the order holds among the rest.
                steered = any((sends.get((task, t)) or {}).get("json", {}).get("delivery") == "steer"
                              for t in (text, last_text))
                if seq < last_seq and not steered:
                    out.append(Violation("messages", "C2", f"task {task}: seq {seq} ({text!r}) reached the agent after "
                                         f"seq {last_seq} ({last_text!r})",
                                         [sends[(task, text)]["id"], sends[(task, last_text)]["id"]]))
                last_seq, last_text = seq, text
    text_of = {(task, seq): text for (task, text), seq in seq_of.items()}
    withdrawn = {}  # (task, seq) -> the withdraw that won (C10)
    for op in h.ops:
        if op["f"] == "withdraw" and op.get("status") == 200 and (body(op) or {}).get("state") == "withdrawn":
            parts = op["path"].split("/")
            withdrawn.setdefault((parts[-5], int(parts[-3])), op)
    for (task, seq), op in withdrawn.items():
        text = text_of.get((task, seq))
        got = [line for line in received.get(task, []) if line["text"] == text]
        if got:
            out.append(Violation("messages", "C10", f"{task}: seq {seq} ({text!r}) was withdrawn and reached the agent "
                                 f"{len(got)} time(s)", [*([sends[(task, text)]["id"]] if text else []), op["id"]]))
    for op in h.ops:
        if op["f"] not in ("messages", "smessages") or op.get("status") != 200:
            continue
        task = op["path"].split("/")[-3]
        got = {line["text"] for line in received.get(task, [])}
        for message in (body(op) or {}).get("results", []):
            # ``delivered`` is written to the agent's input, which an agent stopped at once
            # never reads; ``answered`` means its turn ended: it was read (C3).
            if (task, message["seq"]) in withdrawn and message["state"] != "withdrawn" and op["t0"] > withdrawn[
                    (task, message["seq"])]["t1"]:
                out.append(Violation("messages", "C10", f"{task}: seq {message['seq']} was withdrawn, later read "
                                     f"{message['state']!r}", [withdrawn[(task, message["seq"])]["id"], op["id"]]))
            if message["state"] == "answered" and message["text"] not in got:
                send = sends.get((task, message["text"]))
                out.append(Violation("messages", "C3", f"task {task}: seq {message['seq']} reported {message['state']!r} "
                                     "never reached the agent", [op["id"], *([send["id"]] if send else [])]))
    return out


def busy_spans(h: History) -> dict[str, list[tuple[float, float, str, list]]]:
    """Session -> the spans in which it had to be busy, ``(from, to, rule, op ids)``: a
    turn from its ``running`` write's answer to its ``ended`` write's first try (S1); a
    held job from its start's answer until its release (S3): ``wakes: false``, the
    finish's first try; ``wakes: true``, the first try of the ``ended`` write of the
    first turn whose ``running`` write began after the finish was answered (the wake turn
    that consumes it). A release never tried: the run's end (S7's 60 minutes are longer
    than a run's held job)."""
    writes = defaultdict(list)
    for op in h.ops:
        if op["f"] in ("marker", "job", "job_finish"):
            writes[(op.get("args") or {}).get("session")].append(op)
    end_of_run = max((o["t1"] for o in h.ops), default=0.0)
    spans = defaultdict(list)
    for session, ops in writes.items():
        ops = sorted(ops, key=lambda o: o["t0"])

        def first_try(pred):
            return min((o["t0"] for o in ops if pred(o)), default=end_of_run)

        for op in ops:
            args = op.get("args") or {}
            if op["f"] == "marker" and args.get("state") == "running" and acked(op):
                ended = first_try(lambda o, t=args["turn"]: o["f"] == "marker" and o["args"].get("turn") == t
                                  and o["args"].get("state") == "ended")
                spans[session].append((op["t1"], ended, "S1", [op["id"]]))
            if op["f"] == "job" and acked(op):
                job = args["job"]
                finishes = [o for o in ops if o["f"] == "job_finish" and o["args"].get("job") == job]
                if not finishes:
                    release = end_of_run
                elif not finishes[0]["args"].get("wakes"):
                    release = finishes[0]["t0"]
                else:
                    answered = [o["t1"] for o in finishes if acked(o)]
                    wake = next((o for o in ops if answered and o["f"] == "marker" and o["args"].get("state") == "running"
                                 and o["t0"] >= min(answered)), None)
                    release = end_of_run if wake is None else first_try(
                        lambda o, t=wake["args"]["turn"]: o["f"] == "marker" and o["args"].get("turn") == t
                        and o["args"].get("state") == "ended")
                spans[session].append((op["t1"], release, "S3", [op["id"], *[o["id"] for o in finishes]]))
    return spans


def check_busy(h: History) -> list[Violation]:
    """S1, S3: no read of a session inside a span where it had to be busy (``busy_spans``:
    the read began after the span began and was answered before it ended) says idle."""
    out = []
    spans = busy_spans(h)
    for op in h.ops:
        if op["f"] != "sread" or op.get("status") != 200:
            continue
        session = (op.get("args") or {}).get("session")
        state = (body(op) or {}).get("status")
        if state == "busy":
            continue
        for start, end, rule, ids in spans.get(session, []):
            if op["t0"] > start and op["t1"] < end:
                what = "a held job was pending" if rule == "S3" else "a turn was running"
                out.append(Violation("busy", rule, f"session {session} read {state!r} while {what}", [*ids, op["id"]]))
                break
    return out


CHECKS = (check_double_start, check_acceptances, check_replays, check_states, check_start_after_stop,
          check_approvals, check_merges, check_messages, check_busy)


def check(lines: list[dict]) -> list[Violation]:
    h = History(lines)
    found = []
    for each in CHECKS:
        found += each(h)
    return found


def timeline(lines: list[dict] | History, violation: Violation) -> str:
    """The violation's operations, one line each, in completion order."""
    h = lines if isinstance(lines, History) else History(lines)
    rows = []
    for op_id in violation.ops:
        op = h.by_id.get(op_id)
        if op:
            rows.append(f"    #{op['id']} {op['client']} {op['t0']:.3f}-{op['t1']:.3f} {op['method']} {op['path']} "
                        f"key={op.get('key')} -> {op.get('status')} {(op.get('body') or '')[:160]}")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    from tests.history.record import load

    lines = load(argv[0])
    history = History(lines)
    found = [v for each in CHECKS for v in each(history)]
    ops = sum(1 for x in lines if x["type"] == "op")
    faults = sum(1 for x in lines if x["type"] == "fault")
    starts = sum(1 for x in lines if x["type"] == "agent" and x["ev"] == "start")
    print(f"{ops} operations, {faults} faults, {starts} agent starts: {len(found)} violation(s)")
    for violation in found:
        print(violation)
        print(timeline(history, violation))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
