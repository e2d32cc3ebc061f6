"""Compile reports kept on disk, each under a key of everything it depends on: the key of
:meth:`jaxformer.decode.exported.ExportCache.key` (sources, library versions, tracing
settings), the libtpu version and the program's inputs. Files are JSON behind their
SHA-256, written atomically; one that fails to verify is compiled again.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

from jaxformer.decode.exported import ExportCache, _read_verified, _write_atomically


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/jaxformer/compile`` (``~/.cache/jaxformer/compile``)."""
    import os

    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxformer" / "compile"


def _libtpu_version() -> str:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "none"


class ReportCache:
    """``get``/``put`` of JSON reports in ``directory`` by the inputs of the compile."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._keys = ExportCache(self.directory)

    def key(self, **inputs: Any) -> str:
        return self._keys.key("compile-report", _libtpu_version(), inputs)

    def get(self, key: str) -> dict[str, Any] | None:
        path = self.directory / f"{key}.json"
        try:
            return json.loads(_read_verified(path))
        except (OSError, ValueError):
            return None

    def put(self, key: str, report: dict[str, Any]) -> None:
        _write_atomically(self.directory / f"{key}.json", json.dumps(report, sort_keys=True).encode())
