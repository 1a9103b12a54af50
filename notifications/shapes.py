"""Wire shapes of notifications (SPEC N1-N3, H, B2): the JSON that the notification API
answers and that ``notification`` board events carry, written once as the ``TypedDict``
each builder returns (see ``tasks_app/shapes.py``). No DRF."""
from typing import Annotated, Literal, NotRequired, TypedDict

from core.wire import BoardEvent, Doc, Time, Url, Uuid
from notifications.models import KIND_NAMES, Kind, NotificationSettings, PushSubscription
from tasks_app.models import TaskState


class NotificationKindsShape(TypedDict):
    """N1: which kinds the owner is told about (one key per ``Kind``)."""

    session_idle: bool
    attention: bool
    unknown: bool
    task_succeeded: bool
    task_failed: bool
    approval: Annotated[bool, Doc("Q6: an agent asks for an approval (and its answer replaces it)")]


class NotificationSettingsShape(TypedDict):
    """``GET/PUT /api/notifications/settings/`` (N1, N2). Never the stored secret."""

    kinds: NotificationKindsShape
    webhook_url: Url | None
    board: bool
    push: bool
    webhook_secret: NotRequired[Annotated[str, Doc("only in the answer to a PUT that set a new webhook_url")]]


def settings_dict(row: NotificationSettings) -> NotificationSettingsShape:
    """The owner's settings ``row`` as answered (the secret is added by the view, once)."""
    return {
        "kinds": {name: row.kind_on(name) for name in KIND_NAMES},
        "webhook_url": row.webhook_url or None,
        "board": row.board,
        "push": row.push,
    }


class PushSubscriptionShape(TypedDict):
    """A stored browser push subscription (N2); its keys are never answered."""

    id: Uuid
    endpoint: Url
    created_at: Time


def subscription_dict(sub: PushSubscription) -> PushSubscriptionShape:
    return {"id": str(sub.id), "endpoint": sub.endpoint, "created_at": sub.created_at.isoformat()}


class VapidPublicKeyShape(TypedDict):
    """``GET /api/push/vapid-public-key/`` (N2): the ``applicationServerKey``."""

    public_key: Annotated[str, Doc("base64url, unpadded")]


class NotificationShape(TypedDict):
    """One notification (N3), as the board event, the push message and the webhook body
    carry it; the subject is the session's or the task's id (and the task's state)."""

    id: Uuid
    kind: Kind
    title: str
    body: str
    url: Annotated[str, Doc("the page to open, relative to the service")]
    created_at: Time
    session_id: NotRequired[Uuid]
    task_id: NotRequired[Uuid]
    state: NotRequired[TaskState]
    approval_id: NotRequired[Annotated[Uuid, Doc("Q6: the approval asked about (kind approval)")]]
    approval_state: NotRequired[Annotated[str, Doc("Q6: pending when asked; allowed, denied, answered_in_terminal, "
                                                   "expired or withdrawn in the notification that replaces it")]]
    tag: NotRequired[Annotated[str, Doc("Q6: what a device replaces: the approval id; absent = the event id")]]


class NotificationBoardEvent(BoardEvent):
    """The ``notification`` board event (N1, B2)."""

    type: Literal["notification"]
    notification: NotificationShape
    version: int


def notification_event(notification: NotificationShape) -> NotificationBoardEvent:
    """The ``notification`` board event of a stored notification's payload."""
    return {"type": "notification", "notification": notification, "version": 1}
