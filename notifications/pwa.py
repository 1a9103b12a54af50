"""The PWA's root files (N2): ``/sw.js`` (a service worker controls only the paths below
its own URL, so it is served from the root) and ``/manifest.webmanifest``. Both public:
they hold no data."""
from django.conf import settings
from django.http import HttpResponse
from django.views.decorators.http import require_safe

_STATIC = settings.BASE_DIR / "static"


def _file(name: str, content_type: str) -> HttpResponse:
    response = HttpResponse((_STATIC / name).read_bytes(), content_type=content_type)
    response["Cache-Control"] = "no-cache"  # a new service worker is picked up at once
    return response


@require_safe
def service_worker(request):
    return _file("sw.js", "text/javascript; charset=utf-8")


@require_safe
def manifest(request):
    return _file("manifest.webmanifest", "application/manifest+json")
