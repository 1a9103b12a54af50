"""``PUT /api/worker/profiles/`` (B10, H, K3): a machine reports its profiles; the owner's
board gets them in the machine shape."""
import pytest

from tests.conftest import machine_api
from tests.sessions_events import board_events  # noqa: F401

pytestmark = pytest.mark.django_db

PROFILES = {"profiles": [{"name": "fast", "preset": "codex"}, {"name": "claude", "preset": "claude"}]}


def test_b10_profiles_are_stored_sorted_and_published_once(machine_client, machine, owner, owner_client, board_events,
                                                            django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        response = machine_client.put("/api/worker/profiles/", PROFILES, format="json")
    assert response.status_code == 200, response.content
    # C1: a profile reported without ``conversation`` cannot converse
    expected = [{"name": "claude", "preset": "claude", "isolation": "none", "conversation": "none"},
                {"name": "fast", "preset": "codex", "isolation": "none", "conversation": "none"}]
    assert response.json() == {"profiles": expected}
    # (a first machine event may say the machine was heard from: B7)
    events = [e for e in board_events.of(owner) if e["type"] == "machine" and e["machine"]["profiles"]]
    assert [e["machine"]["profiles"] for e in events] == [expected]
    count_before = len(board_events.of(owner))
    with django_capture_on_commit_callbacks(execute=True):
        assert machine_client.put("/api/worker/profiles/", PROFILES, format="json").status_code == 200
    assert len(board_events.of(owner)) == count_before  # unchanged: nothing new
    (listed,) = owner_client.get("/api/machines/").json()["results"]
    assert listed["profiles"] == expected


@pytest.mark.parametrize("body", [
    {"profiles": [{"name": "a", "preset": None, "argv": ["x"]}]},
    {"profiles": [{"name": 5, "preset": None}]},
    {"profiles": [{"name": "a", "preset": None}, {"name": "a", "preset": "claude"}]},
    {"profiles": {"name": "a"}},
    {"profiles": [], "extra": True},
])
def test_k3_profiles_refuse_bad_input(machine_client, machine, body):
    response = machine_client.put("/api/worker/profiles/", body, format="json")
    assert response.status_code == 400, response.content
    machine.refresh_from_db()
    assert machine.profiles == []


def test_k1_owner_token_cannot_report_profiles(owner_client, machine):
    assert owner_client.put("/api/worker/profiles/", PROFILES, format="json").status_code == 403


def test_k2_a_machine_reports_only_its_own_profiles(make_machine, other_owner, machine):
    other = make_machine(other_owner, name="theirs")
    assert machine_api(other).put("/api/worker/profiles/", PROFILES, format="json").status_code == 200
    machine.refresh_from_db()
    assert machine.profiles == []
