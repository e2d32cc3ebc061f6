"""Exported decoders (``<key>.jaxexport``, ``jax.export``) and parameter shapes (``<key>.json``)
kept in a run directory, so a later translate process neither traces (the compilation cache
still does: 0.5 s for the small preset's beam search, 0.3 s for ``init``) nor compiles. A key is
a SHA-256 of all an entry depends on (jaxformer's sources, jax/jaxlib/flax versions, the JAX
settings that change a trace, the model config, the settings, the inputs' shapes and dtypes);
each file starts with its payload's SHA-256, and one that fails to load or verify is made again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np


@functools.cache
def source_digest() -> str:
    """SHA-256 of jaxformer's own ``.py`` files (names and contents), every wing."""
    root = Path(__file__).resolve().parents[1]   # the package, not this wing
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(f"{path.relative_to(root)}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    """Writes ``data`` after its SHA-256 to ``path`` by a temporary file and a rename (no half
    files), with the umask's permissions, not 0600 (a group-shared run serves other users)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".{path.name}-{secrets.token_hex(8)}"   # os.open: 0o666 less the umask
    with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
        f.write(hashlib.sha256(data).digest() + data)
    os.replace(temporary, path)


def _read_verified(path: Path) -> bytes:
    """What :func:`_write_atomically` wrote to ``path``; ``OSError`` when unreadable,
    ``ValueError`` when damaged (its SHA-256 does not match)."""
    raw = path.read_bytes()
    if hashlib.sha256(raw[32:]).digest() != raw[:32]:
        raise ValueError(f"{path} is damaged")
    return raw[32:]


class ExportCache:
    """Exported decoders and parameter shapes in ``directory`` (e.g. ``RUN/jax_cache/exported``;
    created on the first write)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def key(self, *parts: Any) -> str:
        """The entry name for ``parts`` (JSON-able), with the source and version digest."""
        import flax

        tracing = [jax.config.jax_enable_x64, str(jax.config.jax_default_matmul_precision)]
        text = json.dumps([source_digest(), jax.__version__, jaxlib.__version__, flax.__version__, tracing,
                           *parts], default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def abstract_params(self, config: Any, make: Callable[[], Any]) -> Any:
        """``make()`` (a nested dict of ``jax.ShapeDtypeStruct``: the parameters of a model
        with ``config``), read from this cache when it was made before."""
        path = self.directory / f"{self.key('params', repr(config))}.json"
        with contextlib.suppress(OSError, ValueError, TypeError, IndexError):   # missing or damaged
            return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(tuple(x[0]), np.dtype(x[1])),
                                          json.loads(_read_verified(path)), is_leaf=lambda x: type(x) is list)
        abstract = make()
        with contextlib.suppress(OSError):   # an unwritable run directory: made again next time
            _write_atomically(path, json.dumps(jax.tree_util.tree_map(
                lambda x: [list(x.shape), str(x.dtype)], abstract)).encode())
        return abstract

    def decoder(self, fn: Callable, name: str, config: Any, **static: Any) -> Callable:
        """``fn(*arrays)`` (its settings ``static`` bound) as an exported program, exported at the
        first call with a new input signature, read from disk in later processes; ``name``,
        ``config``, ``static`` (by ``repr``) and the inputs' shapes and dtypes make the key."""
        compiled: dict[str, Callable] = {}

        def call(*args):
            key = self.key("decoder", name, repr(config), sorted(static.items()),   # and the inputs' shapes
                           str(jax.tree_util.tree_structure(args)),
                           [[list(np.shape(x)), str(x.dtype)] for x in jax.tree_util.tree_leaves(args)])
            if key not in compiled:
                compiled[key] = jax.jit(self._load_or_export(key, fn, args).call)
            return compiled[key](*args)

        return call

    def _load_or_export(self, key: str, fn: Callable, args: tuple) -> jax.export.Exported:
        path = self.directory / f"{key}.jaxexport"
        with contextlib.suppress(Exception):   # missing, truncated or from elsewhere: export it again
            return jax.export.deserialize(bytearray(_read_verified(path)))
        exported = jax.export.export(jax.jit(fn))(*args)
        with contextlib.suppress(OSError, ImportError):   # unwritable, or no flatbuffers: used here only
            _write_atomically(path, bytes(exported.serialize()))
        return exported
