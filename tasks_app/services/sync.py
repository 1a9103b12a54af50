"""One request per machine for its leases and receipts (issue 44: a machine's traffic
scales with machines, not with tasks).

``machine_sync`` renews every lease a worker lists, in one transaction, and applies a
batch of its receipts, each in its own: every item gets the answer its own request would
get (L2, L5, L6, L10 through ``leases.leases_renew``; R1-R3 through
``receipts.receipt_apply``); one refused renewal or one stale receipt changes nothing for
the others, and a receipt delivered again (alone or in another sync) gets its first
answer (R1).
"""
import json
from datetime import datetime

from core.errors import ApplicationError
from tasks_app.models import Machine
from tasks_app.services.leases import leases_renew
from tasks_app.services.receipts import receipt_apply
from tasks_app.shapes import SyncAnswerShape, lease_dict


def machine_sync(*, machine: Machine, renew: list[dict], receipts: list[dict], now: datetime) -> SyncAnswerShape:
    """Renew ``renew`` (``[{lease_id, output_tail?}]``), then apply ``receipts``
    (validated ``ReceiptBody`` dicts), all at ``now``. Renewals go first: they are what
    keeps a running agent alive, and a receipt never needs a renewal of its own batch.
    Returns ``{"leases": [{status: 200, lease} | {status: 404|409, error, detail}],
    "receipts": [{event_id, status, answer}]}``, each list in the order given."""
    leases = []
    for answer in leases_renew(machine=machine, items=renew, now=now) if renew else ():
        if isinstance(answer, ApplicationError):  # 404 not this machine's, 409 an L5 reason
            leases.append({"status": answer.status_code, "error": answer.code, "detail": answer.detail})
        else:
            leases.append({"status": 200, "lease": lease_dict(answer)})
    answers = []
    for receipt in receipts:
        status, body = receipt_apply(machine=machine, receipt=receipt, now=now)
        answers.append({"event_id": receipt["event_id"], "status": status, "answer": json.loads(body)})
    return {"leases": leases, "receipts": answers}
