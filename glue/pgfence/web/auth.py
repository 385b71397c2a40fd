"""Who is saving: authentication for the documents HTTP API.

The user a save is stored under (``saved_by``) comes from the server, never from the request
body. :func:`pgfence.web.documents_app` takes an ``authenticate(request)`` hook supplied by the
embedding application (it knows its sessions and cookies); it returns the :class:`Principal`
(or just a user name), returns None for "no credentials" (401), or raises :class:`Forbidden`
(403). Two hooks ship for ``pgfence serve``:

- :func:`bearer_token_auth` (the default): ``Authorization: Bearer <token>`` where the token is
  signed with a server secret (HMAC-SHA256, stdlib :mod:`hmac`): ``<payload>.<signature>``,
  both base64url without padding; the payload is JSON ``{"sub": user, "exp": unix seconds,
  "scopes": ["read", "write"]}``. Mint one with :func:`sign_token` or ``pgfence token USER``.
- :func:`trusted_header_auth`: the user named in a request header, believed as is. Only for
  development behind nothing (``pgfence serve --dev-trusted-header X-Pgfence-User``): anyone who
  can reach the port can claim to be anyone. Only requests addressed to a loopback name are
  believed (a DNS-rebinding page cannot use it).

Scopes: ``read`` (GET, merge) and ``write`` (create, save, delete). A principal without the
scope an endpoint needs is answered 403.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

READ = "read"
WRITE = "write"
ALL_SCOPES = frozenset({READ, WRITE})
MIN_SECRET_BYTES = 32
_TOKEN = re.compile(r"([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)")


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: ``name`` is stored as ``saved_by``/``created_by`` (1-200
    characters); ``scopes`` what it may do (``read``, ``write``)."""

    name: str
    scopes: frozenset[str] = field(default=ALL_SCOPES)


class Unauthenticated(Exception):
    """No valid credentials (answered 401 with ``WWW-Authenticate``)."""


class Forbidden(Exception):
    """Authenticated, but not allowed to do this (answered 403)."""


AuthResult = Principal | str | None
Authenticate = Callable[[Request], AuthResult | Awaitable[AuthResult]]
#: ``authorize(principal, action, document_id)``: False (or raising :class:`Forbidden`) = 403.
#: ``action`` is ``create``, ``read``, ``save``, ``delete`` or ``merge``; ``document_id`` is
#: None for ``create``.
Authorize = Callable[[Principal, str, int | None], bool | Awaitable[bool]]


class InvalidToken(Unauthenticated):
    """A bearer token that is malformed, badly signed or expired."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def check_secret(secret: bytes) -> bytes:
    """Return ``secret`` if it is long enough to sign tokens (>= 32 bytes), else ValueError."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the token secret must be at least {MIN_SECRET_BYTES} bytes "
                         f"(got {len(secret)}); e.g. `openssl rand -hex 32`")
    return secret


def sign_token(secret: bytes, user: str, *, ttl: float = 3600.0,
               scopes: Iterable[str] = ALL_SCOPES, now: float | None = None) -> str:
    """A bearer token for ``user``, valid ``ttl`` seconds from ``now`` (Unix time, default the
    clock), carrying ``scopes``.

    Raises:
        ValueError: secret shorter than 32 bytes, empty or over-long user, unknown scope, ttl <= 0.
    """
    check_secret(secret)
    if not user or len(user) > 200:
        raise ValueError("user must be 1-200 characters")
    wanted = sorted(set(scopes))
    if not wanted or set(wanted) - ALL_SCOPES:
        raise ValueError(f"scopes must be a non-empty subset of {sorted(ALL_SCOPES)}")
    if ttl <= 0:
        raise ValueError("ttl must be positive (seconds)")
    issued = time.time() if now is None else now
    payload = _b64(json.dumps({"sub": user, "exp": int(issued + ttl), "scopes": wanted},
                              separators=(",", ":")).encode())
    signature = hmac.new(secret, payload.encode("ascii"), hashlib.sha256).digest()
    return f"{payload}.{_b64(signature)}"


def verify_token(secret: bytes, token: str, *, now: float | None = None) -> Principal:
    """The principal a token names, if its signature is good and it has not expired.

    Raises:
        InvalidToken: malformed, bad signature, expired, or a payload of the wrong shape.
    """
    # Only the exact text sign_token makes: base64 decoding alone would skip padding and
    # stray characters, so many strings would verify as one token.
    parts = _TOKEN.fullmatch(token)
    if parts is None:
        raise InvalidToken("malformed token")
    payload, signature = parts.groups()
    want = hmac.new(secret, payload.encode("ascii"), hashlib.sha256).digest()
    try:
        got = _unb64(signature)
    except (binascii.Error, ValueError) as exc:
        raise InvalidToken("malformed token") from exc
    if not hmac.compare_digest(want, got):
        raise InvalidToken("bad token signature")
    # Parsed only once its signature is good: nothing a stranger wrote reaches the parser.
    try:
        data: Any = json.loads(_unb64(payload))
    except (binascii.Error, ValueError, RecursionError) as exc:
        raise InvalidToken("malformed token") from exc
    if not isinstance(data, dict) or not isinstance(data.get("sub"), str) \
            or not isinstance(data.get("exp"), int) or not isinstance(data.get("scopes"), list):
        raise InvalidToken("malformed token payload")
    if data["exp"] <= (time.time() if now is None else now):
        raise InvalidToken("token expired")
    scopes = frozenset(s for s in data["scopes"] if isinstance(s, str)) & ALL_SCOPES
    return Principal(name=data["sub"], scopes=scopes)


def bearer_token_auth(secret: bytes) -> Authenticate:
    """Hook: ``Authorization: Bearer <token>`` signed with ``secret`` (see :func:`sign_token`).
    No header: None (401); a bad or expired token: :class:`InvalidToken` (401)."""
    check_secret(secret)

    def authenticate(request: Request) -> Principal | None:
        header = request.headers.get("authorization")
        if header is None:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise InvalidToken("expected Authorization: Bearer <token>")
        return verify_token(secret, token.strip())

    return authenticate


def is_loopback_name(host: str) -> bool:
    """``localhost``, ``*.localhost`` or a loopback address (``127.x``, ``::1``)."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def trusted_header_auth(header: str, *, loopback_only: bool = True) -> Authenticate:
    """Development hook: the user is whatever the request header ``header`` says (no proof).
    Missing or empty: None (401).

    With ``loopback_only`` (the default) the header is believed only in requests addressed to
    a loopback name (the ``Host`` header): a page on any site can rebind its DNS name to
    127.0.0.1 and then call the development server as its own origin, header and all; such
    requests are answered 401.
    """

    def authenticate(request: Request) -> Principal | None:
        if loopback_only and not is_loopback_name(request.url.hostname or ""):
            raise Unauthenticated(f"the development header {header} is only believed in "
                                  "requests to a loopback name (localhost, 127.0.0.1, [::1])")
        name = request.headers.get(header, "").strip()
        return Principal(name=name) if name else None

    return authenticate
