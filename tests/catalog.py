"""A normalised description of schema pgfence, one line per fact, to compare two databases.

:func:`catalog` reads the schema (comment, grants), every relation (tables, views, sequences,
indexes: kind, options, owner, grants, comment, view definition, index definition with its
predicate, sequence parameters), every column (position among the live ones, type, NOT NULL,
default, identity, generated, collation, comment), constraint (definition, comment), trigger
(definition, enabled, comment) and routine (the md5 of ``pg_get_functiondef`` — body, language,
volatility, SECURITY DEFINER, SET clauses —, owner, grants, comment), and the rows of every table
(the columns a time default fills are left out). Role names are kept except the installing
login's, written ``<installer>`` (the schema's owner): two databases installed by different
logins compare equal. yoyo's bookkeeping is left out unless asked for.
"""

from __future__ import annotations

from typing import Any

import psycopg

_INSTALLER = "(SELECT nspowner FROM pg_namespace WHERE nspname = 'pgfence')"
_ROLE = f"CASE WHEN {{0}} = {_INSTALLER} THEN '<installer>' ELSE pg_get_userbyid({{0}})::text END"
_ACL = f"""(SELECT coalesce(string_agg(x.item, ',' ORDER BY x.item), '-') FROM (
              SELECT format('%s=%s/%s', CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE {_ROLE.format('a.grantee')} END,
                            a.privilege_type, {_ROLE.format('a.grantor')}) AS item
              FROM aclexplode({{0}}) a) x)"""

QUERY = f"""
SELECT 'schema ' || coalesce(obj_description(n.oid, 'pg_namespace'), '-') || ' acl ' || {_ACL.format('n.nspacl')}
FROM pg_namespace n WHERE n.nspname = 'pgfence'
UNION ALL
SELECT format('rel %s kind %s persistence %s options %s owner %s acl %s comment %s view %s index %s',
              c.relname, c.relkind, c.relpersistence, c.reloptions, {_ROLE.format('c.relowner')},
              {_ACL.format('c.relacl')}, md5(coalesce(obj_description(c.oid, 'pg_class'), '-')),
              CASE WHEN c.relkind IN ('v', 'm') THEN pg_get_viewdef(c.oid) END,
              CASE WHEN c.relkind = 'i' THEN pg_get_indexdef(c.oid) END)
FROM pg_class c WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relname NOT LIKE '<yoyo>'
UNION ALL
SELECT format('seq %s %s start %s inc %s min %s max %s cache %s cycle %s', c.relname, format_type(s.seqtypid, NULL),
              s.seqstart, s.seqincrement, s.seqmin, s.seqmax, s.seqcache, s.seqcycle)
FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relname NOT LIKE '<yoyo>'
UNION ALL
SELECT format('col %s.%s #%s %s notnull %s default %s identity %s generated %s collation %s comment %s',
              c.relname, a.attname, row_number() OVER (PARTITION BY a.attrelid ORDER BY a.attnum),
              format_type(a.atttypid, a.atttypmod), a.attnotnull, pg_get_expr(d.adbin, d.adrelid),
              a.attidentity, a.attgenerated, a.attcollation, md5(coalesce(col_description(a.attrelid, a.attnum), '-')))
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relname NOT LIKE '<yoyo>' AND a.attnum > 0 AND NOT a.attisdropped
UNION ALL
SELECT format('con %s on %s %s comment %s', k.conname, k.conrelid::regclass, pg_get_constraintdef(k.oid),
              md5(coalesce(obj_description(k.oid, 'pg_constraint'), '-')))
FROM pg_constraint k WHERE k.connamespace = 'pgfence'::regnamespace AND k.conname NOT LIKE '<yoyo>'
UNION ALL
SELECT format('trg %s enabled %s comment %s', pg_get_triggerdef(t.oid), t.tgenabled,
              md5(coalesce(obj_description(t.oid, 'pg_trigger'), '-')))
FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
WHERE c.relnamespace = 'pgfence'::regnamespace AND NOT t.tgisinternal
UNION ALL
SELECT format('fn %s kind %s def %s owner %s acl %s comment %s', p.oid::regprocedure, p.prokind,
              md5(pg_get_functiondef(p.oid)), {_ROLE.format('p.proowner')}, {_ACL.format('p.proacl')},
              md5(coalesce(obj_description(p.oid, 'pg_proc'), '-')))
FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace
"""

_DATA_COLUMNS = """
SELECT c.oid::regclass::text, string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum)
FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind = 'r' AND c.relname NOT LIKE '%yoyo%'
  AND c.relname <> 'installed_migration'
  AND NOT (d.adbin IS NOT NULL AND format_type(a.atttypid, NULL) LIKE 'timestamp%')
GROUP BY c.oid ORDER BY 1
"""


def catalog(conn_or_dsn: str | psycopg.Connection[Any], *, yoyo: bool = False, data: bool = True) -> list[str]:
    """The sorted description of schema pgfence (see the module docstring).

    Args:
        conn_or_dsn: a connection, or a DSN to open one.
        yoyo: include yoyo's bookkeeping tables (present once ``pgfence migrate`` ran).
        data: include the tables' rows (the rows of ``installed_migration`` never are).
    """
    if isinstance(conn_or_dsn, str):
        with psycopg.connect(conn_or_dsn) as conn:
            return catalog(conn, yoyo=yoyo, data=data)
    conn = conn_or_dsn
    query = QUERY.replace("'<yoyo>'", "'-'" if yoyo else "'%yoyo%'")
    lines = [str(r[0]) for r in conn.execute(query)]
    if data:
        for table, cols in conn.execute(_DATA_COLUMNS).fetchall():
            rows = conn.execute(f"SELECT {cols} FROM {table} ORDER BY 1").fetchall()
            lines += [f"row {table} {row}" for row in rows]
    return sorted(lines)


def diff(a: list[str], b: list[str], limit: int = 20) -> str:
    """The lines only in ``a`` (-) and only in ``b`` (+), at most ``limit`` of each."""
    only_a = sorted(set(a) - set(b))[:limit]
    only_b = sorted(set(b) - set(a))[:limit]
    return "\n".join([f"- {x}" for x in only_a] + [f"+ {x}" for x in only_b])
