"""The board (SPEC B1-B8): the page at ``/`` and its snapshot ``GET /api/board/``.

The page is rendered by Django with the owner's snapshot embedded (``json_script``), so it
shows the board before the WebSocket opens; ``static/board.js`` then keeps it live from
``/ws/board/`` events and re-hydrates from ``/api/board/`` on every (re)connect and every
60 s (B4).
"""
from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from board.shapes import BoardSnapshotShape, board_snapshot
from core import clock
from core.schema import errors, shape
from core.strict import NoQuery, valid_query


class BoardSnapshotView(APIView):
    """``GET /api/board/``: the requesting owner's snapshot (B4, K2). Owners only (token or
    browser session); machine tokens get 403."""

    @extend_schema(responses={200: shape(BoardSnapshotShape), **errors()}, summary="The owner's board snapshot (B4)")
    def get(self, request):
        valid_query(NoQuery, request)
        return Response(board_snapshot(owner=request.user, now=clock.now()))


@login_required
def board_page(request):
    """The board page (B1): server-rendered with the snapshot embedded for the JS."""
    return render(request, "board.html", {"snapshot": board_snapshot(owner=request.user, now=clock.now())})
