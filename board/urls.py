"""The board's page and snapshot (B1, B4); included at "" by config/urls.py."""
from django.urls import path

from board import views

urlpatterns = [
    path("", views.board_page, name="board"),
    path("api/board/", views.BoardSnapshotView.as_view(), name="board-snapshot"),
]
