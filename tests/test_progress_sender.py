"""The worker's progress sender (SPEC G4, W8): the newest progress per operation at most
once an interval, and transcript entries kept until the service confirms them (a post
answered ``applied``), at most 50 a post, 500 waiting; ``forget`` tells the highest
confirmed number so the final receipt carries the rest."""
import threading

import pytest

from machine.protocol import ENTRIES_KEPT, ENTRIES_PER_POST
from machine.worker.progress import ProgressSender
from tests.wait import wait_for

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

OP = "00000000-0000-0000-0000-000000000001"


class Service:
    """Records each post; answers ``applied`` unless ``failing`` is set."""

    def __init__(self):
        self.posts: list[dict] = []
        self.failing = threading.Event()

    def post(self, body: dict) -> bool:
        self.posts.append(body)
        if self.failing.is_set():
            raise OSError("service down")
        return True


def entries(first: int, last: int) -> list[dict]:
    return [{"n": n, "kind": "message", "text": f"m{n}"} for n in range(first, last + 1)]


def numbers(body: dict) -> list[int]:
    return [e["n"] for e in body["entries"]]


def test_g4_entries_of_a_failed_post_go_with_the_next_and_count_once_confirmed():
    service = Service()
    sender = ProgressSender(service.post, interval_s=0.05).start()
    try:
        service.failing.set()
        sender.offer(OP, {"output_tail": "a", "last_message": None, "usage": None}, entries(1, 3))
        wait_for(lambda: len(service.posts) == 1, timeout_s=5, what="the first post")
        service.failing.clear()
        sender.offer(OP, {"output_tail": "b", "last_message": "hi", "usage": None}, entries(4, 4))
        wait_for(lambda: len(service.posts) == 2, timeout_s=5, what="the second post")
        assert numbers(service.posts[0]) == [1, 2, 3]
        assert numbers(service.posts[1]) == [1, 2, 3, 4]  # the unconfirmed ones ride along
        assert service.posts[1]["output_tail"] == "b" and service.posts[1]["seq"] == 2
        wait_for(lambda: sender.confirmed.get(OP) == 4, timeout_s=5, what="confirmation")
        assert sender.forget(OP) == 4
    finally:
        sender.stop()


def test_g4_a_burst_of_entries_goes_50_a_post_without_new_offers():
    service = Service()
    sender = ProgressSender(service.post, interval_s=0.05).start()
    try:
        sender.offer(OP, {"output_tail": "", "last_message": None, "usage": None}, entries(1, 120))
        wait_for(lambda: len(service.posts) == 3, timeout_s=5, what="three posts")
        assert [numbers(b) for b in service.posts] == [list(range(1, 51)), list(range(51, 101)),
                                                       list(range(101, 121))]
        assert [b["seq"] for b in service.posts] == [1, 2, 3]
        assert max(len(b["entries"]) for b in service.posts) == ENTRIES_PER_POST
    finally:
        sender.stop()


def test_g4_at_most_500_entries_wait_the_oldest_go_first():
    service = Service()
    service.failing.set()
    sender = ProgressSender(service.post, interval_s=60)  # not started: nothing is posted
    sender.offer(OP, {"output_tail": "", "last_message": None, "usage": None}, entries(1, 700))
    assert [e["n"] for e in sender.unsent[OP]] == list(range(700 - ENTRIES_KEPT + 1, 701))
    assert sender.forget(OP) == 0 and OP not in sender.unsent
