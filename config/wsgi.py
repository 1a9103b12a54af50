"""WSGI entry point: the HTTP API and pages under gunicorn (the production shape of
``/api/``, SPEC D3; ``deploy/``). WebSockets and the worker long-poll stay on daphne."""
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

application = get_wsgi_application()
