"""Where the SQL sources live.

In a source checkout (``pip install -e .``) they are the top-level ``migrations/``,
``functions/`` and ``schema/`` folders next to ``glue/``. ``$PGFENCE_SQL_ROOT`` overrides that,
for installs that ship the folders elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path


def sql_root() -> Path:
    """Return the folder that holds ``migrations/`` and ``functions/``.

    Raises:
        FileNotFoundError: neither ``$PGFENCE_SQL_ROOT`` nor the source checkout has them.
    """
    candidates = []
    if env := os.environ.get("PGFENCE_SQL_ROOT"):
        candidates.append(Path(env))
    candidates.append(Path(__file__).resolve().parents[2])
    for root in candidates:
        if (root / "migrations").is_dir() and (root / "functions").is_dir():
            return root
    raise FileNotFoundError(
        "pgfence SQL sources (migrations/, functions/) not found; set PGFENCE_SQL_ROOT "
        f"(looked in: {', '.join(map(str, candidates))})"
    )


def migrations_dir() -> Path:
    """The yoyo migrations folder (forward-only table changes)."""
    return sql_root() / "migrations"


def functions_dir() -> Path:
    """The re-runnable functions/views folder, applied in file-name order."""
    return sql_root() / "functions"
