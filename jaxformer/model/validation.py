"""Checks of what library callers hand to the public entry points, run once there. JAX
clamps out-of-range gather indices silently, so ids are checked: shape, dtype, length at
trace time, the range on concrete arrays; scalars that become static arguments too.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


def token_id_problem(tokens, *, name: str, vocab_size: int, max_len: int | None = None) -> str | None:
    """What is wrong with ``tokens`` as a batch of ids ``[B, L]`` (see :func:`check_token_ids`),
    or ``None``."""
    shape = getattr(tokens, "shape", None)
    if shape is None:
        return (f"{name} must be an array of integer token ids [batch, length], got a "
                f"{type(tokens).__name__}; convert it with jnp.asarray({name}, jnp.int32)")
    if len(shape) != 2:
        return (f"{name} must be integer token ids of rank 2 [batch, length], got shape {tuple(shape)}; "
                f"add a batch axis with {name}[None] for one sentence")
    if not np.issubdtype(np.dtype(tokens.dtype), np.integer):
        return (f"{name} must hold integer token ids, got dtype {tokens.dtype}; convert with "
                f"{name}.astype(jnp.int32) only if the values are ids")
    if max_len is not None and shape[1] > max_len:
        return (f"{name} has length {shape[1]} > max_len={max_len}: truncate the sequence or build "
                f"the model with a larger max_len")
    import jax  # here, not at the top: the tokenizer's checks import this module without JAX

    if isinstance(tokens, jax.core.Tracer) or tokens.size == 0:
        return None
    values = np.asarray(tokens)
    bad = values[(values < 0) | (values >= vocab_size)]
    if bad.size:
        return (f"{name} holds token ids outside [0, {vocab_size}): e.g. {bad[:5].tolist()} (min "
                f"{values.min()}, max {values.max()}); check that the tokenizer and the model config "
                f"use the same vocabulary")
    return None


def check_token_ids(tokens, *, name: str, vocab_size: int, max_len: int | None = None) -> None:
    """Checks a batch of token ids ``[B, L]`` (NumPy, JAX, or a tracer) named ``name`` in the message: ids in
    ``[0, vocab_size)`` (concrete arrays), ``L <= max_len`` if given. Raises ``ValueError``: not an array,
    wrong rank, float dtype, too long, or an id out of range; the message names the argument and the fix."""
    problem = token_id_problem(tokens, name=name, vocab_size=vocab_size, max_len=max_len)
    if problem:
        raise ValueError(problem + ".")


def check_special_ids(*, pad_id: int, bos_id: int, eos_id: int, unk_id: int | None = None,
                      source: str = "the tokenizer") -> None:
    """Refuses special ids that collide with the padding id, which is masked out of the loss (an eos sharing
    it is never learnt; sentencepiece allows such models). Raises ``ValueError``: pad equals eos, bos or unk;
    the message names them and the fix."""
    same = [name for name, value in (("eos", eos_id), ("bos", bos_id), ("unk", unk_id))
            if value is not None and value == pad_id]
    if same:
        raise ValueError(f"{source}: the pad id {pad_id} is also the {' and '.join(same)} id. Padding is "
                         f"masked out of the loss, so that token could never be learnt or generated. "
                         f"Train the tokenizer with a pad id of its own (sentencepiece: --pad_id=0 "
                         f"--unk_id=1 --bos_id=2 --eos_id=3, as Tokenizer.train does).")


class DataPositionError(ValueError):
    """A checkpoint's data position cannot be continued: not the streaming pipeline's
    (an old, damaged or edited file), or saved by processes whose positions cannot be
    joined (:mod:`jaxformer.run.positions`)."""


def _scalar(value: Any) -> Any:
    """A concrete 0-d NumPy or JAX array as its Python scalar; anything else as it is."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        try:
            return value.item()
        except Exception:   # a tracer: left for the caller's message
            return value
    return value


def check_count(name: str, value: Any, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` (a Python or NumPy integer or a 0-d integer array; not a ``bool`` nor a float such as
    ``2.0``, which would fail inside ``jit``) as an ``int`` in ``[minimum, maximum]``. Raises ``ValueError``:
    naming ``name``, the value and the fix."""
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        problem = f"an integer, got {value!r} ({type(value).__name__}); pass e.g. {name}={max(minimum, 1)}"
    elif value < minimum or (maximum is not None and value > maximum):
        problem = f"at least {minimum}, got {value}" if value < minimum else f"at most {maximum}, got {value}"
    else:
        return int(value)
    raise ValueError(f"{name} must be {problem}.")


def check_real(name: str, value: Any, *, minimum: float | None = None, above: float | None = None) -> float:
    """``value`` (a number or a 0-d array) as a finite ``float``, ≥ ``minimum`` / > ``above``. Raises
    ``ValueError``: naming ``name`` and the value."""
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        problem = f"a finite number, got {value!r}"
    elif minimum is not None and value < minimum:
        problem = f"at least {minimum}, got {value}"
    elif above is not None and not value > above:
        problem = f"greater than {above}, got {value}"
    else:
        return float(value)
    raise ValueError(f"{name} must be {problem}.")
