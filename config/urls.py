from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from core.schema import SchemaView
from notifications import pwa
from sessions_app import pages as session_pages
from tasks_app import pages

urlpatterns = [
    path("admin", RedirectView.as_view(url="/admin/")),
    path("admin/", admin.site.urls),
    path("accounts/", include("django.contrib.auth.urls")),
    path("api/schema/", SchemaView.as_view(), name="schema"),
    path("api/", include("tasks_app.api.urls")),
    path("api/", include("sessions_app.api.urls")),
    path("api/", include("notifications.urls")),
    path("sw.js", pwa.service_worker, name="service-worker"),
    path("manifest.webmanifest", pwa.manifest, name="manifest"),
    path("tasks/<uuid:task_id>/", pages.task_page, name="task-page"),
    path("tasks/<uuid:task_id>/data/", pages.task_page_data, name="task-page-data"),
    path("tasks/<uuid:task_id>/decide/", pages.task_decide_page, name="task-decide"),
    path("sessions/<uuid:session_id>/", session_pages.session_page, name="session-page"),
    path("", include("board.urls")),
]
