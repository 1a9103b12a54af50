"""Notification API (SPEC H, N1, N2): settings, push subscriptions, the VAPID public key.
Views parse with strict serializers (K3), call one service, render."""
from django.core.validators import URLValidator
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from config import clock
from sessions_app.notifications import services
from sessions_app.notifications.models import KIND_NAMES
from config.schema import errors
from config.strict import EmptyBody, NoQuery, StrictSerializer, valid_body, valid_query

ENDPOINT_MAX = 2000
HTTP_URL = URLValidator(schemes=["http", "https"])


class KindsSerializer(StrictSerializer):
    session_idle = serializers.BooleanField()
    attention = serializers.BooleanField()
    unknown = serializers.BooleanField()
    task_succeeded = serializers.BooleanField()
    task_failed = serializers.BooleanField()


class SettingsSerializer(StrictSerializer):
    """``PUT`` body: the whole settings document (every field required)."""

    kinds = KindsSerializer()
    webhook_url = serializers.URLField(max_length=ENDPOINT_MAX, allow_null=True, validators=[HTTP_URL])
    board = serializers.BooleanField()
    push = serializers.BooleanField()


class SubscriptionKeysSerializer(StrictSerializer):
    p256dh = serializers.CharField(max_length=200)
    auth = serializers.CharField(max_length=100)


class SubscriptionSerializer(StrictSerializer):
    """``PushSubscription.toJSON()`` as a browser gives it."""

    endpoint = serializers.URLField(max_length=ENDPOINT_MAX, validators=[HTTP_URL])
    expirationTime = serializers.IntegerField(required=False, allow_null=True)  # noqa: N815 - the browser's name
    keys = SubscriptionKeysSerializer()


_SETTINGS_SHAPE = inline_serializer(
    "NotificationSettings",
    {
        "kinds": inline_serializer("NotificationKinds", {k: serializers.BooleanField() for k in KIND_NAMES}),
        "webhook_url": serializers.URLField(allow_null=True),
        "board": serializers.BooleanField(),
        "push": serializers.BooleanField(),
        "webhook_secret": serializers.CharField(required=False, help_text="only in the answer to a PUT that set a new webhook_url"),
    },
)
_SUBSCRIPTION_SHAPE = inline_serializer(
    "PushSubscription",
    {"id": serializers.UUIDField(), "endpoint": serializers.URLField(), "created_at": serializers.DateTimeField()},
)


class NotificationSettingsView(APIView):
    """``GET``/``PUT /api/notifications/settings/``: the requesting owner's settings (N1)."""

    @extend_schema(responses={200: _SETTINGS_SHAPE, **errors()}, summary="Notification settings (N1)")
    def get(self, request):
        valid_query(NoQuery, request)
        return Response(services.settings_dict(services.settings_get(owner=request.user)))

    @extend_schema(request=SettingsSerializer, responses={200: _SETTINGS_SHAPE, **errors()}, summary="Replace notification settings (N1)")
    def put(self, request):
        valid_query(NoQuery, request)
        data = valid_body(SettingsSerializer, request)
        row, secret = services.settings_update(
            owner=request.user, kinds=data["kinds"], webhook_url=data["webhook_url"], board=data["board"],
            push=data["push"], now=clock.now(),
        )
        body = services.settings_dict(row)
        if secret is not None:
            body["webhook_secret"] = secret
        return Response(body)


class PushSubscriptionListView(APIView):
    """``POST /api/push/subscriptions/``: store a browser's subscription (N2); 201 new,
    200 when the endpoint was known (keys updated)."""

    @extend_schema(request=SubscriptionSerializer, responses={201: _SUBSCRIPTION_SHAPE, 200: _SUBSCRIPTION_SHAPE, **errors()})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(SubscriptionSerializer, request)
        sub, created = services.subscription_create(
            owner=request.user, endpoint=data["endpoint"], p256dh=data["keys"]["p256dh"], auth=data["keys"]["auth"],
            now=clock.now(),
        )
        return Response(services.subscription_dict(sub), status=201 if created else 200)


class PushSubscriptionDetailView(APIView):
    """``DELETE /api/push/subscriptions/{id}/``: 204; another owner's id is a 404 (K2)."""

    @extend_schema(request=EmptyBody, responses={204: None, **errors()})
    def delete(self, request, subscription_id):
        valid_query(NoQuery, request)
        valid_body(EmptyBody, request)
        services.subscription_delete(owner=request.user, subscription_id=subscription_id)
        return Response(status=204)


class VapidPublicKeyView(APIView):
    """``GET /api/push/vapid-public-key/``: ``{"public_key"}`` (base64url), the
    ``applicationServerKey`` for ``pushManager.subscribe``."""

    @extend_schema(responses={200: inline_serializer("VapidPublicKey", {"public_key": serializers.CharField()}), **errors()})
    def get(self, request):
        valid_query(NoQuery, request)
        return Response({"public_key": services.vapid_key().public_key})
