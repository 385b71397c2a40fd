"""The documents HTTP API without a browser: every status code, the auth hooks, CORS, limits.

A real uvicorn server on a thread (or ``pgfence serve`` as a subprocess) in front of the real
database; requests go over TCP with http.client.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount

from pgfence.cli import main
from pgfence.documents import api
from pgfence.web import (
    HTTP_BY_SQLSTATE,
    Forbidden,
    Principal,
    ServerThread,
    bearer_token_auth,
    documents_app,
    sign_token,
    trusted_header_auth,
)
from support import wait_for

SECRET = b"s" * 32
ROOT = Path(__file__).resolve().parent.parent


class Answer:
    def __init__(self, status: int, headers: dict[str, str], raw: bytes) -> None:
        self.status, self.headers, self.raw = status, headers, raw
        self.json: Any = json.loads(raw) if raw and "json" in headers.get("content-type", "") else None


def call(base: str, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
         raw: bytes | None = None, token: str | None = None) -> Answer:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=15)
    hdrs = dict(headers or {})
    data = raw
    if body is not None:
        data = json.dumps(body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=data, headers=hdrs)
        res = conn.getresponse()
        return Answer(res.status, {k.lower(): v for k, v in res.getheaders()}, res.read())
    finally:
        conn.close()


def tok(user: str = "ann", **kw: Any) -> str:
    return sign_token(SECRET, user, **kw)


@pytest.fixture()
def server(db: str) -> Iterator[str]:
    app = documents_app(dsn=db, authenticate=bearer_token_auth(SECRET))
    with ServerThread(app) as srv:
        yield srv.url


def create(base: str, content: Any, kind: str = "record", **kw: Any) -> int:
    res = call(base, "POST", "/documents", {"kind": kind, "content": content}, token=tok(), **kw)
    assert res.status == 201, res.raw
    return int(res.json["id"])


def put(base: str, doc: int, content: Any, version: int | None, key: str | None = "k1",
        user: str = "ann", **extra: Any) -> Answer:
    headers = {}
    if version is not None:
        headers["If-Match"] = f'"{version}"'
    if key is not None:
        headers["Idempotency-Key"] = key
    return call(base, "PUT", f"/documents/{doc}", {"content": content, **extra}, headers=headers,
                token=tok(user))


# ---------------------------------------------------------------------------------------------
# create, read
# ---------------------------------------------------------------------------------------------
def test_create_201_location_etag_and_an_idempotent_repeat(server: str, db: str) -> None:
    hdrs = {"Idempotency-Key": "create-1"}
    a = call(server, "POST", "/documents", {"kind": "record", "content": {"t": 1}}, token=tok(),
             headers=hdrs)
    assert a.status == 201 and a.json == {"id": a.json["id"], "kind": "record", "version": 1}
    assert a.headers["etag"] == '"1"' and a.headers["location"].endswith(f"/documents/{a.json['id']}")
    again = call(server, "POST", "/documents", {"kind": "record", "content": {"t": 1}},
                 token=tok(), headers=hdrs)
    assert again.status == 201 and again.json["id"] == a.json["id"]
    other = call(server, "POST", "/documents", {"kind": "record", "content": {"t": 2}},
                 token=tok(), headers=hdrs)
    assert other.status == 422 and other.json["error"] == "idempotency_key_reused"
    assert other.json["sqlstate"] == "PF003" and other.json["hint"]
    with psycopg.connect(db, autocommit=True) as c:
        assert api.get(c, a.json["id"]).created_by == "ann"


def test_a_create_idempotency_key_is_the_callers_own(server: str, db: str) -> None:
    """Two users who happen to send the same key (clients count from 1) never get each
    other's document, nor learn that it exists."""
    body = {"kind": "record", "content": {}}
    ann = call(server, "POST", "/documents", body, token=tok("ann"), headers={"Idempotency-Key": "1"})
    bob = call(server, "POST", "/documents", body, token=tok("bob"), headers={"Idempotency-Key": "1"})
    assert ann.status == bob.status == 201 and ann.json["id"] != bob.json["id"]
    other = call(server, "POST", "/documents", {"kind": "record", "content": {"x": 1}},
                 token=tok("carol"), headers={"Idempotency-Key": "1"})
    assert other.status == 201 and other.json["id"] not in (ann.json["id"], bob.json["id"])
    again = call(server, "POST", "/documents", body, token=tok("bob"), headers={"Idempotency-Key": "1"})
    assert again.status == 201 and again.json["id"] == bob.json["id"]     # bob's retry: bob's doc
    with psycopg.connect(db, autocommit=True) as c:
        assert api.get(c, bob.json["id"]).created_by == "bob"
    for bad in ["", "k" * 256]:
        res = call(server, "POST", "/documents", body, token=tok(), headers={"Idempotency-Key": bad})
        assert (res.status, res.json["error"]) == (400, "bad_request")


def test_create_errors_422_unknown_kind_and_invalid_content(server: str) -> None:
    bad_kind = call(server, "POST", "/documents", {"kind": "nope", "content": {}}, token=tok())
    assert (bad_kind.status, bad_kind.json["error"], bad_kind.json["sqlstate"]) == (
        422, "unknown_kind", "PF302")
    not_object = call(server, "POST", "/documents", {"kind": "record", "content": [1]}, token=tok())
    assert (not_object.status, not_object.json["error"], not_object.json["sqlstate"]) == (
        422, "invalid_argument", "22023")
    missing = call(server, "POST", "/documents", {"kind": "record"}, token=tok())
    assert missing.status == 400 and missing.json["error"] == "bad_request"


def test_get_200_with_etag_304_404_and_revisions(server: str) -> None:
    doc = create(server, {"title": "a"})
    got = call(server, "GET", f"/documents/{doc}", token=tok())
    assert got.status == 200 and got.headers["etag"] == '"1"'
    assert {k: got.json[k] for k in ("id", "kind", "version", "content", "saved_by")} == {
        "id": doc, "kind": "record", "version": 1, "content": {"title": "a"}, "saved_by": "ann"}
    same = call(server, "GET", f"/documents/{doc}", headers={"If-None-Match": '"1"'}, token=tok())
    assert same.status == 304 and same.raw == b""
    for inm in ['*', '"7", "1"', 'W/"1"']:                      # RFC 9110 13.1.2
        assert call(server, "GET", f"/documents/{doc}", headers={"If-None-Match": inm},
                    token=tok()).status == 304, inm
    assert call(server, "GET", f"/documents/{doc}", headers={"If-None-Match": '"7"'},
                token=tok()).status == 200
    missing = call(server, "GET", "/documents/999999", token=tok())
    assert (missing.status, missing.json["error"], missing.json["sqlstate"]) == (404, "not_found", "P0002")
    huge = call(server, "GET", f"/documents/{2**70}", token=tok())
    assert huge.status == 404
    assert put(server, doc, {"title": "b"}, 1).status == 200
    rev = call(server, "GET", f"/documents/{doc}/revisions/1", token=tok())
    assert rev.status == 200 and rev.json["content"] == {"title": "a"} and rev.json["op"] == "create"
    none = call(server, "GET", f"/documents/{doc}/revisions/9", token=tok())
    assert none.status == 404 and none.json["sqlstate"] == "P0002"


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------
def test_put_saved_replayed_and_conflict_with_the_stored_copy(server: str, db: str) -> None:
    doc = create(server, {"title": "a"})
    ok = put(server, doc, {"title": "b"}, 1, key="s1")
    assert ok.status == 200 and ok.json["version"] == 2 and ok.json["replayed"] is False
    assert ok.headers["etag"] == '"2"'
    retry = put(server, doc, {"title": "b"}, 1, key="s1")           # the first answer was "lost"
    assert retry.status == 200 and retry.json == {**ok.json, "replayed": True}
    stale = put(server, doc, {"title": "c"}, 1, key="s2", user="bob")
    assert stale.status == 409 and stale.headers["etag"] == '"2"'
    assert {k: stale.json[k] for k in ("error", "version", "content", "saved_by", "deleted")} == {
        "error": "version_conflict", "version": 2, "content": {"title": "b"}, "saved_by": "ann",
        "deleted": False}
    assert stale.json["saved_at"]
    reused = put(server, doc, {"title": "other"}, 1, key="s1")
    assert reused.status == 422 and reused.json["sqlstate"] == "PF003"
    with psycopg.connect(db, autocommit=True) as c:
        assert [r["version"] for r in api.history(c, doc)] == [2, 1]


def test_put_expected_version_in_the_body_and_the_428_400_cases(server: str) -> None:
    doc = create(server, {"title": "a"})
    body_version = put(server, doc, {"title": "b"}, None, key="b1", expectedVersion=1)
    assert body_version.status == 200 and body_version.json["version"] == 2
    none = put(server, doc, {"title": "c"}, None, key="b2")
    assert none.status == 428 and none.json["error"] == "precondition_required"
    star = call(server, "PUT", f"/documents/{doc}", {"content": {}}, token=tok(),
                headers={"If-Match": "*", "Idempotency-Key": "x"})
    assert star.status == 428
    weak = call(server, "PUT", f"/documents/{doc}", {"content": {"title": "w"}}, token=tok(),
                headers={"If-Match": 'W/"2"', "Idempotency-Key": "w1"})
    assert weak.status == 200 and weak.json["version"] == 3
    garbage = call(server, "PUT", f"/documents/{doc}", {"content": {}}, token=tok(),
                   headers={"If-Match": "three", "Idempotency-Key": "x"})
    assert garbage.status == 400
    differ = put(server, doc, {"title": "d"}, 3, key="b3", expectedVersion=2)
    assert differ.status == 400
    no_key = put(server, doc, {"title": "d"}, 3, key=None)
    assert no_key.status == 400 and no_key.json["error"] == "idempotency_key_required"
    never = put(server, doc, {"title": "d"}, 99, key="b4")
    assert (never.status, never.json["error"], never.json["sqlstate"]) == (422, "version_unknown", "PF303")
    not_object = put(server, doc, [1, 2], 3, key="b5")
    assert not_object.status == 422 and not_object.json["sqlstate"] == "22023"
    unknown = put(server, 999999, {"t": 1}, 1, key="b6")
    assert unknown.status == 404 and unknown.json["sqlstate"] == "P0002"
    no_content = call(server, "PUT", f"/documents/{doc}", {"expectedVersion": 3}, token=tok(),
                      headers={"Idempotency-Key": "b7"})
    assert no_content.status == 400


def test_body_limit_content_type_and_malformed_json(db: str) -> None:
    app = documents_app(dsn=db, authenticate=bearer_token_auth(SECRET), max_body_bytes=2_000_000)
    with ServerThread(app) as srv:
        doc = create(srv.url, {"t": 0})
        big = put(srv.url, doc, {"t": "x" * 1_100_000}, 1, key="big")   # over the kind's 1 MiB
        assert (big.status, big.json["error"], big.json["sqlstate"]) == (413, "content_too_large", "PF301")
        huge = put(srv.url, doc, {"t": "x" * 2_100_000}, 1, key="huge")  # over the body limit
        assert huge.status == 413 and huge.json["error"] == "body_too_large"
        text = call(srv.url, "PUT", f"/documents/{doc}", raw=b'{"content": {}}', token=tok(),
                    headers={"Content-Type": "text/plain", "If-Match": '"1"', "Idempotency-Key": "t"})
        assert text.status == 415 and text.json["error"] == "unsupported_media_type"
        broken = call(srv.url, "PUT", f"/documents/{doc}", raw=b'{"content": ', token=tok(),
                      headers={"Content-Type": "application/json", "If-Match": '"1"',
                               "Idempotency-Key": "t"})
        assert broken.status == 400 and broken.json["error"] == "bad_request"
        nan = call(srv.url, "PUT", f"/documents/{doc}", raw=b'{"content": {"x": NaN}}', token=tok(),
                   headers={"Content-Type": "application/json; charset=utf-8", "If-Match": '"1"',
                            "Idempotency-Key": "t"})
        assert nan.status == 400


def test_hostile_versions_and_json_are_answered_4xx_never_500(server: str, db: str) -> None:
    doc = create(server, {"t": 0})

    def raw_put(body: bytes, if_match: str | None = '"1"', key: str = "h") -> Answer:
        headers = {"Content-Type": "application/json", "Idempotency-Key": key}
        if if_match is not None:
            headers["If-Match"] = if_match
        return call(server, "PUT", f"/documents/{doc}", raw=body, token=tok(), headers=headers)

    # versions: only ASCII digits, only bigint range (str.isdigit() takes "\u00b2", int() not)
    for if_match in ['"\u00b2"', '"\u00b9"', f'"{2**63}"', '"' + "9" * 30 + '"', '"-1"', '""']:
        res = raw_put(b'{"content": {"t": 1}}', if_match)
        assert (res.status, res.json["error"]) == (400, "bad_request"), (if_match, res.raw)
    for version in [2**63, 2**70, -1, 0, 1.5, "1", True]:
        res = put(server, doc, {"t": 1}, None, key="bv", expectedVersion=version)
        assert (res.status, res.json["error"]) == (400, "bad_request"), (version, res.raw)
    assert call(server, "DELETE", f"/documents/{doc}", token=tok(),
                headers={"If-Match": f'"{2**64}"'}).status == 400
    # JSON that PostgreSQL's jsonb cannot hold: a NUL character, a lone surrogate
    nul = raw_put(b'{"content": {"t": "a\\u0000b"}}', key="nul")
    assert (nul.status, nul.json["error"], nul.json["sqlstate"]) == (422, "invalid_argument", "22P05")
    lone = raw_put(b'{"content": {"t": "\\ud800"}}', key="lone")
    assert (lone.status, lone.json["error"], lone.json["sqlstate"]) == (422, "invalid_argument", "22P02")
    # numbers a double cannot carry would be stored changed: refused, not rounded
    for number in [b"1e400", b"-1e400", b"1e-400", b"3.14159265358979323846264338327950288"]:
        res = raw_put(b'{"content": {"t": ' + number + b"}}", key="num")
        assert (res.status, res.json["error"]) == (400, "bad_request"), (number, res.raw)
        assert "exactly" in res.json["message"]
    fine = raw_put(b'{"content": {"t": 0.1, "u": 1.10, "v": 12345678901234567890123}}', key="ok")
    assert fine.status == 200, fine.raw
    # nesting deeper than the parser's recursion: 400, not a RecursionError 500
    deep = raw_put(b'{"content": {"t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}", '"2"', key="deep")
    assert (deep.status, deep.json["error"]) == (400, "bad_request"), deep.raw
    with psycopg.connect(db, autocommit=True) as c:
        assert api.get(c, doc).content == {"t": 0.1, "u": 1.1, "v": 12345678901234567890123}
        assert [r["version"] for r in api.history(c, doc)] == [2, 1]


def test_a_body_that_trickles_in_is_answered_408_not_waited_on_forever(db: str) -> None:
    """A client that sends its headers and then stalls (slowloris) holds a connection only
    until body_timeout; the session retries 408 with the same save id."""
    app = documents_app(dsn=db, authenticate=lambda r: "ann", body_timeout=1.0)
    with ServerThread(app) as srv, socket.create_connection(("127.0.0.1", srv.port), timeout=15) as s:
        s.sendall(b"PUT /documents/1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b'If-Match: "1"\r\nIdempotency-Key: slow\r\nContent-Length: 100\r\n\r\n{')
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(4096)
            assert chunk, f"connection closed without an answer: {answer!r}"
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer


# ---------------------------------------------------------------------------------------------
# delete, merge
# ---------------------------------------------------------------------------------------------
def test_delete_428_200_replay_409_and_410_after(server: str) -> None:
    doc = create(server, {"title": "a"})
    assert call(server, "DELETE", f"/documents/{doc}", token=tok()).status == 428
    assert put(server, doc, {"title": "b"}, 1, key="d1").status == 200
    stale = call(server, "DELETE", f"/documents/{doc}", headers={"If-Match": '"1"'}, token=tok())
    assert stale.status == 409 and stale.json["version"] == 2 and stale.json["content"] == {"title": "b"}
    gone = call(server, "DELETE", f"/documents/{doc}", headers={"If-Match": '"2"'}, token=tok())
    assert gone.status == 200 and gone.json["deleted"] is True and gone.json["version"] == 3
    again = call(server, "DELETE", f"/documents/{doc}", headers={"If-Match": '"2"'}, token=tok())
    assert again.status == 200 and again.json["replayed"] is True
    assert call(server, "GET", f"/documents/{doc}", token=tok()).status == 410
    late = put(server, doc, {"title": "c"}, 2, key="d2")
    assert late.status == 410 and late.json["error"] == "deleted" and late.json["version"] == 3
    assert call(server, "POST", f"/documents/{doc}/merge", {"base": {}, "local": {}, "stored": {}},
                token=tok()).status == 410


def test_merge_records_by_attribute_and_sheets_never(server: str) -> None:
    rec = create(server, {"a": 1, "b": 1})
    clean = call(server, "POST", f"/documents/{rec}/merge",
                 {"base": {"a": 1, "b": 1}, "local": {"a": 2, "b": 1}, "stored": {"a": 1, "b": 3}},
                 token=tok())
    assert clean.status == 200 and clean.json == {"kind": "record", "content": {"a": 2, "b": 3},
                                                  "conflicts": [], "clean": True}
    clash = call(server, "POST", f"/documents/{rec}/merge",
                 {"base": {"a": 1}, "local": {"a": 2}, "stored": {"a": 3}}, token=tok())
    assert clash.json["clean"] is False and clash.json["conflicts"] == [
        {"key": "a", "base": 1, "local": 2, "stored": 3}]
    sheet = create(server, {"A1": 1, "B1": 1}, kind="sheet")
    both = call(server, "POST", f"/documents/{sheet}/merge",
                {"base": {"A1": 1, "B1": 1}, "local": {"A1": 2, "B1": 1},
                 "stored": {"A1": 1, "B1": 2}}, token=tok())
    assert both.json["content"] is None and [c["key"] for c in both.json["conflicts"]] == ["A1", "B1"]
    missing = call(server, "POST", f"/documents/{rec}/merge", {"base": {}}, token=tok())
    assert missing.status == 400


def test_unknown_routes_and_methods_answer_json(server: str) -> None:
    nothing = call(server, "GET", "/nothing", token=tok())
    assert nothing.status == 404 and nothing.json["error"] == "not_found"
    method = call(server, "PATCH", "/documents/1", {"content": {}}, token=tok())
    assert method.status == 405 and method.json["error"] == "method_not_allowed"


# ---------------------------------------------------------------------------------------------
# who is saving
# ---------------------------------------------------------------------------------------------
def test_401_without_or_with_a_bad_token_and_403_read_only(server: str, db: str) -> None:
    doc = create(server, {"title": "a"})
    none = call(server, "GET", f"/documents/{doc}")
    assert none.status == 401 and none.json["error"] == "unauthenticated"
    assert none.headers["www-authenticate"].startswith("Bearer")
    forged = tok()[:-2] + ("AA" if not tok().endswith("AA") else "BB")
    assert call(server, "GET", f"/documents/{doc}", token=forged).status == 401
    # only the exact signed text: base64 decoding would skip padding and stray characters
    for altered in [tok() + "==", tok().replace(".", ".=", 1), tok().replace(".", "=.", 1)]:
        assert call(server, "GET", f"/documents/{doc}", token=altered).status == 401, altered
    # an unsigned payload is never parsed: deep JSON in it was a RecursionError (500)
    deep = base64.urlsafe_b64encode(b"[" * 9000).rstrip(b"=").decode() + ".AAAA"
    unsigned = call(server, "GET", f"/documents/{doc}", token=deep)
    assert (unsigned.status, unsigned.json["message"]) == (401, "bad token signature")
    other_secret = sign_token(b"o" * 32, "ann")
    assert call(server, "GET", f"/documents/{doc}", token=other_secret).status == 401
    expired = sign_token(SECRET, "ann", ttl=10, now=time.time() - 60)
    assert call(server, "GET", f"/documents/{doc}", token=expired).json["message"] == "token expired"
    basic = call(server, "GET", f"/documents/{doc}", headers={"Authorization": "Basic eDp5"})
    assert basic.status == 401
    reader = tok("rita", scopes=["read"])
    assert call(server, "GET", f"/documents/{doc}", token=reader).status == 200
    denied = call(server, "PUT", f"/documents/{doc}", {"content": {"title": "x"}}, token=reader,
                  headers={"If-Match": '"1"', "Idempotency-Key": "r1"})
    assert denied.status == 403 and denied.json["error"] == "forbidden"
    assert call(server, "POST", "/documents", {"kind": "record", "content": {}}, token=reader).status == 403
    # who saves comes from the token, never from the body
    res = put(server, doc, {"title": "b"}, 1, key="u1", user="ann", saved_by="mallory")
    assert res.status == 200 and res.json["saved_by"] == "ann"
    with psycopg.connect(db, autocommit=True) as c:
        assert api.get(c, doc).saved_by == "ann"


def test_the_dev_trusted_header_is_believed_only_for_a_loopback_host(db: str) -> None:
    """A page on any site can DNS-rebind its name to 127.0.0.1 and then call the dev server
    same-origin, header included: only requests addressed to a loopback name are believed."""
    app = documents_app(dsn=db, authenticate=trusted_header_auth("X-User"))
    with ServerThread(app) as srv:
        made = call(srv.url, "POST", "/documents", {"kind": "record", "content": {}},
                    headers={"X-User": "ann"})
        assert made.status == 201
        path = f"/documents/{made.json['id']}"
        for host in [f"127.0.0.1:{srv.port}", "localhost", f"[::1]:{srv.port}", "app.localhost"]:
            assert call(srv.url, "GET", path, headers={"X-User": "ann", "Host": host}).status == 200
        rebound = call(srv.url, "GET", path, headers={"X-User": "ann", "Host": f"evil.example:{srv.port}"})
        assert rebound.status == 401 and "loopback" in rebound.json["message"]


def test_the_embedding_apps_hooks_async_authenticate_authorize_and_mounting(db: str) -> None:
    async def authenticate(request: Request) -> Principal | str | None:
        user = request.headers.get("x-session")
        if user == "banned":
            raise Forbidden("banned user")
        return user

    def authorize(who: Principal, action: str, doc: int | None) -> bool:
        return not (who.name == "guest" and action in ("save", "delete"))

    docs = documents_app(dsn=db, authenticate=authenticate, authorize=authorize)
    app = Starlette(routes=[Mount("/api", app=docs)])
    with ServerThread(app) as srv:
        made = call(srv.url, "POST", "/api/documents", {"kind": "record", "content": {"t": 1}},
                    headers={"X-Session": "ann"})
        assert made.status == 201 and "/api/documents/" in made.headers["location"]
        doc = made.json["id"]
        assert call(srv.url, "GET", f"/api/documents/{doc}").status == 401
        assert call(srv.url, "GET", f"/api/documents/{doc}", headers={"X-Session": "banned"}).status == 403
        assert call(srv.url, "GET", f"/api/documents/{doc}", headers={"X-Session": "guest"}).status == 200
        guest = call(srv.url, "PUT", f"/api/documents/{doc}", {"content": {"t": 2}},
                     headers={"X-Session": "guest", "If-Match": '"1"', "Idempotency-Key": "g"})
        assert guest.status == 403
        module = call(srv.url, "GET", "/api/static/pgfence-documents.js")
        assert module.status == 200 and "javascript" in module.headers["content-type"]
        assert b"export class DocumentSession" in module.raw


def test_a_failing_hook_is_a_json_500_without_a_stack_trace(db: str) -> None:
    def authenticate(request: Request) -> str:
        raise RuntimeError("secret internals /srv/app.py line 3")

    with ServerThread(documents_app(dsn=db, authenticate=authenticate)) as srv:
        res = call(srv.url, "GET", "/documents/1")
    assert res.status == 500 and res.json == {"error": "internal_error", "sqlstate": None,
                                              "message": "the server could not complete the request"}
    assert b"Traceback" not in res.raw and b"secret" not in res.raw


def test_503_with_retry_after_when_the_database_is_unreachable(admin_dsn: str) -> None:
    dead = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1"
    app = documents_app(dsn=dead, authenticate=lambda r: "ann", db_timeout=1.0)
    with ServerThread(app) as srv:
        res = call(srv.url, "GET", "/documents/1")
    assert res.status == 503 and res.headers["retry-after"] == "1"
    assert res.json["error"] in ("database_unavailable", "database_timeout")


def test_cors_is_off_unless_configured(db: str) -> None:
    plain = documents_app(dsn=db, authenticate=lambda r: "ann")
    allowed = documents_app(dsn=db, authenticate=lambda r: "ann",
                            cors_origins=["http://app.example"])
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "PUT",
                 "Access-Control-Request-Headers": "if-match,idempotency-key,content-type"}
    with ServerThread(plain) as srv:
        res = call(srv.url, "OPTIONS", "/documents/1", headers=preflight)
        assert "access-control-allow-origin" not in res.headers
        got = call(srv.url, "GET", "/documents/1", headers={"Origin": "http://app.example"})
        assert "access-control-allow-origin" not in got.headers
    with ServerThread(allowed) as srv:
        res = call(srv.url, "OPTIONS", "/documents/1", headers=preflight)
        assert res.status == 200 and res.headers["access-control-allow-origin"] == "http://app.example"
        assert "if-match" in res.headers["access-control-allow-headers"].lower()
        evil = call(srv.url, "OPTIONS", "/documents/1", headers={**preflight, "Origin": "http://evil"})
        assert evil.headers.get("access-control-allow-origin") != "http://evil"


def test_the_sqlstates_the_sessions_retry_are_exactly_the_503_answers() -> None:
    from pgfence.documents.session import TRANSIENT_SQLSTATES

    assert {s for s, (status, _) in HTTP_BY_SQLSTATE.items() if status == 503} == TRANSIENT_SQLSTATES


def test_every_sqlstate_in_the_table_is_documented() -> None:
    doc = (ROOT / "docs" / "http.md").read_text()
    errors = (ROOT / "functions" / "ERRORS.md").read_text()
    for state, (status, name) in HTTP_BY_SQLSTATE.items():
        assert re.search(rf"`{state}`.*\b{status}\b.*`{name}`", doc), f"{state} not in docs/http.md"
        if state.startswith("PF") or state in ("22004", "22023", "P0002"):
            assert f"`{state}`" in errors


# ---------------------------------------------------------------------------------------------
# pgfence serve / pgfence token (real processes)
# ---------------------------------------------------------------------------------------------
def pgfence(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgfence", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_serve_refuses_to_start_without_a_secret_or_with_the_dev_header_off_loopback(db: str) -> None:
    env = {"PGFENCE_WEB_SECRET": ""}
    no_secret = pgfence("--dsn", db, "serve", "--port", "0", env=env)
    assert no_secret.returncode == 2 and "PGFENCE_WEB_SECRET" in no_secret.stderr
    assert "Traceback" not in no_secret.stderr
    short = pgfence("--dsn", db, "serve", "--port", "0", env={"PGFENCE_WEB_SECRET": "short"})
    assert short.returncode == 2 and "32 bytes" in short.stderr
    open_dev = pgfence("--dsn", db, "serve", "--host", "0.0.0.0", "--dev-trusted-header", "X-User")
    assert open_dev.returncode == 2 and "loopback" in open_dev.stderr
    for bad in [["--port", "99999"], ["--port", "-1"], ["--max-body-bytes", "0"]]:
        res = CliRunner().invoke(main, ["--dsn", db, "serve", *bad, "--dev-trusted-header", "X"])
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (bad, res.exception)


def test_serve_refuses_to_start_on_a_database_without_pgfence(admin_dsn: str) -> None:
    """It checked the schema only on the first request: it printed its URL, then answered
    every request 500."""
    res = pgfence("--dsn", admin_dsn, "serve", "--port", "0", "--dev-trusted-header", "X",
                  timeout=20)
    assert res.returncode == 1 and "pgfence migrate" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "http://" not in res.stdout


def test_serve_with_a_token_from_pgfence_token(db: str, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("t" * 40)
    token = pgfence("token", "ann", "--secret-file", str(secret)).stdout.strip()
    log = tmp_path / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "pgfence", "--dsn", db, "serve", "--port", "0",
                                 "--secret-file", str(secret)], stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = wait_for(lambda: re.search(r"(http://127\.0\.0\.1:\d+)/documents", log.read_text()),
                        20, "pgfence serve to print its URL")
        base = line.group(1)
        made = call(base, "POST", "/documents", {"kind": "record", "content": {"t": 1}}, token=token)
        assert made.status == 201
        assert call(base, "GET", f"/documents/{made.json['id']}").status == 401
        assert call(base, "GET", f"/documents/{made.json['id']}", token=token).status == 200
        assert call(base, "GET", "/demo/").status == 404            # the demo page needs --demo
    finally:
        proc.terminate()
        proc.wait(15)
