"""Settings from the environment (SPEC O1-O4, L4), checked in fresh interpreters."""
import os
import subprocess
import sys

import pytest
from django.conf import settings
from django.db import connection

from tests.live import BASE_DIR

PROBE = "import django; django.setup(); from django.conf import settings as s; print(s.DEBUG, s.RUNSTEAD_LEASE_RENEW_S, s.DATABASES['default']['ENGINE'], s.CHANNEL_LAYERS['default']['BACKEND'])"


def probe(**env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNSTEAD_") and k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ALLOWED_HOSTS")}
    clean.update(DJANGO_SETTINGS_MODULE="config.settings", RUNSTEAD_VAR_DIR=str(BASE_DIR / "var"), **env)
    return subprocess.run([sys.executable, "-c", PROBE], cwd=BASE_DIR, env=clean, capture_output=True, text=True)


@pytest.mark.backend_independent  # a fresh interpreter, its environment cleaned of both URLs
def test_o1_embedded_default_is_sqlite_in_memory_layer_debug():
    result = probe()
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "15.0", "django.db.backends.sqlite3", "channels.layers.InMemoryChannelLayer"]


@pytest.mark.backend_independent  # a fresh interpreter, its environment cleaned of both URLs
def test_o2_database_and_redis_urls_switch_backends():
    result = probe(DATABASE_URL="postgresql://u:p@127.0.0.1:5432/x", REDIS_URL="redis://127.0.0.1:6390/0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[2:] == ["django.db.backends.postgresql", "config.channel_layer.RetryingRedisChannelLayer"]


@pytest.mark.backend_independent  # a fresh interpreter, its environment cleaned of both URLs
def test_o4_production_requires_secret_key_and_allowed_hosts():
    missing = probe(RUNSTEAD_ENV="production")
    assert missing.returncode != 0 and "requires SECRET_KEY" in missing.stderr
    no_hosts = probe(RUNSTEAD_ENV="production", SECRET_KEY="x" * 50)
    assert no_hosts.returncode != 0 and "requires ALLOWED_HOSTS" in no_hosts.stderr
    ok = probe(RUNSTEAD_ENV="production", SECRET_KEY="x" * 50, ALLOWED_HOSTS="runstead.example")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split()[0] == "False"


@pytest.mark.backend_independent  # a fresh interpreter, its environment cleaned of both URLs
def test_o4_l4_timings_accept_fractions_and_refuse_unsafe_lease():
    fractional = probe(RUNSTEAD_LEASE_DURATION_S="3", RUNSTEAD_LEASE_RENEW_S="0.5", RUNSTEAD_LEASE_MARGIN_S="0.5", RUNSTEAD_KILL_GRACE_S="0.5")
    assert fractional.returncode == 0, fractional.stderr
    assert fractional.stdout.split()[1] == "0.5"
    unsafe = probe(RUNSTEAD_LEASE_DURATION_S="10", RUNSTEAD_LEASE_RENEW_S="4")  # 10 < 2*4 + 5 + 5
    assert unsafe.returncode != 0 and "RUNSTEAD_LEASE_DURATION_S must be" in unsafe.stderr
    garbage = probe(RUNSTEAD_LEASE_RENEW_S="soon")
    assert garbage.returncode != 0 and "must be a number of seconds" in garbage.stderr


@pytest.mark.postgres
@pytest.mark.django_db
def test_o3_postgres_pass_runs_on_postgresql_and_redis():
    assert connection.vendor == "postgresql"
    assert settings.CHANNEL_LAYERS["default"]["BACKEND"] == "config.channel_layer.RetryingRedisChannelLayer"
    from channels_redis.core import RedisChannelLayer
    from django.utils.module_loading import import_string

    assert issubclass(import_string(settings.CHANNEL_LAYERS["default"]["BACKEND"]), RedisChannelLayer)  # channels_redis underneath (FACTS)


# --- on/off settings: one strict parser (config.settings.env_flag) ------------------------

FLAGS = {  # environment variable -> the setting it decides (production: all five exist)
    "RUNSTEAD_EMBEDDED_SWEEP": "RUNSTEAD_EMBEDDED_SWEEP",
    "RUNSTEAD_EMBEDDED_NOTIFY": "RUNSTEAD_EMBEDDED_NOTIFY",
    "RUNSTEAD_SSL_REDIRECT": "SECURE_SSL_REDIRECT",
    "RUNSTEAD_HSTS_INCLUDE_SUBDOMAINS": "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "RUNSTEAD_HSTS_PRELOAD": "SECURE_HSTS_PRELOAD",
}
PRODUCTION = {"RUNSTEAD_ENV": "production", "SECRET_KEY": "x" * 50, "ALLOWED_HOSTS": "runstead.example"}

# One interpreter evaluates config/settings.py once per case (a reload), so the whole
# table costs one start-up: each case prints its flags, or the ImproperlyConfigured text.
RELOAD = """
import importlib, json, os, sys
from django.core.exceptions import ImproperlyConfigured
flags = json.loads(sys.argv[1])
for case in json.loads(sys.argv[2]):
    os.environ.update(case)
    try:
        import config.settings as s
        s = importlib.reload(s)
        print(json.dumps({name: getattr(s, setting) for name, setting in flags.items()}))
    except ImproperlyConfigured as error:
        print(json.dumps(str(error)))
    for name in case:
        del os.environ[name]
"""


def settings_cases(cases: list[dict]) -> list:
    import json

    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNSTEAD_") and k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ALLOWED_HOSTS")}
    clean.update(RUNSTEAD_VAR_DIR=str(BASE_DIR / "var"), **PRODUCTION)
    result = subprocess.run([sys.executable, "-c", RELOAD, json.dumps(FLAGS), json.dumps(cases)], cwd=BASE_DIR,
                            env=clean, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.backend_independent  # a fresh interpreter, its environment cleaned of both URLs
def test_o4_on_off_settings_take_exactly_1_true_0_false():
    """Every on/off setting reads ``1``/``true`` as on and ``0``/``false`` as off; unset
    or empty keeps its default. (``RUNSTEAD_EMBEDDED_SWEEP=false`` used to leave the
    sweep on.)"""
    defaults = {"RUNSTEAD_EMBEDDED_SWEEP": True, "RUNSTEAD_EMBEDDED_NOTIFY": True, "RUNSTEAD_SSL_REDIRECT": True,
                "RUNSTEAD_HSTS_INCLUDE_SUBDOMAINS": False, "RUNSTEAD_HSTS_PRELOAD": False}
    values = {"1": True, "true": True, "0": False, "false": False}
    cases = [{}, {name: "" for name in FLAGS}] + [{name: raw for name in FLAGS} for raw in values]
    assert settings_cases(cases) == [defaults, defaults] + [{name: on for name in FLAGS} for on in values.values()]


@pytest.mark.backend_independent  # a fresh interpreter, its environment cleaned of both URLs
def test_o4_on_off_settings_refuse_other_values_naming_the_variable():
    refused = ["off", "no", "yes", "on", "True", "FALSE", "2", " 0x"]
    answers = settings_cases([{name: raw} for raw in refused for name in FLAGS])
    assert answers == [f"{name} must be 1, 0, true or false, got {raw.strip()!r}" for raw in refused for name in FLAGS]


# --- README lists every setting read -------------------------------------------------------

# RUNSTEAD_* names in the source that are not settings: the worker gives them to its agents.
NOT_SETTINGS = {"RUNSTEAD_OPERATION_ID", "RUNSTEAD_TASK_ID", "RUNSTEAD_TASK_CREDENTIAL", "RUNSTEAD_TASK_SERVER",
                "RUNSTEAD_TASK_HOOK_DIR"}


def runstead_names_in_source() -> set[str]:
    """Every string literal that is a whole ``RUNSTEAD_*`` name in the service, worker and
    hooks code (tests and bench excluded): what they read from the environment."""
    import ast
    import re

    name = re.compile(r"RUNSTEAD_[A-Z0-9_]*[A-Z0-9]")
    found = set()
    for package in ("machine", "core", "tasks_app", "notifications", "sessions_app", "board", "config"):
        for path in (BASE_DIR / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and name.fullmatch(node.value):
                    found.add(node.value)
    return found


def readme_settings() -> dict[str, str]:
    """README's "Settings (environment)" tables: name -> its default cell."""
    import re

    text = (BASE_DIR / "README.md").read_text()
    section = text.split("## Settings (environment)\n", 1)[1].split("\n## ", 1)[0]
    return {m[1]: m[2].strip() for m in re.finditer(r"^\| `([A-Z0-9_]+)` \|([^|]*)\|", section, re.M)}


@pytest.mark.backend_independent  # reads the source and README
def test_o4_readme_lists_every_setting_read_with_its_default():
    in_source = runstead_names_in_source()
    # The guard reads the real tree: settings, worker and hooks names are all seen.
    assert {"RUNSTEAD_EMBEDDED_NOTIFY", "RUNSTEAD_WORKER_POLL_S", "RUNSTEAD_HOOK_DIR"} <= in_source
    assert NOT_SETTINGS <= in_source  # the exclusions are real names, not stale ones
    documented = readme_settings()
    assert sorted(in_source - NOT_SETTINGS - set(documented)) == []
    assert sorted(name for name, default in documented.items() if not default) == []
    assert sorted(name for name in documented if name.startswith("RUNSTEAD_") and name not in in_source) == []
