"""RunStead settings, read from the environment (SPEC O1, O2, O4).

With nothing set: the embedded default (SQLite file under ``var/``, in-memory channel
layer, DEBUG on, a generated dev secret kept in ``var/``). ``DATABASE_URL`` and
``REDIS_URL`` switch to PostgreSQL and Redis; ``RUNSTEAD_ENV=production`` turns DEBUG off
and requires ``SECRET_KEY`` and ``ALLOWED_HOSTS``.
"""
import os
import secrets
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("RUNSTEAD_VAR_DIR", BASE_DIR / "var"))


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or default


def env_seconds(name: str, default: float) -> float:
    """A positive duration in seconds (fractions allowed) from the environment."""
    raw = env_str(name)
    if raw is None:
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number of seconds, got {raw!r}")
    if not value > 0:
        raise ImproperlyConfigured(f"{name} must be > 0, got {raw!r}")
    return value


RUNSTEAD_ENV = env_str("RUNSTEAD_ENV", "development")
if RUNSTEAD_ENV not in ("development", "production"):
    raise ImproperlyConfigured("RUNSTEAD_ENV must be 'development' or 'production'")
PRODUCTION = RUNSTEAD_ENV == "production"
DEBUG = not PRODUCTION

if PRODUCTION:
    SECRET_KEY = env_str("SECRET_KEY")
    if not SECRET_KEY:
        raise ImproperlyConfigured("RUNSTEAD_ENV=production requires SECRET_KEY")
    ALLOWED_HOSTS = [h.strip() for h in (env_str("ALLOWED_HOSTS") or "").split(",") if h.strip()]
    if not ALLOWED_HOSTS:
        raise ImproperlyConfigured("RUNSTEAD_ENV=production requires ALLOWED_HOSTS")
else:
    SECRET_KEY = env_str("SECRET_KEY")
    if not SECRET_KEY:
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        key_file = VAR_DIR / "dev_secret_key"
        if not key_file.exists():
            key_file.write_text(secrets.token_urlsafe(50))
        SECRET_KEY = key_file.read_text().strip()
    ALLOWED_HOSTS = [h.strip() for h in (env_str("ALLOWED_HOSTS") or "localhost,127.0.0.1,[::1],testserver").split(",")]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "channels",
    "tasks_app",
    "sessions_app",
    "sessions_app.notifications",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "config.errors.api_responses",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
# No silent slash redirects: a POST to /api/tasks (no slash) is a JSON 404, not a 500 in
# DEBUG or a redirect that drops the body.
APPEND_SLASH = False
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
ASGI_APPLICATION = "config.asgi.application"
WSGI_APPLICATION = None

# --- database -------------------------------------------------------------------------
DATABASE_URL = env_str("DATABASE_URL")
if DATABASE_URL:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0)}
    if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        raise ImproperlyConfigured("DATABASE_URL must be a postgres:// URL")
    # Under ASGI each request runs in its own thread, so persistent connections do not
    # apply; a psycopg pool saves the connection setup per request instead.
    DATABASES["default"]["OPTIONS"] = {"pool": {"min_size": 2, "max_size": int(env_str("RUNSTEAD_DB_POOL_MAX", "40"))}}
    DATABASES["default"]["TEST"] = {"NAME": env_str("RUNSTEAD_TEST_DB_NAME")}
else:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": env_str("RUNSTEAD_SQLITE_PATH", str(VAR_DIR / "db.sqlite3")),
            "OPTIONS": {
                # Writers serialize at BEGIN (P1 on SQLite); 30 s busy timeout (A4).
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
                "init_command": "PRAGMA journal_mode=WAL;PRAGMA synchronous=NORMAL",
            },
            # A file, so threads and a daphne subprocess share the test database.
            "TEST": {"NAME": env_str("RUNSTEAD_TEST_SQLITE_PATH", str(VAR_DIR / "test.sqlite3"))},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- channels -------------------------------------------------------------------------
REDIS_URL = env_str("REDIS_URL")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "config.channel_layer.RetryingRedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL], "prefix": env_str("RUNSTEAD_CHANNEL_PREFIX", "runstead")},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# --- auth, static ---------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = []
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = BASE_DIR / "staticfiles"
WHITENOISE_USE_FINDERS = True  # serve from static/ without collectstatic in the embedded default
DATA_UPLOAD_MAX_MEMORY_SIZE = 256 * 1024  # K3: bodies over this are refused

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tasks_app.auth.MachineAuthentication",
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["tasks_app.auth.IsOwner"],
    "DEFAULT_PAGINATION_CLASS": "config.pagination.StableCursorPagination",
    "EXCEPTION_HANDLER": "config.exception_handler.exception_handler",
    "DEFAULT_PARSER_CLASSES": ["config.errors.StrictJSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}

# --- RunStead timings (seconds, fractions allowed; SPEC O4) ----------------------------
RUNSTEAD_LEASE_DURATION_S = env_seconds("RUNSTEAD_LEASE_DURATION_S", 60)
RUNSTEAD_LEASE_RENEW_S = env_seconds("RUNSTEAD_LEASE_RENEW_S", 15)
RUNSTEAD_LEASE_MARGIN_S = env_seconds("RUNSTEAD_LEASE_MARGIN_S", 5)
RUNSTEAD_KILL_GRACE_S = env_seconds("RUNSTEAD_KILL_GRACE_S", 5)
RUNSTEAD_START_WINDOW_S = env_seconds("RUNSTEAD_START_WINDOW_S", 600)
RUNSTEAD_MARKER_DEFAULT_S = env_seconds("RUNSTEAD_MARKER_DEFAULT_S", 1200)
RUNSTEAD_MARKER_LONG_S = env_seconds("RUNSTEAD_MARKER_LONG_S", 3600)
RUNSTEAD_MARKER_GRACE_S = env_seconds("RUNSTEAD_MARKER_GRACE_S", 60)
RUNSTEAD_JOB_HOLD_MAX_S = env_seconds("RUNSTEAD_JOB_HOLD_MAX_S", 3600)
RUNSTEAD_IDEMPOTENCY_RETENTION_S = env_seconds("RUNSTEAD_IDEMPOTENCY_RETENTION_S", 86400)
RUNSTEAD_MESSAGE_VISIBILITY_S = env_seconds("RUNSTEAD_MESSAGE_VISIBILITY_S", 60)
RUNSTEAD_DEFAULT_BUDGET_S = env_seconds("RUNSTEAD_DEFAULT_BUDGET_S", 36000)
RUNSTEAD_SWEEP_INTERVAL_S = env_seconds("RUNSTEAD_SWEEP_INTERVAL_S", 1)
# D1: one query per process every this many seconds for all waiting long-polls.
RUNSTEAD_LONGPOLL_RECHECK_S = env_seconds("RUNSTEAD_LONGPOLL_RECHECK_S", 5)
RUNSTEAD_MACHINE_OFFLINE_S = env_seconds("RUNSTEAD_MACHINE_OFFLINE_S", 90)
RUNSTEAD_PAIRING_CODE_TTL_S = env_seconds("RUNSTEAD_PAIRING_CODE_TTL_S", 600)
# K3 rate limits (config/throttling.py), "N/period" with period s, min, hour or day: task
# acceptances per owner (a person or a script; a double click is one task anyway, A2) and
# progress reports per machine (G4: at most one a second per running task, 4 tasks).
RUNSTEAD_ACCEPT_RATE = env_str("RUNSTEAD_ACCEPT_RATE", "120/min")
RUNSTEAD_PROGRESS_RATE = env_str("RUNSTEAD_PROGRESS_RATE", "600/min")
# In-process sweep thread inside each daphne process (see tasks_app/apps.py); "0" turns it off.
RUNSTEAD_EMBEDDED_SWEEP = env_str("RUNSTEAD_EMBEDDED_SWEEP", "1") != "0"
# N3: the notification delivery loop inside daphne (off: run `manage.py notify`), its poll interval,
# and the VAPID "sub" claim push services may use to reach the operator.
RUNSTEAD_EMBEDDED_NOTIFY = env_str("RUNSTEAD_EMBEDDED_NOTIFY", "1") != "0"
RUNSTEAD_NOTIFY_INTERVAL_S = env_seconds("RUNSTEAD_NOTIFY_INTERVAL_S", 1)
RUNSTEAD_VAPID_SUBJECT = env_str("RUNSTEAD_VAPID_SUBJECT", "mailto:runstead@localhost")

if RUNSTEAD_LEASE_DURATION_S < 2 * RUNSTEAD_LEASE_RENEW_S + RUNSTEAD_LEASE_MARGIN_S + RUNSTEAD_KILL_GRACE_S:
    # L4: a lease must survive one lost renewal plus margin and kill grace.
    raise ImproperlyConfigured(
        "RUNSTEAD_LEASE_DURATION_S must be >= 2 * RUNSTEAD_LEASE_RENEW_S + "
        "RUNSTEAD_LEASE_MARGIN_S + RUNSTEAD_KILL_GRACE_S (L4)"
    )

SPECTACULAR_SETTINGS = {
    "TITLE": "RunStead API",
    "DESCRIPTION": (
        "Control service for long-running coding-agent tasks. POST /api/tasks/ requires an "
        "Idempotency-Key header; idempotency records are kept until their operation is final "
        f"plus a retention window of {int(RUNSTEAD_IDEMPOTENCY_RETENTION_S)} seconds (A7)."
    ),
    "VERSION": "1.0.0",
    "ENUM_NAME_OVERRIDES": {
        "MarkerStateEnum": "sessions_app.models.MarkerState",
        "TaskStateEnum": "tasks_app.models.TaskState",
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"runstead": {"handlers": ["console"], "level": env_str("RUNSTEAD_LOG_LEVEL", "INFO")}},
}

# --- production behind a TLS proxy (SPEC D3; deploy/) -----------------------------------
if PRODUCTION:
    # The proxy (deploy/Caddyfile) terminates TLS and says so in X-Forwarded-Proto.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env_str("RUNSTEAD_SSL_REDIRECT", "1") != "0"
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    # HSTS: a year by default; RUNSTEAD_HSTS_SECONDS=0 turns it off (e.g. while trying a
    # new domain). Subdomains and preload are opt-in: both commit more than this host.
    SECURE_HSTS_SECONDS = int(env_seconds("RUNSTEAD_HSTS_SECONDS", 31536000)) if env_str("RUNSTEAD_HSTS_SECONDS") != "0" else 0
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_str("RUNSTEAD_HSTS_INCLUDE_SUBDOMAINS", "0") == "1"
    SECURE_HSTS_PRELOAD = env_str("RUNSTEAD_HSTS_PRELOAD", "0") == "1"
    # Origins allowed to POST forms (admin, board): https:// on every allowed host unless set.
    CSRF_TRUSTED_ORIGINS = [
        o.strip() for o in (env_str("CSRF_TRUSTED_ORIGINS") or ",".join(
            f"https://{h.lstrip('.')}" for h in ALLOWED_HOSTS if h != "*")).split(",") if o.strip()
    ]
    # What the operator chose with the variables above is not a deploy warning.
    SILENCED_SYSTEM_CHECKS = [
        *([] if SECURE_HSTS_SECONDS else ["security.W004"]),
        *([] if SECURE_HSTS_INCLUDE_SUBDOMAINS else ["security.W005"]),
        *([] if SECURE_HSTS_PRELOAD else ["security.W021"]),
        *([] if SECURE_SSL_REDIRECT else ["security.W008"]),
    ]
