"""Faults injected into the service, for the checker's own proof (issue 42): the checker
must catch a real run of a broken service, not only hand-made histories.

Python imports ``sitecustomize`` at start-up from ``sys.path``; a history run started with
``service_fault`` puts this folder on the daphnes' ``PYTHONPATH`` with
``HISTORY_SERVICE_FAULT`` set to a comma-separated list of faults (nothing else loads
this file, and the product has no such flag). Each fault replaces one service function
(a module attribute, which the views call through their module) once Django is set up:

- ``replay_differs``: an idempotent replay's body gets one more byte (a space), breaking
  A2's byte-equality; the JSON still parses, so only the bytes tell (check ``replay``);
- ``message_twice``: a conversation message is written twice (C2, C3): the accepted one
  and, in the same transaction, a twin with the same text and the next ``seq``, sent to
  the worker as a message of its own; the client's answer names only the first. Its
  agent reads the text twice (check ``messages``, C3);
- ``withdrawn_delivered``: a session message's withdraw (T2, C10) answers 200
  ``withdrawn`` while the message stays ``sent`` (the write is skipped), so the Stop
  hook still claims it and its agent gets it (check ``messages``, C10);
- ``idle_blip``: a session's busy/idle (S1) forgets its held jobs (S3): a turn that ends
  with a held job pending makes it idle (check ``busy``, S3).
"""
import os

FAULTS = set(filter(None, os.environ.get("HISTORY_SERVICE_FAULT", "").split(",")))
KNOWN = {"replay_differs", "message_twice", "withdrawn_delivered", "idle_blip"}
if FAULTS - KNOWN:
    raise SystemExit(f"HISTORY_SERVICE_FAULT: unknown {sorted(FAULTS - KNOWN)}")


def replay_differs():
    from core import idempotency

    answer = idempotency._http

    def http(status, body, *, replayed):
        return answer(status, body + " " if replayed else body, replayed=replayed)

    idempotency._http = http


def message_twice():
    from tasks_app.services import conversation

    accept = conversation.message_accept

    def message_accept(**kwargs):
        first = accept(**kwargs)
        accept(**kwargs)  # the twin: same text, the next seq, its own message to the worker
        return first

    conversation.message_accept = message_accept


def withdrawn_delivered():
    from sessions_app import messages
    from sessions_app.models import SessionMessage, SessionMessageState
    from sessions_app.shapes import session_message_dict

    withdraw = messages.message_withdraw

    def message_withdraw(*, owner, session_id, seq, now):
        message = SessionMessage.objects.filter(session_id=session_id, session__owner=owner, seq=seq).first()
        if message is not None and message.state == SessionMessageState.SENT:
            return {**session_message_dict(message), "state": SessionMessageState.WITHDRAWN.value}
        return withdraw(owner=owner, session_id=session_id, seq=seq, now=now)

    messages.message_withdraw = message_withdraw


def idle_blip():
    from sessions_app import services
    from sessions_app.models import Marker
    from sessions_app.rules import running_markers_q
    from tasks_app.models import Task

    def session_is_busy(*, session_id, now):
        return (Marker.objects.filter(running_markers_q(now), session_id=session_id).exists()
                or Task.objects.filter(services.busy_tasks_q(), session_id=session_id).exists())

    services.session_is_busy = session_is_busy


if FAULTS:
    import django

    _setup = django.setup

    def setup(*args, **kwargs):
        _setup(*args, **kwargs)
        for fault in sorted(FAULTS):
            globals()[fault]()

    django.setup = setup
