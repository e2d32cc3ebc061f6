"""Checkpoint averaging (``--average-last N``, §6.1; fairseq's ``average_checkpoints.py``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxformer.run.checkpoints import RunCheckpoints


def average_last_checkpoints(checkpoints: RunCheckpoints, abstract_params: Any, n: int
                             ) -> tuple[Any, list[int]]:
    """``(mean, steps)``: the parameters of the newest ``n`` training checkpoints averaged in a
    float32 running sum (one checkpoint read at a time), cast back to their dtypes."""
    steps = checkpoints.steps()[-n:]
    total, dtypes = None, None
    for step in steps:
        params = checkpoints.params_at(step, abstract_params)
        dtypes = jax.tree_util.tree_map(lambda x: x.dtype, params)
        params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
        total = params if total is None else jax.tree_util.tree_map(jnp.add, total, params)
    mean = jax.tree_util.tree_map(lambda x, dtype: (x / len(steps)).astype(dtype), total, dtypes)
    return mean, steps
