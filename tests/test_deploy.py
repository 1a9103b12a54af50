"""D3: production settings behind TLS pass ``manage.py check --deploy`` with nothing
reported, and deploy/ holds the production shape (compose file and systemd units)."""
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import yaml
import pytest

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

BASE_DIR = Path(__file__).resolve().parent.parent
PRODUCTION_ENV = {"RUNSTEAD_ENV": "production", "ALLOWED_HOSTS": "runstead.example.com", "DATABASE_URL": "",
                  "REDIS_URL": ""}


def _production(argv, **env):
    full = {**os.environ, **PRODUCTION_ENV, "SECRET_KEY": secrets.token_urlsafe(50), **env}
    return subprocess.run([sys.executable, *argv], cwd=BASE_DIR, env=full, capture_output=True, text=True, timeout=120)


def test_d3_check_deploy_in_production_reports_nothing():
    out = _production(["manage.py", "check", "--deploy", "--fail-level", "DEBUG"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("System check identified no issues"), out.stdout + out.stderr
    assert "WARNINGS" not in out.stderr


def test_d3_production_settings_trust_the_tls_proxy_and_secure_cookies():
    code = ("import django, json; django.setup(); from django.conf import settings as s; print(json.dumps({"
            "'proxy': s.SECURE_PROXY_SSL_HEADER, 'session': s.SESSION_COOKIE_SECURE, 'csrf': s.CSRF_COOKIE_SECURE,"
            "'hsts': s.SECURE_HSTS_SECONDS, 'origins': s.CSRF_TRUSTED_ORIGINS, 'redirect': s.SECURE_SSL_REDIRECT,"
            "'debug': s.DEBUG}))")
    default = json.loads(_production(["-c", code], DJANGO_SETTINGS_MODULE="config.settings").stdout)
    assert default == {"proxy": ["HTTP_X_FORWARDED_PROTO", "https"], "session": True, "csrf": True, "hsts": 31536000,
                       "origins": ["https://runstead.example.com"], "redirect": True, "debug": False}
    tuned = json.loads(_production(["-c", code], DJANGO_SETTINGS_MODULE="config.settings", RUNSTEAD_HSTS_SECONDS="0",
                                   CSRF_TRUSTED_ORIGINS="https://a.example,https://b.example").stdout)
    assert tuned["hsts"] == 0
    assert tuned["origins"] == ["https://a.example", "https://b.example"]
    assert _production(["manage.py", "check", "--deploy", "--fail-level", "DEBUG"], RUNSTEAD_HSTS_SECONDS="0").returncode == 0


def test_d3_deploy_ships_postgres_redis_service_processes_one_sweep_and_a_tls_proxy():
    compose = yaml.safe_load((BASE_DIR / "deploy" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "api", "ws", "sweep", "proxy"} <= set(services)
    assert services["api"]["command"][:2] == ["gunicorn", "config.wsgi:application"]
    assert services["ws"]["command"][0] == "daphne" and "config.asgi:application" in services["ws"]["command"]
    assert services["sweep"]["command"] == ["python", "manage.py", "sweep"]
    assert services["proxy"]["image"].startswith("caddy")
    caddy = (BASE_DIR / "deploy" / "Caddyfile").read_text()
    assert "@daphne path /ws/* /api/worker/messages/ /api/approvals/*" in caddy  # config.asgi.LONG_POLL_VIEWS
    units = {p.name: p.read_text() for p in (BASE_DIR / "deploy" / "systemd").glob("*.service")}
    assert set(units) == {"runstead-api.service", "runstead-ws.service", "runstead-sweep.service", "runstead-proxy.service"}
    assert "gunicorn config.wsgi:application" in units["runstead-api.service"]
    assert "daphne -b 127.0.0.1 -p 8001" in units["runstead-ws.service"]
    assert "manage.py sweep" in units["runstead-sweep.service"]
