"""One model's parameters in two layouts: unrolled stacks hold ``layer_0 … layer_{N-1}``,
scanned ones a subtree ``layers`` with leaves ``[N, ...]``. The converters take any tree
holding the stacks (variables, a train state, its abstract form), so checkpoints restore
into either layout and cached decoding unrolls a scanned model (:func:`unrolled`).
"""

from __future__ import annotations

import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

SCANNED = "layers"
_LAYER = re.compile(r"layer_(\d+)")
_STACKS = ("encoder", "decoder")


def _stack_leaves(leaves: list[Any]) -> Any:
    first = leaves[0]
    if isinstance(first, nn.Partitioned):
        return first.replace_boxed(_stack_leaves([x.unbox() for x in leaves])).replace(
            names=(SCANNED,) + tuple(first.names))
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
        return jax.ShapeDtypeStruct((len(leaves),) + tuple(first.shape), first.dtype, sharding=sharding)
    return jnp.stack(leaves)


def _unstack_leaf(leaf: Any, count: int) -> list[Any]:
    if isinstance(leaf, nn.Partitioned):
        return [leaf.replace(value=v, names=tuple(leaf.names)[1:])
                for v in _unstack_leaf(leaf.unbox(), count)]
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
        return [jax.ShapeDtypeStruct(tuple(leaf.shape)[1:], leaf.dtype, sharding=sharding)] * count
    return [leaf[i] for i in range(count)]


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (nn.Partitioned, jax.ShapeDtypeStruct))


def _stack_dict(tree: dict, parent: str | None) -> dict:
    layer_keys = [k for k in tree if isinstance(k, str) and _LAYER.fullmatch(k)]
    out = {k: _stack_dict(v, k) if isinstance(v, dict) else v
           for k, v in tree.items() if k not in layer_keys}
    if parent in _STACKS and layer_keys:   # layer_0 … layer_{N-1}; a gap is a KeyError
        layers = [tree[f"layer_{i}"] for i in range(len(layer_keys))]
        out[SCANNED] = jax.tree_util.tree_map(lambda *xs: _stack_leaves(list(xs)), *layers, is_leaf=_is_leaf)
    return out


def _unstack_dict(tree: dict, parent: str | None) -> dict:
    out = {k: _unstack_dict(v, k) if isinstance(v, dict) else v
           for k, v in tree.items() if not (parent in _STACKS and k == SCANNED)}
    if parent in _STACKS and SCANNED in tree:
        leaves, treedef = jax.tree_util.tree_flatten(tree[SCANNED], is_leaf=_is_leaf)
        first = leaves[0].unbox() if isinstance(leaves[0], nn.Partitioned) else leaves[0]
        count = int(first.shape[0])
        per_leaf = [_unstack_leaf(leaf, count) for leaf in leaves]
        for i in range(count):
            out[f"layer_{i}"] = jax.tree_util.tree_unflatten(treedef, [rows[i] for rows in per_leaf])
    return out


def _map_dicts(fn, tree: Any) -> Any:
    """``fn(d, None)`` on every outermost dict of ``tree`` (a dict, or a pytree holding dicts)."""
    if isinstance(tree, dict):
        return fn(tree, None)
    return jax.tree_util.tree_map(lambda x: fn(x, None) if isinstance(x, dict) else x, tree,
                                  is_leaf=lambda x: isinstance(x, dict))


def stack_layers(tree: Any) -> Any:
    """The scanned layout of ``tree`` (as it is if scanned): each ``encoder``/``decoder``'s
    ``layer_i`` become one ``layers`` subtree of arrays (jit-safe), ``ShapeDtypeStruct`` (an
    unsharded leading axis) or ``nn.Partitioned`` (``layers`` prepended) leaves ``[N, ...]``."""
    return _map_dicts(_stack_dict, tree)


def unstack_layers(tree: Any) -> Any:
    """The unrolled layout of ``tree``, the inverse of :func:`stack_layers` (row ``i`` → ``layer_i``)."""
    return _map_dicts(_unstack_dict, tree)


def layout_of(tree: Any) -> bool | None:
    """Whether ``tree``'s (or orbax metadata's) stacks are scanned; ``None``: no layer stack."""
    for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        for parent, child in zip(names, names[1:]):
            if parent in _STACKS:
                if child == SCANNED:
                    return True
                if _LAYER.fullmatch(child):
                    return False
    return None


def to_layout(tree: Any, scanned: bool) -> Any:
    """:func:`stack_layers` if ``scanned`` else :func:`unstack_layers`."""
    return stack_layers(tree) if scanned else unstack_layers(tree)


def unrolled(model: nn.Module, variables: Any) -> tuple[nn.Module, Any]:
    """``(model, variables)`` of a ``Transformer`` with unrolled layers (as they are if not
    scanned; ``variables``: ``{"params": …}`` or bare), what cached decoding runs."""
    if not model.config.scan_layers:
        return model, variables
    return type(model)(model.config.replace(scan_layers=False)), unstack_layers(variables)
