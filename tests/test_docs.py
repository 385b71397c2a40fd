"""The docs cannot rot: every ```sql block of README.md and docs/*.md is run by a test, and every
reference between the docs resolves.

README.md's blocks run here, in order, through ``psql`` with ``ON_ERROR_STOP`` on one migrated
database, as a reader would paste them — after the few things they take for granted (an
``orders`` table, the ``shop.adjust_stock`` function a plan action names, a due message), which
:data:`WORLD` creates. A block whose comments announce ``ERROR <SQLSTATE>`` must stop with that
SQLSTATE at its last statement. README's superuser bootstrap block needs a cluster without
pgfence's roles: ``tests/test_install.py`` runs it. ``docs/psql.md`` is run by
``tests/test_audit_docs.py`` against the demo's data.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from test_audit_docs import sql_blocks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
#: Which test runs the sql blocks of each document (a new document with SQL must be added here).
RUN_BY = {"README.md": "tests/test_docs.py", "docs/psql.md": "tests/test_audit_docs.py",
          "docs/metrics.md": "tests/test_metrics.py", "docs/tracing.md": "tests/test_tracing.py"}
#: README's block for a fresh cluster, run by tests/test_install.py.
BOOTSTRAP = "-- once per cluster, as a superuser"

#: What README's examples take for granted, run before the block that contains the key.
WORLD = {
    "INSERT INTO orders": "CREATE TABLE public.orders (id integer PRIMARY KEY, customer text, total numeric);",
    "outbox_mark_sent_and_claim": (
        "SELECT pgfence.outbox_enqueue('orders', 'https://example.com/hook', jsonb_build_object('order', n))"
        " FROM generate_series(43, 44) AS n;"),
    "plan_register_action('stock.adjust'": """
        CREATE SCHEMA shop;
        CREATE TABLE shop.stock (sku text PRIMARY KEY, qty integer NOT NULL);
        CREATE FUNCTION shop.adjust_stock(args jsonb) RETURNS jsonb LANGUAGE sql AS $$
          INSERT INTO shop.stock AS s VALUES (args ->> 'sku', (args ->> 'delta')::int)
          ON CONFLICT (sku) DO UPDATE SET qty = s.qty + excluded.qty
          RETURNING jsonb_build_object('sku', sku, 'qty', qty)
        $$;""",
}
#: (a piece of a block, a piece its output must contain): what the README says the blocks show.
SHOWN = [
    ("outbox_mark_sent(:id, :attempt", " t\n"),
    ("pgfence.plan_steps(1)", "| next  |"),
    ("FROM pgfence.document_save(1, 1, '{\"title\": \"Q3 plan\", \"owner\": \"bob\"}', 'bob')", "conflict"),
    ("document_merge('record'", '{"owner": "bob", "title": "Q3"} | []'),
]


def psql(dsn: str, sql: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    path = tmp / "block.sql"
    path.write_text(sql)
    return subprocess.run(["psql", "-X", "-v", "ON_ERROR_STOP=1", "-v", "VERBOSITY=verbose", "-d", dsn,
                           "-f", str(path)], capture_output=True, text=True, timeout=60, check=False)


def expected_error(block: str) -> str | None:
    match = re.search(r"^--\s+ERROR (\w{5})\b", block, flags=re.M)
    return match.group(1) if match else None


def test_every_doc_with_sql_examples_is_run_by_a_test() -> None:
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        name = str(doc.relative_to(ROOT))
        if sql_blocks(doc.read_text(encoding="utf-8")):
            assert name in RUN_BY, f"{name} has ```sql blocks: run them in a test and list it in RUN_BY"


def test_every_sql_block_of_the_readme_runs(db: str, tmp_path: Path) -> None:
    blocks = [b for b in sql_blocks(README.read_text(encoding="utf-8")) if BOOTSTRAP not in b]
    assert len(blocks) >= 7
    for key in WORLD:
        assert any(key in b for b in blocks), f"no README block contains {key!r} any more"
    outputs = []
    for block in blocks:
        for key, setup in WORLD.items():
            if key in block:
                ready = psql(db, setup, tmp_path)
                assert ready.returncode == 0, ready.stderr
        proc = psql(db, block, tmp_path)
        if code := expected_error(block):
            assert proc.returncode != 0 and f"ERROR:  {code}:" in proc.stderr, \
                f"this README block should stop with {code}:\n{block}\n{proc.stderr}"
            assert proc.stderr.count("ERROR:") == 1
        else:
            assert proc.returncode == 0, f"this README block failed:\n{block}\n{proc.stderr}"
        outputs.append((block, proc.stdout))
    for piece, shown in SHOWN:
        out = "".join(o for b, o in outputs if piece in b)
        assert shown in out, f"the README block with {piece!r} does not show {shown!r}:\n{out}"


def markdown_files() -> list[Path]:
    return [README, ROOT / "functions" / "ERRORS.md", ROOT / "bench" / "README.md",
            *sorted((ROOT / "docs").glob("*.md"))]


def test_every_link_between_the_docs_resolves() -> None:
    for doc in markdown_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"


def test_the_design_the_docs_refer_to_is_in_the_repository() -> None:
    headings = {h.strip() for h in re.findall(r"^#+ (.+)$", DESIGN.read_text(encoding="utf-8"), flags=re.M)}
    old_name = "DESIGN" + ".md"  # the design document outside the repository, once referred to
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        path = ROOT / name
        if path.suffix not in (".md", ".sql", ".py", ".toml") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        assert old_name not in text, f"{name} refers to {old_name}: the design is docs/design.md"
        for section in re.findall(r'docs/design\.md\)?,? "([^"]+)"', text):
            assert section in headings, f"{name} refers to section {section!r} of docs/design.md, which has no such heading"
    assert "Roles and ownership" in headings and "The contract" in headings
