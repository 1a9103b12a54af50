"""Numbers of the service <-> worker contract (SPEC H), written once.

No Django here: the worker (``tasks_app/worker/``) imports this module, and it must run
without Django (it may ship alone one day).
"""

# POST /api/tasks/ without ``max_runtime_s``: the task may run this long, in seconds, and
# this much budget is reserved at acceptance (A6, J4).
DEFAULT_MAX_RUNTIME_S = 1800

# GET /api/worker/messages/?wait=S holds the request at most this long, in seconds (H, W2).
LONG_POLL_MAX_S = 25

# Characters of agent output kept: what the worker sends in a renewal or a final receipt
# and what the service stores from either (L10, W4).
OUTPUT_TAIL_MAX_CHARS = 4000
