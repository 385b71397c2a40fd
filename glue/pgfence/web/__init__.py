"""Versioned documents over HTTP (needs the ``web`` extra: ``pip install 'pgfence[web]'``).

- :func:`documents_app` — the documents API as an ASGI app (Starlette) to mount in your own
  app; :data:`~pgfence.web.app.HTTP_BY_SQLSTATE` is its SQLSTATE → HTTP status table.
- :mod:`pgfence.web.auth` — who is saving: the ``authenticate`` hook, signed bearer tokens
  (:func:`sign_token`), and the development-only trusted header.
- :func:`serve_app`, :class:`ServerThread` — what ``pgfence serve`` runs.
- ``static/pgfence-documents.js`` — the browser session module (ES module, no dependencies),
  served at ``/static/pgfence-documents.js``; ``static/demo.html`` — the demo page.

Example (mounted under ``/api`` of your Starlette app)::

    from starlette.routing import Mount
    from pgfence.web import Principal, documents_app

    async def who(request):                      # your session cookie, your users
        user = await my_sessions.user_of(request)
        return Principal(user.login) if user else None

    docs = documents_app(dsn=DATABASE_URL, authenticate=who)
    app = Starlette(routes=[Mount("/api", app=docs)], lifespan=...)  # close: close_documents_app
"""

from __future__ import annotations

from .app import HTTP_BY_SQLSTATE, HttpError, close_documents_app, documents_app
from .auth import (
    Forbidden,
    InvalidToken,
    Principal,
    Unauthenticated,
    bearer_token_auth,
    sign_token,
    trusted_header_auth,
    verify_token,
)
from .server import DEMO_USER_HEADER, ServerThread, serve_app

__all__ = [
    "DEMO_USER_HEADER", "HTTP_BY_SQLSTATE", "Forbidden", "HttpError", "InvalidToken",
    "Principal", "ServerThread", "Unauthenticated", "bearer_token_auth", "close_documents_app",
    "documents_app", "serve_app", "sign_token", "trusted_header_auth", "verify_token",
]
