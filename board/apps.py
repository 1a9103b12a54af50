from django.apps import AppConfig


class BoardConfig(AppConfig):
    """What spans both apps: the board's page, snapshot (B4) and socket (B2), and the
    periodic sweep of tasks and sessions (L6, J5, A7, S7). No app imports it."""

    name = "board"
    verbose_name = "Board"
