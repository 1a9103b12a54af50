"""The board events of ``/ws/board/`` (B2) in ``/api/schema/``: OpenAPI 3.0 has no place
for a WebSocket, so each event shape is a component (``TaskBoardEvent``, ...) and
``BoardEvent`` is their union by ``type``, generated from the same ``TypedDict`` that each
event's builder returns. A new board event is added to ``BOARD_EVENTS``."""
from core.schema import add_components
from notifications.shapes import NotificationBoardEvent
from sessions_app.shapes import (
    ApprovalBoardEvent,
    MarkerBoardEvent,
    SessionDeletedBoardEvent,
    SessionMessageBoardEvent,
    SessionStatusBoardEvent,
)
from tasks_app.shapes import (
    MachineBoardEvent,
    MessageBoardEvent,
    PoolBoardEvent,
    PoolDeletedBoardEvent,
    TaskBoardEvent,
    TaskProgressBoardEvent,
)

BOARD_EVENTS = (
    TaskBoardEvent,
    TaskProgressBoardEvent,
    MessageBoardEvent,
    MachineBoardEvent,
    PoolBoardEvent,
    PoolDeletedBoardEvent,
    SessionStatusBoardEvent,
    MarkerBoardEvent,
    SessionDeletedBoardEvent,
    NotificationBoardEvent,
    ApprovalBoardEvent,
    SessionMessageBoardEvent,
)


def board_events(result, generator, request, public):
    """drf-spectacular postprocessing hook (``SPECTACULAR_SETTINGS``): adds the board event
    components and their union ``BoardEvent``."""
    return add_components(result, generator, BOARD_EVENTS, union="BoardEvent")
