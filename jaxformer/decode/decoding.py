"""Decoding a model: :func:`decode` runs a strategy (:mod:`jaxformer.decode.strategies`) over a
batch of sources, jitted. Strategies see the model as ``tokens_to_logits(ids [B, 1], cache) ->
(logits [B, V], cache)`` (``Transformer.decode_step`` bound), so a stub can stand in for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decode.beam_search import TokensToLogits, tile_beams
from jaxformer.model.scan import unrolled
from jaxformer.model.sharding import under_mesh
from jaxformer.model.transformer import Transformer
from jaxformer.model.validation import check_count, check_real, check_token_ids


def decode(model: Transformer, params: Any, src_BS: jax.Array, strategy: Any, *, bos_id: int, eos_id: int,
           max_decode_len: int, len_a: float = 1.0, extra_len: int | None = None,
           rng: jax.Array | None = None, indices_B: jax.Array | None = None,
           constraints: dict[str, jax.Array] | None = None,
           banned_ids: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array]:
    """``(sequences [B, N, M] int32, scores [B, N] float32)``, best first (N = 1 but for beams):
    ``src [B, S]`` encoded once and decoded with ``strategy``, jitted (one compile per shape and
    settings). ``bos_id``, ``eos_id``: the tokenizer's (an eos outside the vocabulary never
    stops); M = ``max_decode_len`` tokens at most, eos included, and ``len_a`` × the source
    length + ``extra_len`` (fairseq's ``--max-len-a/b``; §6.1: 1 and 50; ``None``: no such
    limit). ``rng`` (default ``key(0)``): sentence b samples from ``fold_in(rng, indices_B[b])``,
    its index in the whole input (int ``[B]`` or ``[B, 1]``, default 0..B-1), whatever its batch.
    ``constraints``: a :class:`~jaxformer.decode.constrained.Constrained` strategy's target
    phrases and prefix, ``{"tokens": int [B, C, P], "prefix": int [B, Q]}`` padded with -1.
    ``banned_ids``: the ids never generated (the model's generation settings,
    :mod:`jaxformer.decode.generation`; ``None``: pad and ``bos_id``). Raises ``ValueError``
    (before dispatch) for concrete ids outside ``[0, V_src)``, a ``bos_id`` or banned id outside
    ``[0, V_tgt)``, a size not an integer, a limit not finite, or constraints for another
    strategy or not of that form.
    """
    config = model.config
    if not isinstance(src_BS, jax.Array) or src_BS.is_fully_addressable:
        check_token_ids(src_BS, name="src_BS", vocab_size=config.src_vocab_size, max_len=config.max_len)
    if constraints is not None:
        constraints = check_constraints(constraints, strategy, batch=src_BS.shape[0],
                                        vocab_size=config.tgt_vocab_size)
    return _decode_jit(
        model, params, src_BS, indices_B, rng, constraints, strategy=strategy,
        bos_id=check_count("bos_id", bos_id, minimum=0, maximum=config.tgt_vocab_size - 1),
        eos_id=check_count("eos_id", eos_id, minimum=-(1 << 31), maximum=(1 << 31) - 1),   # an int32
        max_decode_len=check_count("max_decode_len", max_decode_len),
        len_a=check_real("len_a", len_a, minimum=0.0),
        extra_len=None if extra_len is None else check_count("extra_len", extra_len, minimum=-(1 << 30)),
        banned_ids=None if banned_ids is None else tuple(
            check_count("banned_ids", i, minimum=0, maximum=config.tgt_vocab_size - 1) for i in banned_ids))


def _decode(model: Transformer, params: Any, src_BS: jax.Array, indices_B: jax.Array | None = None,
            rng: jax.Array | None = None, constraints: dict[str, jax.Array] | None = None, *,
            strategy: Any, bos_id: int, eos_id: int, max_decode_len: int,
            len_a: float = 1.0, extra_len: int | None = None,
            banned_ids: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`decode` without the host checks: the traced program."""
    batch = src_BS.shape[0]
    tokens_to_logits, cache = _model_callback(model, params, src_BS, max_decode_len, strategy.beams)
    indices_B = jnp.arange(batch) if indices_B is None else indices_B.reshape(batch)
    keys_B = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(0) if rng is None else rng, indices_B)
    data = {} if constraints is None else {"constraints": constraints}
    return strategy.search(tokens_to_logits, cache, **data, batch_size=batch, bos_id=bos_id, eos_id=eos_id,
                           pad_id=model.config.pad_id, max_decode_len=max_decode_len, keys_B=keys_B,
                           max_lengths=source_limits(src_BS, pad_id=model.config.pad_id, len_a=len_a,
                                                     extra_len=extra_len),
                           **({} if banned_ids is None else {"banned_ids": banned_ids}))


_decode_jit = jax.jit(_decode, static_argnames=("model", "strategy", "bos_id", "eos_id", "max_decode_len",
                                                 "len_a", "extra_len", "banned_ids"))


def jit_decoder(model: Transformer, strategy: Any, layout: Any = None, **static) -> Callable:
    """``fn(params, src_BS, indices_B=None, rng=None[, constraints])``: :func:`decode` with
    ``strategy`` and its settings ``static`` (``bos_id``, ``eos_id``, ``max_decode_len``, …) bound,
    without the host checks; with a ``layout`` (:class:`jaxformer.model.sharding.Layout`) traced
    under its mesh, inputs as laid out and outputs over ``data``."""
    if layout is None:
        return functools.partial(_decode_jit, model, strategy=strategy, **static)
    return under_mesh(jax.jit(functools.partial(_decode, model, strategy=strategy, **static),
                              out_shardings=layout.batch), layout.mesh)


def check_constraints(constraints: dict, strategy: Any, *, batch: int, vocab_size: int) -> dict:
    """``constraints`` as int32 arrays, checked where they enter :func:`decode`: ``tokens [B, C,
    P]`` and ``prefix [B, Q]`` (either may be left out), ids in ``[0, V_tgt)`` or -1 (padding), for
    a strategy that takes them (``supports_constraints``: :class:`~jaxformer.decode.constrained.Constrained`).
    ``ValueError`` otherwise, naming what is wrong."""
    arrays = {name: np.asarray(value) for name, value in constraints.items()}
    ranks, problems = {"tokens": 3, "prefix": 2}, []
    if not getattr(strategy, "supports_constraints", False):
        problems.append(f"constraints need a Constrained strategy, not {type(strategy).__name__}")
    for name, value in arrays.items():
        if name not in ranks or value.ndim != ranks[name] or value.shape[0] != batch:
            problems.append(f"{name!r} must be one of {sorted(ranks)} with rank {ranks.get(name, '2 or 3')} "
                            f"and {batch} rows, got shape {value.shape}")
        elif value.size and (not np.issubdtype(value.dtype, np.integer) or value.min() < -1
                             or value.max() >= vocab_size):
            problems.append(f"{name!r} must hold token ids in [0, {vocab_size}) or -1 (padding)")
    if problems:
        raise ValueError("; ".join(problems) + ".")
    return {name: jnp.asarray(value, jnp.int32) for name, value in arrays.items()}


def _model_callback(model: Transformer, params: Any, src_BS: jax.Array, max_decode_len: int,
                    beam_size: int = 1):
    """Encodes once: ``(tokens_to_logits, cache)``, the cache tiled over ``beam_size`` beams."""
    model, variables = unrolled(model, {"params": params})
    encoder_output = model.apply(variables, src_BS, method=Transformer.encode)
    cache = model.apply(variables, encoder_output, src_BS, max_decode_len, method=Transformer.init_cache)
    return (decode_step_callback(model, variables["params"]),
            tile_beams(cache, beam_size) if beam_size > 1 else cache)


def decode_step_callback(model: Transformer, params: Any) -> TokensToLogits:
    """``tokens_to_logits``: one :meth:`Transformer.decode_step` (a scanned model unrolled)."""
    model, variables = unrolled(model, {"params": params})
    return functools.partial(model.apply, variables, method=Transformer.decode_step)


def source_limits(src_BS: jax.Array, *, pad_id: int, len_a: float, extra_len: int | None) -> jax.Array | None:
    """Each sentence's most output tokens, ``len_a`` × its source length + ``extra_len``
    (int32 ``[B]``; fairseq's ``--max-len-a/b``), or ``None`` without ``extra_len``."""
    if extra_len is None:
        return None
    return jnp.floor(len_a * jnp.sum(src_BS != pad_id, axis=1)).astype(jnp.int32) + extra_len


def uncached_model_callback(model: Transformer, params: Any, src_BS: jax.Array, max_decode_len: int,
                            beam_size: int = 1):
    """``(tokens_to_logits, state)`` without a K/V cache, the reference (quadratic in M): the
    state holds the prefix ``[B(*k), M]`` and each step re-runs the teacher-forced decoder."""
    variables = {"params": params}
    state = {"tokens": jnp.full((src_BS.shape[0], max_decode_len), model.config.pad_id, jnp.int32),
             "encoder_output": model.apply(variables, src_BS, method=Transformer.encode),
             "src": src_BS, "index": jnp.zeros((), jnp.int32)}

    def tokens_to_logits(ids_B1, state):
        tokens = jax.lax.dynamic_update_slice_in_dim(state["tokens"], ids_B1, state["index"], axis=1)
        logits = model.apply(variables, state["encoder_output"], state["src"], tokens,
                             method=Transformer.decode)
        step_logits = jax.lax.dynamic_index_in_dim(logits, state["index"], axis=1, keepdims=False)
        return step_logits, dict(state, tokens=tokens, index=state["index"] + 1)

    return tokens_to_logits, (tile_beams(state, beam_size) if beam_size > 1 else state)
