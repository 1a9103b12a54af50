"""Notification API (SPEC H, N1, N2): settings, push subscriptions, the VAPID public key.
Views parse with strict serializers (K3), call one service, render."""
from django.core.validators import URLValidator
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core import clock
from notifications import outbound, services
from notifications.shapes import (
    NotificationSettingsShape,
    PushSubscriptionShape,
    VapidPublicKeyShape,
    settings_dict,
    subscription_dict,
)
from core.schema import errors, shape
from core.strict import EmptyBody, NoQuery, StrictSerializer, valid_body, valid_query

ENDPOINT_MAX = 2000


class OutboundURLField(serializers.URLField):
    """An ``http``/``https`` URL with a host, for a request the service will send (K3's
    shape only). Any host spelling passes here (``2130706433``, ``0177.0.0.1``): whether
    the host may be reached is K5's call in the service, answered ``url_not_allowed``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.validators = [v for v in self.validators if not isinstance(v, URLValidator)]

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        if not outbound.url_syntax_ok(value):
            raise serializers.ValidationError("Enter an http or https URL with a host.")
        return value


class KindsSerializer(StrictSerializer):
    """Every kind of N1; ``approval`` (Q6) may be left out by a client written before it
    existed: it then keeps its stored value (on by default)."""

    session_idle = serializers.BooleanField()
    attention = serializers.BooleanField()
    unknown = serializers.BooleanField()
    task_succeeded = serializers.BooleanField()
    task_failed = serializers.BooleanField()
    approval = serializers.BooleanField(required=False)


class SettingsSerializer(StrictSerializer):
    """``PUT`` body: the whole settings document (every field required)."""

    kinds = KindsSerializer()
    webhook_url = OutboundURLField(max_length=ENDPOINT_MAX, allow_null=True)
    board = serializers.BooleanField()
    push = serializers.BooleanField()


class SubscriptionKeysSerializer(StrictSerializer):
    p256dh = serializers.CharField(max_length=200)
    auth = serializers.CharField(max_length=100)


class SubscriptionSerializer(StrictSerializer):
    """``PushSubscription.toJSON()`` as a browser gives it."""

    endpoint = OutboundURLField(max_length=ENDPOINT_MAX)
    expirationTime = serializers.IntegerField(required=False, allow_null=True)  # noqa: N815 - the browser's name
    keys = SubscriptionKeysSerializer()


class NotificationSettingsView(APIView):
    """``GET``/``PUT /api/notifications/settings/``: the requesting owner's settings (N1)."""

    @extend_schema(responses={200: shape(NotificationSettingsShape), **errors()}, summary="Notification settings (N1)")
    def get(self, request):
        valid_query(NoQuery, request)
        return Response(settings_dict(services.settings_get(owner=request.user)))

    @extend_schema(request=SettingsSerializer, responses={200: shape(NotificationSettingsShape), **errors()}, summary="Replace notification settings (N1)")
    def put(self, request):
        valid_query(NoQuery, request)
        data = valid_body(SettingsSerializer, request)
        row, secret = services.settings_update(
            owner=request.user, kinds=data["kinds"], webhook_url=data["webhook_url"], board=data["board"],
            push=data["push"], now=clock.now(),
        )
        body = settings_dict(row)
        if secret is not None:
            body["webhook_secret"] = secret
        return Response(body)


class PushSubscriptionListView(APIView):
    """``POST /api/push/subscriptions/``: store a browser's subscription (N2); 201 new,
    200 when the endpoint was known (keys updated)."""

    @extend_schema(request=SubscriptionSerializer, responses={201: shape(PushSubscriptionShape), 200: shape(PushSubscriptionShape), **errors()})
    def post(self, request):
        valid_query(NoQuery, request)
        data = valid_body(SubscriptionSerializer, request)
        sub, created = services.subscription_create(
            owner=request.user, endpoint=data["endpoint"], p256dh=data["keys"]["p256dh"], auth=data["keys"]["auth"],
            now=clock.now(),
        )
        return Response(subscription_dict(sub), status=201 if created else 200)


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

    @extend_schema(responses={200: shape(VapidPublicKeyShape), **errors()})
    def get(self, request):
        valid_query(NoQuery, request)
        return Response(VapidPublicKeyShape(public_key=services.vapid_key().public_key))
