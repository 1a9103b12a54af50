"""Worker-side lease deadline math (SPEC L3, L4, L9).

A lease reply gives ``duration_s``, ``renew_every_s``, ``margin_s`` and ``kill_grace_s``;
the worker never uses its own settings for these. The local deadline counts from the
moment the grant or renewal request was *sent* (both clocks read then):

    elapsed   = max(monotonic now - monotonic at send, wall now - wall at send)
    remaining = duration_s - margin_s - elapsed

Taking the max means a sleep (monotonic stops, wall runs) or a wall clock jumping backward
(wall elapsed shrinks, monotonic runs) never extends a deadline; a wall jump forward ends
it early, which is the safe side.
"""
from __future__ import annotations

from dataclasses import dataclass

from .clock import Clock

# Deadline phases (L4).
OK = "ok"
TERM = "term"  # remaining <= kill_grace_s: SIGTERM the group
KILL = "kill"  # remaining <= 0: SIGKILL, the lease is lost


@dataclass(frozen=True)
class SentAt:
    """Both clock readings taken just before a request went out (seconds)."""

    monotonic: float
    wall: float

    @classmethod
    def now(cls, clock: Clock) -> SentAt:
        return cls(monotonic=clock.monotonic(), wall=clock.wall())

    def elapsed(self, clock: Clock) -> float:
        """``max(monotonic elapsed, wall elapsed)`` since this point (L3), seconds."""
        return max(clock.monotonic() - self.monotonic, clock.wall() - self.wall)


@dataclass(frozen=True)
class LeaseTerms:
    """The timings of one grant or renewal reply (seconds)."""

    lease_id: str
    duration_s: float
    renew_every_s: float
    margin_s: float
    kill_grace_s: float

    @classmethod
    def from_reply(cls, reply: dict) -> LeaseTerms:
        return cls(
            lease_id=str(reply["lease_id"]),
            duration_s=float(reply["duration_s"]),
            renew_every_s=float(reply["renew_every_s"]),
            margin_s=float(reply["margin_s"]),
            kill_grace_s=float(reply["kill_grace_s"]),
        )


@dataclass(frozen=True)
class Deadline:
    """The local deadline of a lease, anchored at a request's send time (L3)."""

    terms: LeaseTerms
    sent: SentAt

    def remaining(self, clock: Clock) -> float:
        """Seconds left before the local deadline; <= 0 means the lease is lost."""
        return self.terms.duration_s - self.terms.margin_s - self.sent.elapsed(clock)

    def phase(self, clock: Clock) -> str:
        """``OK``, ``TERM`` (at deadline - kill_grace_s) or ``KILL`` (at the deadline) (L4)."""
        left = self.remaining(clock)
        if left <= 0:
            return KILL
        if left <= self.terms.kill_grace_s:
            return TERM
        return OK

    def within(self, monotonic: float, wall: float) -> bool:
        """Whether an event seen at these clock readings happened before the deadline.

        ``monotonic`` may be None when it is not comparable (another boot): then only the
        wall clock decides.
        """
        limit = self.terms.duration_s - self.terms.margin_s
        wall_elapsed = wall - self.sent.wall
        if monotonic is None:
            return wall_elapsed < limit
        return max(monotonic - self.sent.monotonic, wall_elapsed) < limit


def slept_s(granted: SentAt | None, clock: Clock) -> float:
    """Wall elapsed minus monotonic elapsed since the lease was granted, >= 0 (L9)."""
    if granted is None:
        return 0.0
    return max(0.0, (clock.wall() - granted.wall) - (clock.monotonic() - granted.monotonic))


def record_slept_s(record: dict, *, clock: Clock, boot: str) -> float:
    """``slept_s`` (L9) of a local operation record since its grant; 0 when it was never
    granted or was granted in another boot (monotonic readings are not comparable)."""
    if record.get("granted_mono") is None or record.get("boot_id") != boot:
        return 0.0
    return slept_s(SentAt(record["granted_mono"], record["granted_wall"]), clock)
