"""K, D3: in production mode (``RUNSTEAD_ENV=production``, DEBUG off) error pages leak
nothing: no stack trace, no settings, no SECRET_KEY, no file paths, no SQL.

A real daphne in production mode whose database cannot be opened, so real views fail
the way a broken deployment does: 500 from an API view and from a page, 404 for an
unknown page and an unknown API path, 400 for a Host that is not allowed and for
malformed JSON. (``manage.py check --deploy`` is tests/test_deploy.py; admin for staff
only is the admin rows of tests/test_k_isolation_matrix.py.)
"""
import secrets

import httpx
import pytest

from tests.live import DaphneServer

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

LEAKS = ("Traceback", "SECRET_KEY", "settings.py", "DEBUG", "/work/", "site-packages", "OperationalError",
         "sqlite", "django.db", "File \"", "Request Method", "INSTALLED_APPS", "runstead-broken")


@pytest.fixture
def broken_production(tmp_path):
    key = "k-" + secrets.token_urlsafe(40)
    server = DaphneServer({
        "RUNSTEAD_ENV": "production", "SECRET_KEY": key, "ALLOWED_HOSTS": "127.0.0.1",
        # TLS ends at the proxy in production (deploy/Caddyfile); the test talks plain HTTP to daphne
        "RUNSTEAD_SSL_REDIRECT": "0", "RUNSTEAD_HSTS_SECONDS": "0",
        "DATABASE_URL": "", "REDIS_URL": "", "RUNSTEAD_SQLITE_PATH": str(tmp_path / "runstead-broken" / "no" / "db.sqlite3"),
        "RUNSTEAD_EMBEDDED_SWEEP": "0", "RUNSTEAD_EMBEDDED_NOTIFY": "0",
    }, log_dir=tmp_path)
    try:
        yield server, key
    finally:
        server.stop()


@pytest.mark.slow
def test_k_production_error_pages_leak_no_settings_stack_or_secret(broken_production):
    server, key = broken_production
    token = {"Authorization": "Token " + "a" * 40}
    cases = [
        ("GET", "/api/tasks/", token, None, 500),  # the token lookup cannot reach the database
        ("GET", "/", {"Cookie": "sessionid=" + "b" * 32}, None, 500),  # the session lookup cannot either
        ("GET", "/no-such-page/", {}, None, 404),
        ("GET", "/api/no-such-thing/", {}, None, 404),
        ("GET", "/accounts/login/", {"Host": "evil.example"}, None, 400),
        ("POST", "/api/worker/pair/", {"Content-Type": "application/json"}, b"{not json", 400),
    ]
    seen = []
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for method, path, headers, body, status in cases:
            response = client.request(method, path, headers=headers, content=body)
            text = response.text
            seen.append((path, response.status_code))
            leaked = [word for word in LEAKS if word in text] + (["the SECRET_KEY value"] if key in text else [])
            assert (path, response.status_code, leaked) == (path, status, []), text[:500]
            assert len(text) < 2000, f"{path}: a long error page: {text[:300]}"
    assert server.log(), "the server logged nothing"
    assert key not in server.log()
    # the API's refusals keep their JSON shape in production too
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.get("/api/no-such-thing/").json() == {"error": "not_found", "detail": "not found"}
        assert client.get("/api/tasks/", headers=token).json() == {"error": "server_error", "detail": "internal server error"}
        assert "Server Error (500)" in client.get("/", headers={"Cookie": "sessionid=" + "b" * 32}).text
        assert client.post("/api/worker/pair/", content=b"{", headers={"Content-Type": "application/json"}).json()[
            "error"] == "malformed_json"
