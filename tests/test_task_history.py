"""B11 history: ``GET /api/tasks/?q=`` searches prompts (case-insensitive substring, the
text taken literally), combines with the other filters and the stable cursor, and is
strict input like every query parameter (K3)."""
import pytest

from tests.conftest import owner_api
from tests.factories import submit


@pytest.fixture
def prompts(owner, machine, grant, pinned):
    """Five tasks with known prompts; returns {label: task id}."""
    texts = {
        "fix": "Fix the LOGIN bug",
        "login2": "add a login rate limit",
        "percent": "report 100% coverage",
        "under": "rename snake_case names",
        "other": "write the release notes",
    }
    ids = {}
    for label, text in texts.items():
        response = submit(owner, machine, grant.path, exclusive=False, prompt=text)
        assert response.status_code == 201, response.content
        ids[label] = response.json()["id"]
        pinned.shift(1)
    return ids


def listed(client, query):
    response = client.get(f"/api/tasks/?{query}")
    assert response.status_code == 200, response.content
    return [t["id"] for t in response.json()["results"]]


def test_b11_search_finds_prompts_case_insensitively_newest_first(owner, prompts):
    client = owner_api(owner)
    assert listed(client, "q=login") == [prompts["login2"], prompts["fix"]]
    assert listed(client, "q=LOGIN%20BUG") == [prompts["fix"]]
    assert listed(client, "q=nothing-like-this") == []


def test_b11_search_takes_like_wildcards_literally(owner, prompts):
    client = owner_api(owner)
    assert listed(client, "q=%25") == [prompts["percent"]]  # "%" matches only a real "%"
    assert listed(client, "q=e_c") == [prompts["under"]]  # "_" is not "any character"


def test_b11_search_combines_with_state_and_pages_on_the_cursor(owner, prompts):
    client = owner_api(owner)
    assert client.post(f"/api/tasks/{prompts['fix']}/cancel/").status_code == 200
    assert listed(client, "q=login&state=cancelled") == [prompts["fix"]]
    assert listed(client, "q=login&state=accepted") == [prompts["login2"]]
    first = client.get("/api/tasks/?q=e&limit=2").json()
    assert [t["id"] for t in first["results"]] == [prompts["other"], prompts["under"]]
    second = client.get(first["next"]).json()
    assert [t["id"] for t in second["results"]] == [prompts["percent"], prompts["login2"]]
    third = client.get(second["next"]).json()
    assert [t["id"] for t in third["results"]] == [prompts["fix"]] and third["next"] is None


def test_b11_search_sees_only_the_owners_tasks(owner, other_owner, make_machine, grant_root, prompts):
    from tasks_app.models import Grant

    theirs = make_machine(other_owner, name="theirs")
    (grant_root / "t").mkdir()
    Grant.objects.create(owner=other_owner, machine=theirs, path=str(grant_root / "t"))
    assert submit(other_owner, theirs, str(grant_root / "t"), prompt="login elsewhere").status_code == 201
    assert listed(owner_api(owner), "q=elsewhere") == []
    assert len(listed(owner_api(other_owner), "q=login")) == 1


@pytest.mark.parametrize("query", ["q=", "q=%20%20", "q=a&q=b", "q=" + "x" * 201, "q=a%00b"])
def test_k3_bad_search_is_refused(owner, prompts, query):
    response = owner_api(owner).get(f"/api/tasks/?{query}")
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["error"] == "invalid" and body["detail"] and "q" in body["fields"], body
