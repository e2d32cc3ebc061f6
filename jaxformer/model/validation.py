"""Host-side checks of token-id inputs at the public entry points.

JAX clamps or wraps out-of-range gather indices silently, so an id outside
``[0, vocab)`` would otherwise give a wrong answer without an error. The checks
here run in two places:

* Always (at trace time, no cost at run time): rank, integer dtype, length
  ``<= max_len``, matching batch sizes.
* Scalar arguments (:func:`check_count`, :func:`check_real`): sizes that must be
  integers and numbers that must be finite, before they become static arguments.
* Only on concrete arrays (eager ``model.apply``, or on the host before a jitted
  step): the value range. Inside ``jax.jit`` values are unknown, so jaxformer's own
  jitted loops (training, evaluation, translation) call :func:`check_token_ids` on
  the host batch before dispatch.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import numpy as np


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_rank_2(tokens, *, name: str) -> tuple[int, int]:
    """The shape ``(B, L)`` of an id array; the mask helpers and :func:`check_token_ids`
    share this check.

    Raises:
      ValueError: ``tokens`` is not an array (a list: convert it) or not of rank 2 (one
        sentence: add a batch axis).
    """
    shape = getattr(tokens, "shape", None)
    if shape is None:
        raise ValueError(f"{name} must be an array of integer token ids [batch, length], got a "
                         f"{type(tokens).__name__}; convert it with jnp.asarray({name}, jnp.int32).")
    if len(shape) != 2:
        raise ValueError(f"{name} must be integer token ids of rank 2 [batch, length], "
                         f"got shape {tuple(shape)}. Add a batch axis with {name}[None] for one sentence.")
    return tuple(shape)


def check_token_ids(tokens, *, name: str, vocab_size: int, max_len: int | None = None) -> None:
    """Validates a batch of token ids ``[B, L]``.

    Args:
      tokens: integer array ``[B, L]`` (NumPy, JAX, or a tracer).
      name: argument name used in the error message (``"src"``, ``"tgt"``).
      vocab_size: ids must lie in ``[0, vocab_size)``.
      max_len: if given, ``L`` must be at most this.

    Raises:
      ValueError: wrong rank, float dtype, too long, or (for concrete arrays) an id
        out of range; the message names the argument and the fix.
    """
    shape = check_rank_2(tokens, name=name)
    if not np.issubdtype(np.dtype(tokens.dtype), np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {tokens.dtype}; "
                         f"convert with {name}.astype(jnp.int32) only if the values are ids.")
    if max_len is not None and shape[1] > max_len:
        raise ValueError(f"{name} has length {shape[1]} > max_len={max_len}: truncate the "
                         f"sequence or build the model with a larger max_len.")
    if _is_traced(tokens) or tokens.size == 0:
        return
    values = np.asarray(tokens)
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= vocab_size:
        bad = values[(values < 0) | (values >= vocab_size)]
        raise ValueError(f"{name} holds token ids outside [0, {vocab_size}): e.g. {bad[:5].tolist()} "
                         f"(min {low}, max {high}). Check that the tokenizer and the model config "
                         f"use the same vocabulary.")


def check_same_batch(src, tgt) -> None:
    """Raises ``ValueError`` when ``src`` and ``tgt`` differ in batch size."""
    if src.shape[0] != tgt.shape[0]:
        raise ValueError(f"src and tgt must have the same batch size, got src {src.shape} "
                         f"and tgt {tgt.shape}.")


def check_special_ids(*, pad_id: int, bos_id: int, eos_id: int, unk_id: int | None = None,
                      source: str = "the tokenizer") -> None:
    """Refuses special ids that collide with the padding id.

    Padding is masked out of attention and of the loss, so an eos (or bos/unk) that
    shares the pad id is never learnt and eos can never be generated; decoding then
    runs to the length limit. Sentencepiece allows such models (``--pad_id`` defaults
    to −1 = off, and some exports set pad = eos).

    Raises:
      ValueError: pad equals eos, bos or unk; the message names them and the fix.
    """
    same = [name for name, value in (("eos", eos_id), ("bos", bos_id), ("unk", unk_id))
            if value is not None and value == pad_id]
    if same:
        raise ValueError(f"{source}: the pad id {pad_id} is also the {' and '.join(same)} id. Padding is "
                         f"masked out of the loss, so that token could never be learnt or generated. "
                         f"Train the tokenizer with a pad id of its own (sentencepiece: --pad_id=0 "
                         f"--unk_id=1 --bos_id=2 --eos_id=3, as Tokenizer.train does).")


class DataPositionError(ValueError):
    """A checkpoint's data position cannot be continued: readable, but not the streaming
    pipeline's (a checkpoint of a jaxformer from before streamed data, or a damaged or
    edited file), or saved by processes whose positions cannot be joined
    (:mod:`jaxformer.run.positions`)."""


def _scalar(value: Any) -> Any:
    """A concrete 0-d NumPy or JAX array as its Python scalar; anything else as it is."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        try:
            return value.item()
        except Exception:   # a tracer: left for the caller's message
            return value
    return value


def check_count(name: str, value: Any, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]`` (a Python or NumPy integer, or a
    0-d integer array; a ``bool`` or a float such as ``2.0`` is refused: a size that is
    not an integer is a mistake, and would otherwise fail inside ``jit`` with a shape error).

    Raises:
      ValueError: naming ``name``, the value and the fix.
    """
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__}); "
                         f"pass e.g. {name}={max(minimum, 1)}.")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}.")
    return int(value)


def check_real(name: str, value: Any, *, minimum: float | None = None, above: float | None = None) -> float:
    """``value`` as a finite ``float`` (≥ ``minimum`` / > ``above`` when given; a 0-d
    array is taken as its scalar); NaN and infinities are refused, as they compare False
    with every bound.

    Raises:
      ValueError: naming ``name`` and the value.
    """
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")
    if above is not None and not value > above:
        raise ValueError(f"{name} must be greater than {above}, got {value}.")
    return float(value)
