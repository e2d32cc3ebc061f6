"""A checkpoint's parameters as orbax recorded them (names and shapes), checked against a
model's and read in the layer layout they were saved in (:mod:`jaxformer.model.scan`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxformer.model import scan


class CheckpointMismatchError(ValueError):
    """A checkpoint's parameters have other names or shapes than the model's."""


def check_params_match(saved: Any, abstract_params: Any, where: str) -> None:
    """Raises :class:`CheckpointMismatchError` unless ``saved`` (metadata or arrays) has exactly
    ``abstract_params``' names and shapes (a partial restore would read a subset silently)."""
    def shapes(tree):
        return {jax.tree_util.keystr(path): tuple(leaf.shape)
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    have, want = shapes(saved), shapes(abstract_params)
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    reshaped = sorted(f"{k}: saved {have[k]} vs model {want[k]}" for k in want.keys() & have.keys()
                      if have[k] != want[k])
    if missing or extra or reshaped:
        def brief(items):
            return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
        parts = ([f"missing from the checkpoint: {brief(missing)}"] if missing else []) + (
            [f"not in the model: {brief(extra)}"] if extra else []) + (
            [f"other shapes: {brief(reshaped)}"] if reshaped else [])
        raise CheckpointMismatchError(
            f"{where} does not hold this model's parameters ({'; '.join(parts)}). Does config.json "
            f"still describe the run that saved it? Restore the run's own config.json.")


def saved_params(path: Path, key: str | None) -> Any:
    """The names and shapes stored at ``path`` (under ``key``), from orbax's item metadata."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(path).tree
    finally:
        handler.close()
    return tree[key] if key is not None else tree


def in_layout(saved: Any, abstract: Any, restore: Callable[[Any], Any]) -> Any:
    """``restore(target)`` into ``abstract``; a ``saved`` of the other layer layout (scanned or
    unrolled) is read in its own first, then converted."""
    saved_scanned, want_scanned = scan.layout_of(saved), scan.layout_of(abstract)
    if saved_scanned is None or want_scanned is None or saved_scanned == want_scanned:
        return restore(abstract)
    target = scan.to_layout(abstract, saved_scanned)
    restored = restore(target)
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, abstract)
    return jax.jit(lambda tree: scan.to_layout(tree, want_scanned), out_shardings=shardings)(restored)
