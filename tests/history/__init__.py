"""A history checker under faults (issue 42): a seeded run records every client operation
and what the agents really did while faults are injected; the checker then verifies the
whole history against the contract, from the record alone.

- ``record``: the append-only record (JSON lines) and its writer;
- ``checker``: the checks; ``python -m tests.history.checker RECORD`` prints the
  violations with their timeline and exits 1 on any;
- ``faults``: the fault injector (kill -9 and restart, partitions, Redis restart,
  PostgreSQL connections killed) and its seeded schedule;
- ``runner``: the run (services, workers, the client mix, the settle, the record);
- ``proxies``: the balancer in front of the daphnes and the blackholing proxy;
- ``agent.py``: the agent every worker runs, which writes the agents' side of the record;
- ``inject/``: a fault put into the service from the test side (the checker's own proof).

``tests/test_history.py`` runs a short seeded form; ``bench/history.py`` a long one by hand.
No Django in ``record`` and ``checker``.
"""
