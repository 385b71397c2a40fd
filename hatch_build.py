"""Build hook: the wheel carries the SQL (migrations/, functions/, schema/) as package data.

The folders stay at the top of the repository, where readers and the design expect them; a
regular wheel gets a copy under ``pgfence/_sql/``, where :mod:`pgfence.paths` looks first. An
editable install gets no copy (hatchling's static ``force-include`` would also copy them into an
editable install, a snapshot that goes stale as the checkout changes): it reads the checkout.
"""

from __future__ import annotations

from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SQL_FOLDERS = ("migrations", "functions", "schema")


class SqlPackageData(BuildHookInterface):  # type: ignore[misc]
    """Map the top-level SQL folders into the package of a standard (non-editable) wheel."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        """Add ``<folder> -> pgfence/_sql/<folder>`` for a standard wheel (hatchling API)."""
        if self.target_name != "wheel" or version != "standard":
            return
        for folder in SQL_FOLDERS:
            build_data["force_include"][folder] = f"pgfence/_sql/{folder}"
