"""Notification routes, included under ``/api/`` (SPEC H); the PWA files at the root."""
from django.urls import path

from notifications import api

urlpatterns = [
    path("notifications/settings/", api.NotificationSettingsView.as_view(), name="notification-settings"),
    path("push/subscriptions/", api.PushSubscriptionListView.as_view(), name="push-subscriptions"),
    path("push/subscriptions/<uuid:subscription_id>/", api.PushSubscriptionDetailView.as_view(), name="push-subscription"),
    path("push/vapid-public-key/", api.VapidPublicKeyView.as_view(), name="push-vapid-key"),
]
