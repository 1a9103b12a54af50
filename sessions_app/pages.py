"""The session page (SPEC T6): ``/sessions/{id}/``, login required, owner-scoped (404 for
another owner's session, K2), a chat with a session started in a terminal
(static/session.js with chat.js, the task chat's parts): the owner's messages and their
states (T2), each turn's last assistant message under the messages it answered, the
session's pending approvals inline (Q6), "Stop this turn" (T5) and how a message reaches
the session now (T1). The page embeds the session (its API shape); everything else it
reads from the API, and re-reads on every (re)connect of the board socket (B4)."""
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from core import clock
from sessions_app.models import Session
from sessions_app.shapes import session_dict


@login_required
@require_GET
def session_page(request, session_id):
    session = get_object_or_404(Session.objects.prefetch_related("markers"), pk=session_id, owner=request.user)
    data = session_dict(session, markers=session.markers.all(), now=clock.now())
    return render(request, "session.html", {"session": session, "page": data})
