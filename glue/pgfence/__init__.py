"""pgfence: durable step execution and versioned documents built into PostgreSQL.

The SQL contract lives in the database (schema ``pgfence``); this package is thin glue:
migrations (:mod:`pgfence.migrate`), a CLI (:mod:`pgfence.cli`), an executor that performs
external side effects (:mod:`pgfence.executor`), and typed wrappers around the SQL functions
(:mod:`pgfence.outbox`).
"""

__version__ = "0.1.0"

#: The schema version (``pgfence.schema_version()``) this glue was written for. The glue refuses
#: to run against any other: an older database needs ``pgfence migrate``, a newer one a newer
#: pgfence.
SCHEMA_VERSION = 34
