"""Demo scene: the documents over HTTP — ``pgfence serve``'s app on a real port, two users
saving one record (409 with the stored copy, the merge endpoint, the merged save), a retried
save answered ``replayed``, a save without a version (428), a request without a user (401),
and the demo page and browser module being served. Headless: plain HTTP, no browser."""

from __future__ import annotations

import http.client
import json
from typing import Any

import click

from . import DemoContext

TITLE = "Documents over HTTP: pgfence serve, If-Match + Idempotency-Key, 409 with the stored copy"


class _Http:
    def __init__(self, base: str) -> None:
        self.host, port = base.removeprefix("http://").split(":")
        self.port = int(port)

    def __call__(self, method: str, path: str, body: Any = None, *, user: str | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        from pgfence.web import DEMO_USER_HEADER

        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        hdrs = dict(headers or {})
        if user is not None:
            hdrs[DEMO_USER_HEADER] = user
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            hdrs["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=hdrs)
            res = conn.getresponse()
            raw = res.read()
            ctype = res.getheader("Content-Type") or ""
            parsed = json.loads(raw) if raw and "json" in ctype else raw
            return res.status, {k.lower(): v for k, v in res.getheaders()}, parsed
        finally:
            conn.close()


def _scenes(ctx: DemoContext, call: _Http) -> None:
    status, hdrs, made = call("POST", "/documents", {"kind": "record", "content": {
        "title": "Q3 plan", "owner": "ann", "budget": 100}}, user="ann")
    doc = made["id"]
    ctx.check(status == 201 and hdrs.get("etag") == '"1"',
              f"POST /documents → 201, record #{doc} at version 1 (ETag \"1\")")

    _, hdrs, got = call("GET", f"/documents/{doc}", user="bob")
    ctx.step(f"ann and bob both GET it: ETag {hdrs.get('etag')}, content {json.dumps(got['content'])}")

    status, _, saved = call("PUT", f"/documents/{doc}", {"content": {**got["content"],
                            "title": "Q3 plan (final)"}}, user="ann",
                            headers={"If-Match": '"1"', "Idempotency-Key": "ann-1"})
    ctx.check(status == 200 and saved["version"] == 2 and saved["saved_by"] == "ann",
              "ann: PUT with If-Match \"1\" → 200, version 2 (saved_by from the server's auth)")

    bob = {**got["content"], "budget": 150}
    status, hdrs, conflict = call("PUT", f"/documents/{doc}", {"content": bob}, user="bob",
                                  headers={"If-Match": '"1"', "Idempotency-Key": "bob-1"})
    ctx.check(status == 409 and conflict["error"] == "version_conflict"
              and conflict["version"] == 2 and conflict["content"]["title"] == "Q3 plan (final)",
              "bob: PUT on version 1 → 409 version_conflict, with the stored version 2 and its "
              "content in the same answer (nothing overwritten)")

    status, _, merged = call("POST", f"/documents/{doc}/merge", {
        "base": got["content"], "local": bob, "stored": conflict["content"]}, user="bob")
    ctx.check(status == 200 and merged["clean"],
              f"POST …/merge (the record kind's merge, in SQL) → clean: {json.dumps(merged['content'])}")

    status, _, saved = call("PUT", f"/documents/{doc}", {"content": merged["content"]},
                            user="bob", headers={"If-Match": f'"{conflict["version"]}"',
                                                 "Idempotency-Key": "bob-2"})
    ctx.check(status == 200 and saved["version"] == 3, "bob saves the merge on version 2 → 3")

    status, _, again = call("PUT", f"/documents/{doc}", {"content": merged["content"]},
                            user="bob", headers={"If-Match": '"2"', "Idempotency-Key": "bob-2"})
    ctx.check(status == 200 and again["replayed"] and again["version"] == 3,
              "the same PUT again (its answer was lost, say): 200 replayed, still version 3 — "
              "one version, no false conflict")

    status, _, err = call("PUT", f"/documents/{doc}", {"content": {}}, user="bob",
                          headers={"Idempotency-Key": "bob-3"})
    ctx.check(status == 428 and err["error"] == "precondition_required",
              "a PUT without If-Match or expectedVersion → 428: no blind overwrite")

    status, _, err = call("GET", f"/documents/{doc}")
    ctx.check(status == 401 and err["error"] == "unauthenticated",
              "a request that names no user → 401 (who saves comes from the server)")

    status, _, err = call("PUT", f"/documents/{doc}", {"content": {"title": "x" * 1_100_000}},
                          user="bob", headers={"If-Match": '"3"', "Idempotency-Key": "big"})
    ctx.check(status == 413 and err["sqlstate"] == "PF301",
              f"content over the kind's max_bytes → 413 {err['error']} [{err['sqlstate']}]")

    page, _, html = call("GET", "/demo/")
    module, hdrs, _ = call("GET", "/static/pgfence-documents.js")
    ctx.check(page == 200 and b"pgfence documents" in html and module == 200
              and "javascript" in hdrs.get("content-type", ""),
              "the demo page and the browser module (pgfence-documents.js) are served")


def run(ctx: DemoContext) -> None:
    try:
        from pgfence.web import DEMO_USER_HEADER, ServerThread, serve_app, trusted_header_auth
    except ModuleNotFoundError as exc:
        ctx.check(False, f"the web extra is not installed ({exc.name}): pip install 'pgfence[web]'")
        return
    app = serve_app(dsn=ctx.dsn, authenticate=trusted_header_auth(DEMO_USER_HEADER), demo=True)
    with ServerThread(app) as server:
        click.echo(click.style(f"   demo page: {server.url}/demo/?user=ann", bold=True)
                   + "  (up while this scene runs; `pgfence serve --demo` keeps one up for you)")
        click.echo(click.style(f"   console:   {server.url}/console/?user=ann", bold=True)
                   + "  (queues and their rates, stuck items, duplicates, executors, timelines)")
        _scenes(ctx, _Http(server.url))
