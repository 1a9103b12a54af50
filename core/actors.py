"""Who did it: the actor strings of a task's history (``TaskEvent.actor``) and of an
approval's decision (``decided_by``), shown by the API, the board and the admin.

Every app writes them from here and nowhere else: ``actor_owner``, ``actor_machine`` and
the two constants.
"""
ACTOR_SERVICE = "service"  # the service's own checks (L6 on a renewal, L5 refusals)
ACTOR_SWEEP = "sweep"  # the periodic sweep (J5, L6)


def actor_owner(user) -> str:
    """``owner:<username>``: an owner acting through the API, the board or the admin."""
    return f"owner:{user.get_username()}"


def actor_machine(machine) -> str:
    """``machine:<machine id>``: a machine acting with its token. The id, not the name:
    names are not unique and can change at a re-pair; the id is also the device id the
    worker writes markers with (M5, M8)."""
    return f"machine:{machine.pk}"
