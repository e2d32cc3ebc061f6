"""Checkpoint averaging (``--average-last N``): the element-wise mean of the parameters
of the last N training checkpoints, the paper's §6.1 ("averaging the last 5
checkpoints") and fairseq's ``scripts/average_checkpoints.py``. The trainer evaluates
the average on dev and keeps it (``averaged/``) only if it beats the best checkpoint.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxformer.run.checkpoints import RunCheckpoints


def average_last_checkpoints(checkpoints: RunCheckpoints, abstract_params: Any, n: int
                             ) -> tuple[Any, list[int]]:
    """The mean of the parameters of the newest ``n`` training checkpoints (the run has at
    least ``n``: the trainer checks) and the steps averaged. Only parameters are read, one
    checkpoint at a time into a float32 running sum, cast back at the end."""
    steps = checkpoints.steps()[-n:]
    total, dtypes = None, None
    for step in steps:   # a running float32 sum: one checkpoint in memory besides it
        params = checkpoints.params_at(step, abstract_params)
        dtypes = jax.tree_util.tree_map(lambda x: x.dtype, params)
        params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
        total = params if total is None else jax.tree_util.tree_map(jnp.add, total, params)
    mean = jax.tree_util.tree_map(lambda x, dtype: (x / len(steps)).astype(dtype), total, dtypes)
    return mean, steps
