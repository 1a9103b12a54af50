"""RunStead settings, read from the environment (SPEC O1, O2, O4).

With nothing set: the embedded default (SQLite file under ``var/``, in-memory channel
layer, DEBUG on, a generated dev secret kept in ``var/``). ``DATABASE_URL`` and
``REDIS_URL`` switch to PostgreSQL and Redis; ``RUNSTEAD_ENV=production`` turns DEBUG off
and requires ``SECRET_KEY`` and ``ALLOWED_HOSTS``. Every value goes through a strict
helper (``env_seconds``, ``env_flag``) that raises ``ImproperlyConfigured`` naming the
variable; README's "Settings (environment)" lists each with its default.
"""
import os
import secrets
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from machine.protocol import LONG_POLL_KEEPALIVE_S, RECEIPT_MAX_BYTES

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


FLAG_VALUES = {"1": True, "true": True, "0": False, "false": False}


def env_flag(name: str, default: bool) -> bool:
    """An on/off setting: exactly ``1`` or ``true`` (on), ``0`` or ``false`` (off); unset
    or empty gives ``default``. Anything else (``yes``, ``off``, ``True``, ``2``) raises
    ``ImproperlyConfigured`` naming the variable, so a typo never leaves a loop running."""
    raw = env_str(name)
    if raw is None:
        return default
    if raw not in FLAG_VALUES:
        raise ImproperlyConfigured(f"{name} must be 1, 0, true or false, got {raw!r}")
    return FLAG_VALUES[raw]


def env_cidrs(name: str) -> list[str]:
    """Comma-separated networks in CIDR form (``127.0.0.0/8,::1/128``; a bare address is
    one host) from the environment; empty or unset -> ``[]``. A network with host bits
    set (``127.0.0.1/8``) is refused as a likely typo."""
    import ipaddress

    networks = []
    for part in (env_str(name) or "").split(","):
        if part.strip():
            try:
                networks.append(str(ipaddress.ip_network(part.strip())))
            except ValueError as exc:
                raise ImproperlyConfigured(f"{name}: {part.strip()!r} is not a network in CIDR form ({exc})")
    return networks


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
    "notifications",
    "board",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "core.bodies.body_limits",
    "core.errors.api_responses",
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
    # A request that waits longer than RUNSTEAD_DB_POOL_TIMEOUT_S for a connection is
    # answered 503 ``service_busy`` with Retry-After (core/exception_handler.py).
    _POOL_MAX = int(env_str("RUNSTEAD_DB_POOL_MAX", "40"))
    DATABASES["default"]["OPTIONS"] = {"pool": {"min_size": min(2, _POOL_MAX), "max_size": _POOL_MAX,
                                                "timeout": env_seconds("RUNSTEAD_DB_POOL_TIMEOUT_S", 30)}}
    # With a pool, Django passes this on as the pool's ``check``: a connection is tested
    # (one empty query) before it is handed out, so one PostgreSQL closed (restart,
    # pg_terminate_backend) is replaced instead of failing the request that gets it.
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
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
            # No client-side socket timeout, as before redis-py 8 (which made it 5 s): a
            # quiet channel's blocking receive (BZPOPMIN, 5 s) failed on it every ~11 s, so
            # the board closed its sockets and the long-poll joined every group again
            # (redis/redis-py#4091); and with a timeout each command is sent through
            # asyncio.wait_for, which on Python 3.11 loses a cancellation that lands as the
            # send completes (CPython gh-86296): a cancelled receive then never ended.
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": None}],
                       "prefix": env_str("RUNSTEAD_CHANNEL_PREFIX", "runstead")},
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
# ...except on these routes, read by core.bodies up to their own limit: a final receipt
# carries a worktree task's diff (G7).
RUNSTEAD_BODY_LIMITS = {"/api/worker/receipts/": RECEIPT_MAX_BYTES}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # The first names the scheme of a 401's WWW-Authenticate: an owner's, but on the
        # worker's endpoints (tasks_app.api.views.MachineView).
        "tasks_app.auth.OwnerTokenAuthentication",
        "tasks_app.auth.MachineAuthentication",
        "tasks_app.auth.TaskCredentialAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["tasks_app.auth.IsOwner"],
    "DEFAULT_PAGINATION_CLASS": "core.pagination.StableCursorPagination",
    "EXCEPTION_HANDLER": "core.exception_handler.exception_handler",
    "DEFAULT_PARSER_CLASSES": ["core.errors.StrictJSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}

# --- RunStead timings (seconds, fractions allowed; SPEC O4) ----------------------------
RUNSTEAD_LEASE_DURATION_S = env_seconds("RUNSTEAD_LEASE_DURATION_S", 60)
RUNSTEAD_LEASE_RENEW_S = env_seconds("RUNSTEAD_LEASE_RENEW_S", 15)
RUNSTEAD_LEASE_MARGIN_S = env_seconds("RUNSTEAD_LEASE_MARGIN_S", 5)
RUNSTEAD_KILL_GRACE_S = env_seconds("RUNSTEAD_KILL_GRACE_S", 5)
RUNSTEAD_START_WINDOW_S = env_seconds("RUNSTEAD_START_WINDOW_S", 600)
# N1, U2: how long an ``unknown`` task waits for the worker's report to its query before
# its owner is asked to decide.
RUNSTEAD_UNKNOWN_ASK_S = env_seconds("RUNSTEAD_UNKNOWN_ASK_S", 120)
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
# D1: a waiting long-poll sends a space this often (seconds) so a half-open pull is seen.
RUNSTEAD_LONGPOLL_KEEPALIVE_S = env_seconds("RUNSTEAD_LONGPOLL_KEEPALIVE_S", LONG_POLL_KEEPALIVE_S)
# D1, D2: long-poll starts (the view and the first take) at once per daphne process; the
# rest of a wave of pull starts queues behind them, not in front of the API (core/longpoll/).
RUNSTEAD_LONGPOLL_START_SLOTS = max(1, int(env_str("RUNSTEAD_LONGPOLL_START_SLOTS", "2")))
# D1: the pull starts of an event loop are checked together (one transaction) at most this
# often (seconds); a start after a quiet spell is checked at once (core/longpoll/).
RUNSTEAD_LONGPOLL_START_BATCH_S = env_seconds("RUNSTEAD_LONGPOLL_START_BATCH_S", 0.25)
# D2, issue 44: HTTP requests in Django's handler at once per daphne event loop; the rest
# wait on the event loop, a machine's lease renewals first, and one that waited
# RUNSTEAD_REQUEST_QUEUE_S seconds is answered 503 service_busy (core/admission.py).
RUNSTEAD_REQUEST_SLOTS = max(1, int(env_str("RUNSTEAD_REQUEST_SLOTS", "8")))
RUNSTEAD_REQUEST_QUEUE_S = env_seconds("RUNSTEAD_REQUEST_QUEUE_S", 30)
# D1: the listen backlog of daphne's TCP sockets (config/server_hooks.py): 1,000 workers
# reconnecting at once after a restart are queued by the kernel, not dropped (Twisted's
# default, 50, drops the rest, and each retries its SYN a second or more later).
RUNSTEAD_LISTEN_BACKLOG = max(1, int(env_str("RUNSTEAD_LISTEN_BACKLOG", "4096")))
# K1: a process trusts the shared machine-token counter it read this long (seconds) before
# it reads it again (tasks_app.auth.MachineTokenCache): a token revoked on another process
# is refused here within this, under the 1 s; on the revoking process at once.
RUNSTEAD_TOKEN_EPOCH_FRESH_S = env_seconds("RUNSTEAD_TOKEN_EPOCH_FRESH_S", 0.25)
RUNSTEAD_MACHINE_OFFLINE_S = env_seconds("RUNSTEAD_MACHINE_OFFLINE_S", 90)
RUNSTEAD_PAIRING_CODE_TTL_S = env_seconds("RUNSTEAD_PAIRING_CODE_TTL_S", 600)
# K3 rate limits (core/throttling.py), "N/period" with period s, min, hour or day: task
# acceptances per owner (a person or a script; a double click is one task anyway, A2) and
# progress reports per machine (G4: at most one a second per running task, 4 tasks).
RUNSTEAD_ACCEPT_RATE = env_str("RUNSTEAD_ACCEPT_RATE", "120/min")
RUNSTEAD_PROGRESS_RATE = env_str("RUNSTEAD_PROGRESS_RATE", "600/min")
# Q7/K3: approvals created per session or task (an agent asks a few times a minute at most).
RUNSTEAD_APPROVAL_RATE = env_str("RUNSTEAD_APPROVAL_RATE", "60/min")
# Q1/Q3: a pending approval expires this long after it was asked (decided_by "timeout").
RUNSTEAD_APPROVAL_WAIT_S = env_seconds("RUNSTEAD_APPROVAL_WAIT_S", 600)
# C5: a live conversation with no message for this long ends by itself (its input closed);
# C7: the largest message into a conversation, in bytes of UTF-8.
RUNSTEAD_CONVERSATION_IDLE_S = env_seconds("RUNSTEAD_CONVERSATION_IDLE_S", 1800)
RUNSTEAD_MESSAGE_MAX_BYTES = int(os.environ.get("RUNSTEAD_MESSAGE_MAX_BYTES", "32768"))
# K3: board WebSocket handshakes per owner and per client address, per process (a brake
# against a reconnect loop or a flood; a board reconnects once per network change).
RUNSTEAD_WS_OWNER_RATE = env_str("RUNSTEAD_WS_OWNER_RATE", "30/min")
RUNSTEAD_WS_ADDRESS_RATE = env_str("RUNSTEAD_WS_ADDRESS_RATE", "120/min")
# The periodic sweep on each daphne process's event loop (config/server_hooks.py); off: run
# `manage.py sweep` as its own process.
RUNSTEAD_EMBEDDED_SWEEP = env_flag("RUNSTEAD_EMBEDDED_SWEEP", True)
# N3: the notification delivery loop inside daphne (off: run `manage.py notify`), its poll interval,
# and the VAPID "sub" claim push services may use to reach the operator.
RUNSTEAD_EMBEDDED_NOTIFY = env_flag("RUNSTEAD_EMBEDDED_NOTIFY", True)
RUNSTEAD_NOTIFY_INTERVAL_S = env_seconds("RUNSTEAD_NOTIFY_INTERVAL_S", 1)
RUNSTEAD_VAPID_SUBJECT = env_str("RUNSTEAD_VAPID_SUBJECT", "mailto:runstead@localhost")
# K5: networks that webhooks and Web Push may reach although not public (empty: none).
RUNSTEAD_OUTBOUND_ALLOW = env_cidrs("RUNSTEAD_OUTBOUND_ALLOW")

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
        "IntegrationOutcomeEnum": "tasks_app.models.IntegrationOutcome",
        "ApprovalStateEnum": "sessions_app.models.ApprovalState",
        "SessionAttentionEnum": "sessions_app.models.Attention",
        "SessionStatusEnum": "sessions_app.models.SessionStatus",
        "AppliedOutcomeEnum": ["applied", "not_applied"],
        "TaskModeEnum": ["task", "conversation"],  # C1
        "JobModeEnum": "sessions_app.models.JobMode",
        "ProfileConversationEnum": ["live", "resume", "none"],  # C1: what a profile can do
        "TaskConversationEnum": ["live", "resume"],  # C1: what a conversation task does
        "SessionMessageStateEnum": "sessions_app.models.SessionMessageState",  # T2
        "MessageDeliveryEnum": ["queue", "steer"],  # C9
        "SessionMessageReportEnum": ["delivered", "answered", "undelivered"],  # T2-T4: what a machine reports
        "SessionChannelEnum": "sessions_app.models.Channel",  # T1
    },
    # The board events as components (board/schema.py), before the enums are named so
    # theirs are named too.
    "POSTPROCESSING_HOOKS": ["board.schema.board_events", "core.schema.closed_union_members",
                             "drf_spectacular.hooks.postprocess_schema_enums"],
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
    SECURE_SSL_REDIRECT = env_flag("RUNSTEAD_SSL_REDIRECT", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    # HSTS: a year by default; RUNSTEAD_HSTS_SECONDS=0 turns it off (e.g. while trying a
    # new domain). Subdomains and preload are opt-in: both commit more than this host.
    SECURE_HSTS_SECONDS = int(env_seconds("RUNSTEAD_HSTS_SECONDS", 31536000)) if env_str("RUNSTEAD_HSTS_SECONDS") != "0" else 0
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_flag("RUNSTEAD_HSTS_INCLUDE_SUBDOMAINS", False)
    SECURE_HSTS_PRELOAD = env_flag("RUNSTEAD_HSTS_PRELOAD", False)
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
