"""A fault injected into the service, for the checker's own proof (issue 42): the checker
must catch a real run of a broken service, not only hand-made histories.

Python imports ``sitecustomize`` at start-up from ``sys.path``; a history run started with
``service_fault`` puts this folder on the daphnes' ``PYTHONPATH`` with
``HISTORY_SERVICE_FAULT`` set (nothing else loads it, and the product has no such flag).
Faults:

- ``replay_differs``: an idempotent replay's body gets one more byte (a space), breaking
  A2's byte-equality; the JSON still parses, so only the bytes tell.
"""
import os

FAULT = os.environ.get("HISTORY_SERVICE_FAULT")

if FAULT == "replay_differs":
    import django

    _setup = django.setup

    def setup(*args, **kwargs):
        _setup(*args, **kwargs)
        from core import idempotency

        answer = idempotency._http

        def http(status, body, *, replayed):
            return answer(status, body + " " if replayed else body, replayed=replayed)

        idempotency._http = http

    django.setup = setup
