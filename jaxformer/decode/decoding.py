"""Autoregressive decoding with an explicit cache, as ``lax.while_loop``s.

The model enters as a callback ``tokens_to_logits(ids [B,1], cache) -> (logits [B,V],
cache)`` (``Transformer.decode_step`` bound to its variables), so every decoder
here can be tested with a stub whose right answer is known.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp

from jaxformer.decode.beam_search import (  # noqa: F401  (re-exported: callers import decoders from here)
    NEG_INF,
    TokensToLogits,
    _gather_beams,
    beam_search,
    blocked_top_k,
    length_penalty,
    tile_beams,
)
from jaxformer.decode.penalties import NO_PENALTIES, Penalties
from jaxformer.model.scan import unrolled
from jaxformer.model.sharding import under_mesh
from jaxformer.model.transformer import Transformer
from jaxformer.model.validation import check_count, check_real, check_token_ids


def _host_checked(jitted: Callable) -> Callable:
    """``jitted(model, params, src_BS, ...)`` that first checks ``src_BS``'s ids on the host
    when they are concrete (inside jit the values are unknown and would be clamped or give
    NaN logits silently; see :mod:`jaxformer.model.validation`). ``__wrapped__`` stays the
    un-jitted function, which :func:`jit_decoder` re-jits with shardings."""

    @functools.wraps(jitted)
    def checked(model, params, src_BS, *args, **kwargs):
        if not isinstance(src_BS, jax.Array) or src_BS.is_fully_addressable:
            check_token_ids(src_BS, name="src_BS", vocab_size=model.config.src_vocab_size,
                            max_len=model.config.max_len)
        # bos (and pad, fed after a hypothesis ends) outside the vocabulary would be clamped
        # into another token's embedding; an eos outside it is the idiom for "never stop"
        # (benchmarks/decode.py), left alone.
        vocab = model.config.tgt_vocab_size
        for name in ("bos_id", "eos_id"):   # int32 ids; NumPy ones too (bos range-checked below)
            if name in kwargs:
                kwargs[name] = check_count(name, kwargs[name], minimum=-(1 << 31), maximum=(1 << 31) - 1)
        if "bos_id" in kwargs and not 0 <= kwargs["bos_id"] < vocab:
            raise ValueError(f"bos_id={kwargs['bos_id']} is outside the target vocabulary [0, {vocab}): "
                             f"pass the tokenizer's id (e.g. tokenizer.bos_id).")
        for name in ("beam_size", "max_decode_len"):
            if name in kwargs:
                kwargs[name] = check_count(name, kwargs[name])
        if kwargs.get("top_k") is not None:
            kwargs["top_k"] = check_count("top_k", kwargs["top_k"])
        if kwargs.get("extra_len") is not None:
            kwargs["extra_len"] = check_count("extra_len", kwargs["extra_len"], minimum=-(1 << 30))
        if kwargs.get("top_p") is not None:
            kwargs["top_p"] = check_real("top_p", kwargs["top_p"], above=0.0)
        for name in ("early_stopping", "forced_eos"):   # "no" would silently mean True
            if name in kwargs and not isinstance(kwargs[name], bool):
                raise ValueError(f"{name} must be True or False, got {kwargs[name]!r}.")
        for name in ("temperature", "len_a", "alpha"):
            if name in kwargs:
                kwargs[name] = check_real(name, kwargs[name], minimum=0.0 if name != "alpha" else None)
        return jitted(model, params, src_BS, *args, **kwargs)

    checked.__wrapped__ = jitted.__wrapped__
    return checked


def _autoregress(tokens_to_logits: TokensToLogits, cache: Any, pick, *, batch_size: int,
                 bos_id: int, eos_id: int, pad_id: int, max_decode_len: int,
                 max_lengths: jax.Array | None = None) -> jax.Array:
    """The one decoding loop: feed the last token, ``pick(logits_BV, step, out_BM, at_limit_B)``
    the next (``out_BM``: the tokens so far, pad after ``step``; ``at_limit_B``: the token
    is the sentence's last allowed). A sentence stops at eos or at its limit, min(its
    ``max_lengths`` entry, M) and at least 1."""
    limit_B = (jnp.full((batch_size,), max_decode_len, jnp.int32) if max_lengths is None
               else jnp.clip(jnp.asarray(max_lengths, jnp.int32), 1, max_decode_len))
    out0 = jnp.full((batch_size, max_decode_len), pad_id, jnp.int32)
    ids0 = jnp.full((batch_size, 1), bos_id, jnp.int32)
    done0 = jnp.zeros((batch_size,), jnp.bool_)

    def cond(carry):
        step, _, _, done, _ = carry
        return (step < max_decode_len) & ~jnp.all(done)

    def body(carry):
        step, ids_B1, cache, done, out = carry
        logits_BV, cache = tokens_to_logits(ids_B1, cache)
        chex.assert_shape(logits_BV, (batch_size, None))
        at_limit_B = step + 1 >= limit_B
        next_B = jnp.where(done, pad_id, pick(logits_BV, step, out, at_limit_B))
        out = jax.lax.dynamic_update_slice_in_dim(out, next_B[:, None], step, axis=1)
        done = done | (next_B == eos_id) | at_limit_B
        return step + 1, next_B[:, None], cache, done, out

    *_, out = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), ids0, cache, done0, out0))
    return out


def first_argmax(logits_BV: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` (the first maximal id) as a max and a min, int32 ``[B]``
    (any rank: the last axis is reduced).

    Two plain reductions instead of XLA's variadic (value, index) reduce, which is
    slow on CPU (0.6 ms for ``[32, 8000]``, about a tenth of a greedy step). A row
    with a NaN has no maximum; it gets the last id instead of the NaN's position.
    """
    vocab = logits_BV.shape[-1]
    best_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    ids_1V = jnp.arange(vocab, dtype=jnp.int32).reshape((1,) * (logits_BV.ndim - 1) + (vocab,))
    first = jnp.min(jnp.where(logits_BV == best_B1, ids_1V, vocab - 1), axis=-1)
    return first.astype(jnp.int32)


def greedy_search(tokens_to_logits: TokensToLogits, cache: Any, *, batch_size: int, bos_id: int,
                  eos_id: int, pad_id: int, max_decode_len: int, forced_eos: bool = False,
                  penalties: Penalties = NO_PENALTIES, max_lengths: jax.Array | None = None) -> jax.Array:
    """Greedy decoding; stops early once every sequence has produced eos.

    Args:
      tokens_to_logits: the model callback.
      cache: its initial state (e.g. a :class:`~jaxformer.model.transformer.DecodeCache`).
      batch_size: B.
      bos_id, eos_id, pad_id: special ids from the tokenizer; pad and bos are never
        generated.
      max_decode_len: M, the most tokens generated per sequence (eos included).
      forced_eos: a sentence's last allowed token is eos (as beam search does, and as
        Hugging Face's ``forced_eos_token_id``); otherwise an unfinished sequence just stops.
      penalties: repetition rules on the logits (:mod:`jaxformer.decode.penalties`).
      max_lengths: optional int ``[B]``, per-sentence limits (e.g. :func:`source_limits`);
        each sentence stops after min(its limit, M) tokens, at least 1.

    Returns:
      int32 ``[B, M]``: generated ids (without bos); eos then pad after the end.
    """

    def pick(logits_BV, step, out_BM, at_limit_B):
        vocab_ids = jnp.arange(logits_BV.shape[-1], dtype=jnp.int32)
        never_V = (vocab_ids == pad_id) | (vocab_ids == bos_id)
        if penalties.active:
            logits_BV = penalties.apply(logits_BV.astype(jnp.float32), out_BM, step, banned_value=-jnp.inf)
        best_B = first_argmax(jnp.where(never_V[None, :], -jnp.inf, logits_BV))
        if forced_eos:
            best_B = jnp.where(at_limit_B, eos_id, best_B)
        return best_B

    return _autoregress(tokens_to_logits, cache, pick, batch_size=batch_size, bos_id=bos_id,
                        eos_id=eos_id, pad_id=pad_id, max_decode_len=max_decode_len, max_lengths=max_lengths)


@_host_checked
@functools.partial(jax.jit, static_argnames=("model", "max_decode_len", "bos_id", "eos_id", "forced_eos",
                                             "penalties", "len_a", "extra_len"))
def greedy_translate(model: Transformer, params: Any, src_BS: jax.Array, *, max_decode_len: int,
                     bos_id: int, eos_id: int, forced_eos: bool = False,
                     penalties: Penalties = NO_PENALTIES, len_a: float = 1.0,
                     extra_len: int | None = None) -> jax.Array:
    """Encodes ``src [B,S]`` once and greedily decodes up to ``max_decode_len`` tokens
    (``forced_eos``, ``penalties``: see :func:`greedy_search`); with ``extra_len`` each
    sentence also stops after ``len_a`` × its source length + ``extra_len`` tokens, as in
    :func:`beam_translate` (``None``, the default: no such limit).

    Compiles once per (B, S, max_decode_len). Returns int32 ``[B, M]``. Raises
    ``ValueError`` (before dispatch) for concrete ids outside ``[0, V_src)``
    and for ``bos_id``/``pad_id`` outside ``[0, V_tgt)``.
    """
    tokens_to_logits, cache = _model_callback(model, params, src_BS, max_decode_len)
    return greedy_search(tokens_to_logits, cache, batch_size=src_BS.shape[0], bos_id=bos_id,
                         eos_id=eos_id, pad_id=model.config.pad_id, max_decode_len=max_decode_len,
                         forced_eos=forced_eos, penalties=penalties,
                         max_lengths=source_limits(src_BS, pad_id=model.config.pad_id, len_a=len_a,
                                                   extra_len=extra_len))


# ---------------------------------------------------------------------- sampling
def sample(tokens_to_logits: TokensToLogits, cache: Any, rng: jax.Array, *, batch_size: int,
           bos_id: int, eos_id: int, pad_id: int, max_decode_len: int, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None,
           penalties: Penalties = NO_PENALTIES, max_lengths: jax.Array | None = None) -> jax.Array:
    """Ancestral sampling with temperature, top-k and nucleus (top-p) filtering.

    Args:
      rng: explicit PRNG key; step t uses ``fold_in(rng, t)``, so a fixed key gives
        a reproducible output.
      temperature: > 0; logits are divided by it. ``temperature=0`` is greedy.
      top_k: keep only the k most likely tokens (``None`` = all).
      top_p: keep the smallest set of tokens whose probability reaches p (``None`` = all).
      penalties: repetition rules on the logits, before the temperature
        (:mod:`jaxformer.decode.penalties`; transformers' processor order).
      max_lengths: optional per-sentence limits, as in :func:`greedy_search`.

    Returns:
      int32 ``[B, M]`` like :func:`greedy_search`.

    Raises:
      ValueError: negative temperature, top_k < 1 or top_p outside (0, 1].
    """
    if not temperature >= 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if temperature == 0:
        return greedy_search(tokens_to_logits, cache, batch_size=batch_size, bos_id=bos_id,
                             eos_id=eos_id, pad_id=pad_id, max_decode_len=max_decode_len,
                             penalties=penalties, max_lengths=max_lengths)

    def pick(logits_BV, step, out_BM, at_limit_B):
        vocab_ids = jnp.arange(logits_BV.shape[-1])
        if penalties.active:
            logits_BV = penalties.apply(logits_BV.astype(jnp.float32), out_BM, step, banned_value=-jnp.inf)
        logits = jnp.where(((vocab_ids == pad_id) | (vocab_ids == bos_id))[None, :], -jnp.inf,
                           logits_BV.astype(jnp.float32) / temperature)
        if top_k is not None and top_k < logits.shape[-1]:
            kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        if top_p is not None and top_p < 1.0:
            sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
            cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
            # The smallest prefix whose mass reaches top_p: keep tokens whose preceding mass < p.
            keep_sorted = (cumulative - jax.nn.softmax(sorted_logits, axis=-1)) < top_p
            threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
            logits = jnp.where(logits < threshold, -jnp.inf, logits)
        return jax.random.categorical(jax.random.fold_in(rng, step), logits, axis=-1).astype(jnp.int32)

    return _autoregress(tokens_to_logits, cache, pick, batch_size=batch_size, bos_id=bos_id,
                        eos_id=eos_id, pad_id=pad_id, max_decode_len=max_decode_len, max_lengths=max_lengths)


def _model_callback(model: Transformer, params: Any, src_BS: jax.Array, max_decode_len: int,
                    beam_size: int = 1):
    """Encodes once, builds the cache (tiled over beams) and the ``tokens_to_logits`` callback.

    A model with scanned layers decodes through its unrolled view (one cache per layer)."""
    unrolled_model, unrolled_params = unrolled(model, params)
    variables = {"params": unrolled_params}
    encoder_output = unrolled_model.apply(variables, src_BS, method=Transformer.encode)
    cache = unrolled_model.apply(variables, encoder_output, src_BS, max_decode_len,
                                 method=Transformer.init_cache)
    if beam_size > 1:
        cache = tile_beams(cache, beam_size)
    return decode_step_callback(unrolled_model, unrolled_params), cache


def decode_step_callback(model: Transformer, params: Any) -> TokensToLogits:
    """``tokens_to_logits(ids [B, 1], cache) -> (logits [B, V], cache)``: one
    :meth:`Transformer.decode_step` (a scanned model through its unrolled view)."""
    model, params = unrolled(model, params)
    variables = {"params": params}

    def tokens_to_logits(ids, cache):
        return model.apply(variables, ids, cache, method=Transformer.decode_step)

    return tokens_to_logits


def source_limits(src_BS: jax.Array, *, pad_id: int, len_a: float, extra_len: int | None) -> jax.Array | None:
    """Each sentence's most output tokens, ``len_a`` × its source length + ``extra_len``
    (int32 ``[B]``; fairseq's ``--max-len-a/b``), or ``None`` without ``extra_len``."""
    if extra_len is None:
        return None
    return jnp.floor(len_a * jnp.sum(src_BS != pad_id, axis=1)).astype(jnp.int32) + extra_len


def uncached_model_callback(model: Transformer, params: Any, src_BS: jax.Array, max_decode_len: int,
                            beam_size: int = 1):
    """A ``tokens_to_logits`` without a K/V cache, and its initial state: the reference.

    Its "cache" is the token prefix ``[B(*k), M]``: every step re-runs the teacher-forced
    decoder over the whole prefix and returns the logits at the current position
    (causal masking makes the unwritten positions irrelevant). Beam search reorders
    it like any pytree. Quadratic in M; for checking cached decoding and for measuring
    what the cache saves (``benchmarks/decode.py``).

    Returns:
      ``(tokens_to_logits, state)``, the state tiled over ``beam_size`` beams.
    """
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


@_host_checked
@functools.partial(jax.jit, static_argnames=("model", "max_decode_len", "bos_id", "eos_id",
                                             "beam_size", "alpha", "extra_len", "len_a",
                                             "length_normalization", "early_stopping", "penalties"))
def beam_translate(model: Transformer, params: Any, src_BS: jax.Array, *, beam_size: int,
                   max_decode_len: int, bos_id: int, eos_id: int, alpha: float = 0.6,
                   extra_len: int | None = 50, len_a: float = 1.0, length_normalization: str = "gnmt",
                   early_stopping: bool = False,
                   penalties: Penalties = NO_PENALTIES) -> tuple[jax.Array, jax.Array]:
    """Beam search translation of ``src [B,S]``; each output is at most ``len_a`` × its
    source length + ``extra_len`` tokens (paper §6.1: a = 1, b = 50; fairseq's
    ``--max-len-a/b``; ``extra_len=None`` = no such limit, as ``generate``), capped by
    ``max_decode_len``. ``length_normalization`` (``"gnmt"`` or ``"hf"``), ``early_stopping``
    and ``penalties``: see :func:`jaxformer.decode.beam_search.beam_search`.

    Raises ``ValueError`` (before dispatch) for concrete ids outside ``[0, V_src)``
    and for ``bos_id``/``pad_id`` outside ``[0, V_tgt)``.
    Returns ``(sequences [B, k, M], scores [B, k])``, best first.
    """
    tokens_to_logits, cache = _model_callback(model, params, src_BS, max_decode_len, beam_size)
    return beam_search(tokens_to_logits, cache, batch_size=src_BS.shape[0], beam_size=beam_size,
                       bos_id=bos_id, eos_id=eos_id, pad_id=model.config.pad_id,
                       max_decode_len=max_decode_len, alpha=alpha,
                       max_lengths=source_limits(src_BS, pad_id=model.config.pad_id, len_a=len_a,
                                                 extra_len=extra_len),
                       length_normalization=length_normalization, early_stopping=early_stopping,
                       penalties=penalties)


@_host_checked
@functools.partial(jax.jit, static_argnames=("model", "max_decode_len", "bos_id", "eos_id",
                                             "temperature", "top_k", "top_p", "penalties", "len_a",
                                             "extra_len"))
def sample_translate(model: Transformer, params: Any, src_BS: jax.Array, rng: jax.Array, *,
                     max_decode_len: int, bos_id: int, eos_id: int, temperature: float = 1.0,
                     top_k: int | None = None, top_p: float | None = None,
                     penalties: Penalties = NO_PENALTIES, len_a: float = 1.0,
                     extra_len: int | None = None) -> jax.Array:
    """Sampled translations of ``src [B,S]`` → int32 ``[B, M]`` (see :func:`sample`;
    ``len_a``, ``extra_len``: per-sentence limits as in :func:`greedy_translate`)."""
    tokens_to_logits, cache = _model_callback(model, params, src_BS, max_decode_len)
    return sample(tokens_to_logits, cache, rng, batch_size=src_BS.shape[0], bos_id=bos_id,
                  eos_id=eos_id, pad_id=model.config.pad_id, max_decode_len=max_decode_len,
                  temperature=temperature, top_k=top_k, top_p=top_p, penalties=penalties,
                  max_lengths=source_limits(src_BS, pad_id=model.config.pad_id, len_a=len_a,
                                            extra_len=extra_len))


def jit_decoder(decoder: Callable, model: Transformer, layout: Any = None, **static) -> Callable:
    """One of :func:`greedy_translate`, :func:`beam_translate`, :func:`sample_translate`
    with ``model`` and its static arguments bound: ``fn(params, src_BS[, rng])``.

    With a ``layout`` (:class:`jaxformer.model.sharding.Layout`) it is jit-compiled with
    explicit shardings: parameters as the train state lays them out, source rows and
    every output split over ``data``, the rng replicated; traced under the mesh.
    Without one it is the plain jitted decoder.
    """
    fn = decoder if layout is None else decoder.__wrapped__   # jitted as is, or re-jitted below

    def bound(params, src_BS, *rng):
        return fn(model, params, src_BS, *rng, **static)

    if layout is None:
        return bound
    rng_sharding = (layout.replicated,) if decoder is sample_translate else ()
    return under_mesh(jax.jit(bound, in_shardings=(layout.params, layout.batch) + rng_sharding,
                              out_shardings=layout.batch), layout.mesh)
