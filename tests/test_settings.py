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


def test_o1_embedded_default_is_sqlite_in_memory_layer_debug():
    result = probe()
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "15.0", "django.db.backends.sqlite3", "channels.layers.InMemoryChannelLayer"]


def test_o2_database_and_redis_urls_switch_backends():
    result = probe(DATABASE_URL="postgresql://u:p@127.0.0.1:5432/x", REDIS_URL="redis://127.0.0.1:6390/0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[2:] == ["django.db.backends.postgresql", "config.channel_layer.RetryingRedisChannelLayer"]


def test_o4_production_requires_secret_key_and_allowed_hosts():
    missing = probe(RUNSTEAD_ENV="production")
    assert missing.returncode != 0 and "requires SECRET_KEY" in missing.stderr
    no_hosts = probe(RUNSTEAD_ENV="production", SECRET_KEY="x" * 50)
    assert no_hosts.returncode != 0 and "requires ALLOWED_HOSTS" in no_hosts.stderr
    ok = probe(RUNSTEAD_ENV="production", SECRET_KEY="x" * 50, ALLOWED_HOSTS="runstead.example")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split()[0] == "False"


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
