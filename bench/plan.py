"""Plan benchmark: steps per second of ``CALL pgfence.plan_execute`` on 1,000-step plans.

Each step is its own committed transaction (lock the plan row, run the action in a
subtransaction, write the receipt, move the plan on), so with fsync on
the number is bounded by commit latency. Two trivial SQL actions are measured:

- ``noop``: returns its args (the pure cost of pgfence's per-step bookkeeping);
- ``insert``: inserts one row into a table (a step with a real database effect).

Next to each, in the same run (issue 14's target: a pgfence step >= 0.9x of it), a hand-written
equivalent: a procedure that, per step and in one committed transaction, locks the run's row
(``SELECT ... FOR UPDATE``), runs the action (``EXECUTE``, as any runner of named actions must),
inserts the receipt and moves the run on. It has none of pgfence's guarantees beyond that: no
owner or token check, no heartbeat, no check that the action is the approved one, no error
receipt, no event log, no PF107 stamp (a receipt only from the transaction that began the step).

``run(dsn)`` is what ``bench/run.py`` calls; it migrates the database (a no-op when up to
date), creates its fixtures (table ``public.bench_plan_rows``, two functions, two actions),
runs each variant ``repeats`` times and returns the numbers. Standalone:
``pgfence db run --durable -- python bench/plan.py`` (or with ``DATABASE_URL`` set).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import psycopg

from pgfence import plan
from pgfence.migrate import migrate

STEPS = 1000
TARGET = 0.9

_SETUP = """
CREATE TABLE IF NOT EXISTS public.bench_plan_rows (plan_id bigint, step int, PRIMARY KEY (plan_id, step));
CREATE OR REPLACE FUNCTION public.bench_plan_noop(p jsonb) RETURNS jsonb
  LANGUAGE sql AS $$ SELECT p $$;
CREATE OR REPLACE FUNCTION public.bench_plan_insert(p jsonb) RETURNS jsonb
  LANGUAGE sql SET search_path = public AS $$
  INSERT INTO bench_plan_rows VALUES ((p ->> 'plan')::bigint, (p ->> 'step')::int);
  SELECT '{}'::jsonb
$$;
CREATE TABLE IF NOT EXISTS public.bench_hand_run (id bigint PRIMARY KEY, next_step int NOT NULL,
                                                  step_count int NOT NULL);
CREATE TABLE IF NOT EXISTS public.bench_hand_receipt (run_id bigint, step int, output jsonb,
                                                      at timestamptz NOT NULL DEFAULT now(),
                                                      PRIMARY KEY (run_id, step));
CREATE OR REPLACE PROCEDURE public.bench_hand_execute(p_run bigint, p_fn text, p_tag text)
LANGUAGE plpgsql AS $$
DECLARE
  v_run public.bench_hand_run;
  v_out jsonb;
BEGIN
  LOOP
    SELECT * INTO v_run FROM public.bench_hand_run WHERE id = p_run FOR UPDATE;
    EXIT WHEN v_run.next_step > v_run.step_count;
    EXECUTE format('SELECT %s($1)', p_fn) INTO v_out
      USING jsonb_build_object('plan', p_tag, 'step', v_run.next_step);
    INSERT INTO public.bench_hand_receipt (run_id, step, output) VALUES (p_run, v_run.next_step, v_out);
    UPDATE public.bench_hand_run SET next_step = next_step + 1 WHERE id = p_run;
    COMMIT;
  END LOOP;
END
$$;
"""


def _backend_cpu(conn: psycopg.Connection[Any]) -> float | None:
    """CPU seconds (user + system) the connection's backend has used so far, or None.

    Read from ``/proc/<backend pid>/stat``, so only when the server runs on this machine and
    its processes are readable (``pgfence db run``); None otherwise.
    """
    try:
        with open(f"/proc/{conn.info.backend_pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_ms_per_step(before: float | None, after: float | None) -> float | None:
    """Backend CPU per step in ms between two :func:`_backend_cpu` readings (None if unknown)."""
    if before is None or after is None:
        return None
    return round((after - before) / STEPS * 1000, 3)


def _one_run(conn: psycopg.Connection[Any], action: str, tag: str) -> float:
    """Propose, approve and CALL plan_execute one 1,000-step plan; return its steps/s."""
    steps = [{"action": action, "args": {"plan": tag, "step": i}} for i in range(1, STEPS + 1)]
    pid = plan.propose(conn, steps, "bench")
    plan.approve(conn, pid, "bench-approver")
    started = time.perf_counter()
    result = plan.execute(conn, pid, "bench-runner")
    elapsed = time.perf_counter() - started
    if result.status != "executed" or len(result.receipts) != STEPS:
        raise RuntimeError(f"plan {pid} ended {result.status} with {len(result.receipts)} receipts")
    return STEPS / elapsed


def _one_hand_run(conn: psycopg.Connection[Any], fn: str, run_id: int) -> float:
    """The hand-written runner over STEPS steps; return its steps/s."""
    conn.execute("INSERT INTO public.bench_hand_run VALUES (%s, 1, %s)", (run_id, STEPS))
    started = time.perf_counter()
    conn.execute("CALL public.bench_hand_execute(%s, %s, %s)", (run_id, fn, str(run_id)))
    elapsed = time.perf_counter() - started
    row = conn.execute("SELECT count(*) FROM public.bench_hand_receipt WHERE run_id = %s",
                       (run_id,)).fetchone()
    if row is None or row[0] != STEPS:
        raise RuntimeError(f"hand-written run {run_id} wrote {row} receipts")
    return STEPS / elapsed


def run(dsn: str, repeats: int = 3) -> dict[str, Any]:
    """Measure; returns ``{"steps": 1000, "<variant>_steps_per_s": median, ...}``.

    Per variant also ``<variant>_cpu_ms_per_step`` and ``<variant>_hand_cpu_ms_per_step``: the
    median backend CPU per step in ms (None when the server is not local, see _backend_cpu).
    """
    migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_SETUP)
        conn.execute("TRUNCATE public.bench_plan_rows")
        plan.register_action(conn, "bench.noop", "public.bench_plan_noop(jsonb)",
                             "benchmark: return the args")
        plan.register_action(conn, "bench.insert", "public.bench_plan_insert(jsonb)",
                             "benchmark: insert one row")
        fsync = conn.execute("SHOW fsync").fetchone()
        sync_commit = conn.execute("SHOW synchronous_commit").fetchone()
        out: dict[str, Any] = {
            "steps": STEPS, "repeats": repeats,
            "fsync": fsync[0] if fsync else None,
            "synchronous_commit": sync_commit[0] if sync_commit else None,
        }
        conn.execute("TRUNCATE public.bench_hand_run, public.bench_hand_receipt")
        for v, variant in enumerate(("noop", "insert")):
            rates, hand, cpu, hand_cpu = [], [], [], []
            for i in range(repeats):  # interleaved: pgfence, hand-written, pgfence, ...
                c0 = _backend_cpu(conn)
                rates.append(_one_run(conn, f"bench.{variant}", f"{v * 100 + i}"))
                c1 = _backend_cpu(conn)
                hand.append(_one_hand_run(conn, f"public.bench_plan_{variant}",
                                          1000 + v * 100 + i))
                c2 = _backend_cpu(conn)
                cpu.append(_cpu_ms_per_step(c0, c1))
                hand_cpu.append(_cpu_ms_per_step(c1, c2))
            # Backend CPU per step (ms): the cost that the wall-clock ratio hides behind commit
            # latency and machine load. None when the server's processes are not readable here.
            known = [c for c in cpu if c is not None]
            hand_known = [c for c in hand_cpu if c is not None]
            out[f"{variant}_cpu_ms_per_step"] = statistics.median(known) if known else None
            out[f"{variant}_hand_cpu_ms_per_step"] = statistics.median(hand_known) if hand_known else None
            out[f"{variant}_steps_per_s"] = round(statistics.median(rates), 1)
            out[f"{variant}_runs"] = [round(r, 1) for r in rates]
            out[f"{variant}_hand_steps_per_s"] = round(statistics.median(hand), 1)
            out[f"{variant}_hand_runs"] = [round(r, 1) for r in hand]
            out[f"{variant}_ratio"] = round(out[f"{variant}_steps_per_s"]
                                            / out[f"{variant}_hand_steps_per_s"], 2)
    print(f"plan: CALL plan_execute, {STEPS}-step plan, median of {repeats}: "
          f"{out['noop_steps_per_s']} steps/s (noop action), "
          f"{out['insert_steps_per_s']} steps/s (one INSERT per step); "
          f"fsync={out['fsync']}, synchronous_commit={out['synchronous_commit']}")
    for variant in ("noop", "insert"):
        ratio = out[f"{variant}_ratio"]
        print(f"  hand-written runner ({variant}): {out[f'{variant}_hand_steps_per_s']} steps/s;"
              f" target: pgfence >= {TARGET}x of it: {ratio}x {'MET' if ratio >= TARGET else 'MISSED'};"
              f" backend CPU per step {out[f'{variant}_cpu_ms_per_step']} ms"
              f" (hand-written {out[f'{variant}_hand_cpu_ms_per_step']} ms)")
    return out


def main() -> int:
    dsn = os.environ.get("DATABASE_URL")
    if not dsn:
        print("set DATABASE_URL, or: pgfence db run --durable -- python bench/plan.py",
              file=sys.stderr)
        return 2
    print(json.dumps(run(dsn), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
