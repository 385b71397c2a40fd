"""A peers-bench adapter for an A/B of two pgfence checkouts' executors in ONE interleaved run.

Not imported by pgfence. To use it, copy ../shared/peers-bench to a scratch folder (the shared
copy stays as it is), copy this file there as ``adapters/pgfexecbase_adapter.py``, add
``"pgfexecbase"`` to ``ALL`` in ``adapters/__init__.py``, and run that copy's ``run.sh`` with
``PGFENCE_PROJ=<checkout B> PGFEXEC_BASE_GLUE=<checkout A>/glue --peers
baseline,pgfexec,pgfexecbase,pgfence``: ``pgfexec`` runs B's executor, ``pgfexecbase`` A's
(its pgfence package imported from PGFEXEC_BASE_GLUE; the schema is B's migrate, so only for
changes without SQL), rep by rep side by side, so a drifting host load hits both alike. Compile
A's glue for the venv's Python first (``python -m compileall``), or its first rep pays the
compile. Swap the two checkouts between series: a slot may carry an order bias.
"""
import os
import sys

from adapters import pgfexec_adapter as _x  # type: ignore[import-not-found]

DISTS = _x.DISTS
WORKER_MODEL = _x.WORKER_MODEL + " [glue: " + os.environ.get("PGFEXEC_BASE_GLUE", "?") + "]"
WAKEUP = _x.WAKEUP
DONE_SQL = _x.DONE_SQL
install = _x.install
produce_paced = _x.produce_paced
enqueue_bulk = _x.enqueue_bulk


def worker(dsn, mode, concurrency, index):
    """Run pgfexec's worker with the pgfence package under PGFEXEC_BASE_GLUE."""
    for name in [m for m in sys.modules if m == "pgfence" or m.startswith("pgfence.")]:
        del sys.modules[name]
    glue = os.environ["PGFEXEC_BASE_GLUE"]
    sys.path.insert(0, glue)
    import pgfence.executor
    assert pgfence.executor.__file__.startswith(glue), pgfence.executor.__file__
    _x.worker(dsn, mode, concurrency, index)
