"""Sessions API routes, included under ``/api/`` (SPEC H)."""
from django.urls import path

from sessions_app.api import approvals, views

urlpatterns = [
    path("sessions/", views.SessionListView.as_view(), name="sessions"),
    path("sessions/active/", views.ActiveSessionsView.as_view(), name="sessions-active"),
    path("sessions/<uuid:session_id>/", views.SessionDetailView.as_view(), name="session"),
    path("sessions/<uuid:session_id>/marker/", views.MarkerView.as_view(), name="session-marker"),
    path("sessions/<uuid:session_id>/jobs/", views.JobListView.as_view(), name="session-jobs"),
    path(
        "sessions/<uuid:session_id>/jobs/<str:job_id>/finish/", views.JobFinishView.as_view(), name="session-job-finish"
    ),
    path("sessions/<uuid:session_id>/messages/", views.SessionMessagesView.as_view(), name="session-messages"),
    path("sessions/<uuid:session_id>/messages/<int:seq>/delivery/", views.SessionMessageDeliveryView.as_view(),
         name="session-message-delivery"),
    path("sessions/<uuid:session_id>/messages/<int:seq>/withdraw/", views.SessionMessageWithdrawView.as_view(),
         name="session-message-withdraw"),
    path("sessions/<uuid:session_id>/interrupt/", views.SessionInterruptView.as_view(), name="session-interrupt"),
    path("sessions/<uuid:session_id>/stop/", views.SessionStopView.as_view(), name="session-stop"),
    path("devices/<str:device_id>/sweep/", views.DeviceSweepView.as_view(), name="device-sweep"),
    path("approvals/", approvals.ApprovalListCreate.as_view(), name="approvals"),
    path("approvals/<uuid:approval_id>/", approvals.ApprovalDetail.as_view(), name="approval"),
    path("approvals/<uuid:approval_id>/decision/", approvals.ApprovalDecision.as_view(), name="approval-decision"),
    path("approvals/<uuid:approval_id>/terminal/", approvals.ApprovalTerminal.as_view(), name="approval-terminal"),
]
