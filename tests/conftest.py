"""Shared pytest fixtures: a real PostgreSQL, a migrated template, a fresh database per test.

The server is ``$DATABASE_URL`` (``make test`` starts a throwaway cluster and sets it); when it is
unset, this session starts its own embedded cluster and stops it at the end. The role must be
allowed to create databases. Every test that asks for ``db`` gets a new database cloned from a
template that was migrated once, so tests never see each other's rows. The template is installed
as a production database should be: by a login that is not a superuser (``support.OWNER``); the
tests connect as the server's admin login (a superuser, when the server is the throwaway one).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from pgfence.db import create_database, drop_database
from pgfence.embedded import ClusterInfo, EmbeddedPostgres
from pgfence_demo.receivers import SmtpSink, WebhookReceiver
from support import install_as_owner


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterInfo | None]:
    """The embedded cluster this session started, or None when ``$DATABASE_URL`` is set.

    Tests that restart the server need it: with ``DATABASE_URL`` set they start a cluster of
    their own (see ``tests/test_executor_crash.py``).
    """
    if os.environ.get("DATABASE_URL"):
        yield None
        return
    pg = EmbeddedPostgres()
    info = pg.start()
    os.environ["DATABASE_URL"] = info.url
    try:
        yield info
    finally:
        os.environ.pop("DATABASE_URL", None)
        pg.stop()


@pytest.fixture()
def own_cluster() -> Iterator[ClusterInfo]:
    """A new throwaway cluster for this test alone (to restart it, or to start without any
    pgfence role), stopped and removed after."""
    pg = EmbeddedPostgres()
    info = pg.start()
    try:
        yield info
    finally:
        pg.stop()


@pytest.fixture(scope="session")
def admin_dsn(cluster: ClusterInfo | None) -> str:
    """DSN of the maintenance database (``postgres``) on the test server."""
    return os.environ["DATABASE_URL"]


@pytest.fixture(scope="session")
def template_db(admin_dsn: str) -> Iterator[str]:
    """Name of a database migrated once per session (by a non-superuser owner), cloned by :func:`db`."""
    name = f"pgfence_tpl_{os.getpid()}"
    drop_database(admin_dsn, name)
    install_as_owner(admin_dsn, name)
    try:
        yield name
    finally:
        drop_database(admin_dsn, name)


@pytest.fixture()
def db(admin_dsn: str, template_db: str) -> Iterator[str]:
    """DSN of a brand-new migrated database for this test; dropped (sessions killed) after."""
    name = f"pgfence_t_{uuid.uuid4().hex[:12]}"
    dsn = create_database(admin_dsn, name, template=template_db)
    try:
        yield dsn
    finally:
        drop_database(admin_dsn, name)


@pytest.fixture()
def empty_db(admin_dsn: str) -> Iterator[str]:
    """DSN of a brand-new database without pgfence (for migrate tests)."""
    name = f"pgfence_e_{uuid.uuid4().hex[:12]}"
    dsn = create_database(admin_dsn, name)
    try:
        yield dsn
    finally:
        drop_database(admin_dsn, name)


@pytest.fixture()
def conn(db: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit connection to :func:`db`."""
    with psycopg.connect(db, autocommit=True) as c:
        yield c


@pytest.fixture()
def webhook() -> Iterator[WebhookReceiver]:
    """A real HTTP receiver on a free local port (``.url``, ``.hits``), closed after."""
    rec = WebhookReceiver()
    yield rec
    rec.close()


@pytest.fixture()
def smtp() -> Iterator[SmtpSink]:
    """A real SMTP sink on a free local port (``.url``), closed after."""
    sink = SmtpSink()
    yield sink
    sink.close()
