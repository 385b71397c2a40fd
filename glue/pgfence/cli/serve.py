"""``pgfence serve``: the documents over HTTP; ``pgfence token``: a bearer token for it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ._common import CliState, pass_state

SECRET_ENV = "PGFENCE_WEB_SECRET"
_WEB_MISSING = ("pgfence serve needs the web extra: pip install 'pgfence[web]' "
                "(Starlette and uvicorn)")


def _secret(secret_file: Path | None) -> bytes | None:
    if secret_file is not None:
        return secret_file.read_bytes().strip()
    env = os.environ.get(SECRET_ENV)
    return env.encode() if env else None


secret_option = click.option(
    "--secret-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help=f"File holding the token secret (>= 32 bytes). Default: ${SECRET_ENV}.")


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535),
              help="Port (0 = any free).")
@secret_option
@click.option("--dev-trusted-header", metavar="HEADER",
              help="DEVELOPMENT ONLY: believe the user named in this request header (e.g. "
                   "X-Pgfence-User) instead of checking a signed token. Loopback addresses only.")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Allow this origin cross-origin (repeatable). Default: no CORS.")
@click.option("--max-body-bytes", default=2 * 1024 * 1024, show_default=True,
              type=click.IntRange(min=1),
              help="Larger request bodies are answered 413.")
@click.option("--demo", is_flag=True,
              help="Serve the demo page at /demo/ with the trusted header X-Pgfence-User, on a "
                   "throwaway PostgreSQL unless --dsn / DATABASE_URL is given; runs until Ctrl-C.")
@pass_state
def serve_cmd(state: CliState, host: str, port: int, secret_file: Path | None,
              dev_trusted_header: str | None, cors_origins: tuple[str, ...],
              max_body_bytes: int, demo: bool) -> None:
    """Serve the documents API (and the browser module at /static/pgfence-documents.js).

    \b
    Who saves comes from the server, never from the request body:
      - default: Authorization: Bearer <token>, tokens signed with the secret in
        $PGFENCE_WEB_SECRET (or --secret-file); mint one with `pgfence token USER`;
      - --dev-trusted-header HEADER: the header names the user, unchecked (development
        on a loopback address only).
    """
    try:
        from ..web import auth
        from ..web.server import DEMO_USER_HEADER, bind, serve_app, uvicorn_server
    except ModuleNotFoundError as exc:
        if exc.name in ("starlette", "uvicorn"):
            raise click.ClickException(_WEB_MISSING) from exc
        raise
    if demo and dev_trusted_header is None:
        dev_trusted_header = DEMO_USER_HEADER
    if dev_trusted_header is not None:
        if not auth.is_loopback_name(host):
            raise click.UsageError(f"--dev-trusted-header lets anyone claim to be anyone; it is "
                                   f"refused on {host}: use a loopback address (127.0.0.1)")
        authenticate = auth.trusted_header_auth(dev_trusted_header)
        mode = f"DEV MODE: the user is whatever the {dev_trusted_header} header says"
    else:
        secret = _secret(secret_file)
        if secret is None:
            raise click.UsageError(
                f"no token secret: set {SECRET_ENV} (>= 32 bytes, e.g. `openssl rand -hex 32`) "
                "or pass --secret-file; for local development only, --dev-trusted-header "
                "X-Pgfence-User")
        try:
            authenticate = auth.bearer_token_auth(secret)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
        mode = "users authenticate with Bearer tokens (pgfence token USER)"

    def run(dsn: str) -> None:
        from ..db import connect

        # Fail here, not on every request: unreachable (exit 1) or not migrated (SchemaMismatch).
        connect(dsn, connect_timeout=10).close()
        app = serve_app(dsn=dsn, authenticate=authenticate, demo=demo,
                        cors_origins=cors_origins, max_body_bytes=max_body_bytes)
        try:
            sock = bind(host, port)
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from exc
        base = f"http://{'[' + host + ']' if ':' in host else host}:{sock.getsockname()[1]}"
        click.echo(f"pgfence serve: {base}/documents  ({mode})")
        click.echo(f"  browser module: {base}/static/pgfence-documents.js")
        click.echo(f"  console:        {base}/console/" + ("?user=ann" if demo else ""))
        if demo:
            click.echo(f"  demo page:      {base}/demo/?user=ann   (open it in two tabs, or a "
                       "second user with ?user=bob)")
        click.echo("  Ctrl-C stops it.")
        sys.stdout.flush()
        try:
            uvicorn_server(app, log_level="info" if demo else "warning",
                           access_log=False).run(sockets=[sock])
        except KeyboardInterrupt:       # uvicorn re-raises the Ctrl-C it handled
            click.echo("pgfence serve: stopped")

    dsn = state.dsn or os.environ.get("DATABASE_URL")
    if not demo or dsn:
        from ..db import resolve_dsn
        run(resolve_dsn(dsn))
        return
    from ..db import create_database, drop_database
    from ..embedded import EmbeddedPostgres
    from ..migrate import migrate

    pg = EmbeddedPostgres()
    info = pg.start()
    try:
        click.echo(f"throwaway PostgreSQL started in {info.root}")
        drop_database(info.url, "pgfence_demo")
        demo_dsn = create_database(info.url, "pgfence_demo")
        migrate(demo_dsn)
        run(demo_dsn)
    finally:
        pg.stop()
        click.echo("throwaway PostgreSQL stopped and removed")


@click.command("token")
@click.argument("user")
@click.option("--ttl", default=3600.0, show_default=True, type=float, help="Seconds valid.")
@click.option("--read-only", is_flag=True, help="Only the read scope (GET, merge): saves get 403.")
@secret_option
def token_cmd(user: str, ttl: float, read_only: bool, secret_file: Path | None) -> None:
    """Print a bearer token for USER, signed with the secret `pgfence serve` checks.

    Send it as `Authorization: Bearer <token>`. USER is stored as saved_by.
    """
    try:
        from ..web import auth
    except ModuleNotFoundError as exc:
        if exc.name in ("starlette", "uvicorn"):
            raise click.ClickException(_WEB_MISSING) from exc
        raise
    secret = _secret(secret_file)
    if secret is None:
        raise click.UsageError(f"no token secret: set {SECRET_ENV} or pass --secret-file")
    scopes = [auth.READ] if read_only else [auth.READ, auth.WRITE]
    try:
        click.echo(auth.sign_token(secret, user, ttl=ttl, scopes=scopes))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
