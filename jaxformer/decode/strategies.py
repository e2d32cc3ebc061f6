"""Decoding strategies: frozen, hashable values (static arguments of the jitted decoder) that
check their settings when made. A strategy has ``beams`` (cache rows per sentence) and
``search(tokens_to_logits, cache, *, batch_size, bos_id, eos_id, pad_id, max_decode_len,
max_lengths, keys_B[, banned_ids])`` → ``(sequences [B, N, M] int32, scores [B, N] float32)``,
best first, eos then pad after each end; ``tokens_to_logits(ids [B*N, 1], cache) -> (logits [B*N, V], cache)``
is the model, ``max_lengths`` (int ``[B]`` or ``None``) each sentence's most tokens, ``keys_B``
a PRNG key per sentence, ``banned_ids`` (passed only when a model's generation settings name
them) the ids never generated, default pad and ``bos_id`` (the decoder start). A new
strategy is one such class (``tests/test_decoding.py`` has one); a beam-like one supplies a
``candidates`` step to :func:`~jaxformer.decode.beam_search.beam_loop` (fairseq's ``Search.step``).

A strategy says what it supports by class attributes (absent: ``False``), so callers never
branch on its type: ``supports_constraints`` (``decode(..., constraints=...)`` takes target
phrases and a prefix, and ``plain`` is the strategy without them:
:class:`~jaxformer.decode.constrained.Constrained`), ``stageable`` (bulk decoding may run it in
stages, :mod:`jaxformer.decode.staged`: :class:`Beam`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import chex
import jax
import jax.numpy as jnp

from jaxformer.decode.beam_search import Beam, TokensToLogits
from jaxformer.decode.generation import banned_mask
from jaxformer.decode.penalties import apply_processors, penalties
from jaxformer.model.validation import check_count, check_real


def autoregress(tokens_to_logits: TokensToLogits, cache: Any, pick, *, batch_size: int, bos_id: int,
                eos_id: int, pad_id: int, max_decode_len: int,
                max_lengths: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Token by token (one ``lax.while_loop``): ``(sequences [B, 1, M] int32, zero scores [B, 1])``;
    ``pick(logits_BV, step, out_BM, at_limit_B) -> ids_B`` picks each token given those so far
    and whether it is the sentence's last; a sentence stops at eos or min(``max_lengths``, M) ≥ 1."""
    limit_B = (jnp.full((batch_size,), max_decode_len, jnp.int32) if max_lengths is None
               else jnp.clip(jnp.asarray(max_lengths, jnp.int32), 1, max_decode_len))

    def body(carry):
        step, ids_B1, cache, done_B, out_BM = carry
        logits_BV, cache = tokens_to_logits(ids_B1, cache)
        chex.assert_shape(logits_BV, (batch_size, None))
        at_limit_B = step + 1 >= limit_B
        next_B = jnp.where(done_B, pad_id, pick(logits_BV, step, out_BM, at_limit_B))
        out_BM = jax.lax.dynamic_update_slice_in_dim(out_BM, next_B[:, None], step, axis=1)
        return step + 1, next_B[:, None], cache, done_B | (next_B == eos_id) | at_limit_B, out_BM

    carry = (jnp.zeros((), jnp.int32), jnp.full((batch_size, 1), bos_id, jnp.int32), cache,
             jnp.zeros((batch_size,), jnp.bool_), jnp.full((batch_size, max_decode_len), pad_id, jnp.int32))
    *_, out_BM = jax.lax.while_loop(lambda c: (c[0] < max_decode_len) & ~jnp.all(c[3]), body, carry)
    return out_BM[:, None], jnp.zeros((batch_size, 1), jnp.float32)


def first_argmax(logits_BV: jax.Array) -> jax.Array:
    """int32 ``jnp.argmax(logits, axis=-1)`` (a NaN row: the last id) by two plain reductions:
    XLA's variadic reduce is slow on CPU (benchmarks/README.md, "Greedy pick as a max and a min")."""
    vocab = logits_BV.shape[-1]
    best_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    ids_1V = jnp.arange(vocab, dtype=jnp.int32).reshape((1,) * (logits_BV.ndim - 1) + (vocab,))
    return jnp.min(jnp.where(logits_BV == best_B1, ids_1V, vocab - 1), axis=-1).astype(jnp.int32)


def allowed_logits(logits_BV: jax.Array, out_BM: jax.Array, step: jax.Array, processors: tuple, *,
                   bos_id: int, pad_id: int, banned_ids: tuple | None = None) -> jax.Array:
    """float32 ``logits_BV`` after the ``processors``, the banned ids
    (:func:`~jaxformer.decode.generation.banned_mask`) at -inf."""
    never_1V = banned_mask(logits_BV.shape[-1], bos_id=bos_id, pad_id=pad_id, banned_ids=banned_ids)[None, :]
    return jnp.where(never_1V, -jnp.inf, apply_processors(processors, logits_BV, out_BM, step))


@dataclasses.dataclass(frozen=True)
class Greedy:
    """The most likely token at each step (the first of a tie); scores 0. ``forced_eos``: eos at a
    sentence's limit (Hugging Face's ``forced_eos_token_id``); ``processors``: logit processors."""

    forced_eos: bool = False
    processors: tuple = ()
    beams: ClassVar[int] = 1

    def search(self, tokens_to_logits, cache, *, keys_B=None, banned_ids=None, **loop):
        def pick(logits_BV, step, out_BM, at_limit_B):
            best_B = first_argmax(allowed_logits(logits_BV, out_BM, step, self.processors,
                                                 bos_id=loop["bos_id"], pad_id=loop["pad_id"],
                                                 banned_ids=banned_ids))
            return jnp.where(at_limit_B, loop["eos_id"], best_B) if self.forced_eos else best_B

        return autoregress(tokens_to_logits, cache, pick, **loop)


@dataclasses.dataclass(frozen=True)
class Sample:
    """Ancestral sampling, scores 0; sentence b's token at step t draws with ``fold_in(keys_B[b], t)``.
    ``temperature`` > 0 divides the logits (for none, :class:`Greedy`); ``top_k``, ``top_p``: keep the
    k most likely tokens, or the fewest whose probability reaches p (``None``: all); ``processors``
    apply before the temperature (transformers' order). ``ValueError`` for a ``temperature`` not
    finite > 0 (as ``--temperature``, and transformers), a ``top_k`` not an integer ≥ 1, a ``top_p``
    outside (0, 1]."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    processors: tuple = ()
    beams: ClassVar[int] = 1

    def __post_init__(self):
        object.__setattr__(self, "temperature", check_real("temperature", self.temperature, above=0.0))
        if self.top_k is not None:
            object.__setattr__(self, "top_k", check_count("top_k", self.top_k))
        if self.top_p is not None:
            object.__setattr__(self, "top_p", check_real("top_p", self.top_p, above=0.0))
            if self.top_p > 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")

    def search(self, tokens_to_logits, cache, *, keys_B, banned_ids=None, **loop):
        def pick(logits_BV, step, out_BM, at_limit_B):
            logits = allowed_logits(logits_BV, out_BM, step, self.processors, bos_id=loop["bos_id"],
                                    pad_id=loop["pad_id"], banned_ids=banned_ids)
            # shifted to a maximum of 0 first, so a tiny temperature cannot overflow float32
            logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / self.temperature
            if self.top_k is not None and self.top_k < logits.shape[-1]:
                kth = jax.lax.top_k(logits, self.top_k)[0][:, -1:]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            if self.top_p is not None and self.top_p < 1.0:
                sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
                probs = jax.nn.softmax(sorted_logits, axis=-1)
                # The smallest prefix whose mass reaches top_p: keep tokens whose preceding mass < p.
                keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < self.top_p
                threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
                logits = jnp.where(logits < threshold, -jnp.inf, logits)
            step_keys_B = jax.vmap(jax.random.fold_in, (0, None))(keys_B, step)
            return jax.vmap(jax.random.categorical)(step_keys_B, logits).astype(jnp.int32)

        return autoregress(tokens_to_logits, cache, pick, **loop)


def strategy_for(beam_size: int, alpha: float = 0.6, length_normalization: str = "gnmt", early_stopping=False,
                 no_repeat_ngram_size: int = 0, repetition_penalty: float = 1.0, *,
                 forced_eos: bool | None = None, scored: bool = False) -> Greedy | Beam:
    """The decoding flags' strategy (all checked): :class:`Beam`, or for ``beam_size`` 1 (unless
    ``scored``: its one hypothesis scored) :class:`Greedy`. ``forced_eos``: eos at a sentence's
    limit, as an imported model's ``forced_eos_token_id`` says (:func:`jaxformer.decode.defaults.forced_eos`),
    else a cut there without eos; ``None`` (no such rule: our runs): eos for beams, and for
    greedy with ``"hf"`` only."""
    beam = Beam(beam_size, alpha, length_normalization, early_stopping,
                penalties(no_repeat_ngram_size, repetition_penalty),
                forced_eos=True if forced_eos is None else forced_eos)
    if beam.beam_size > 1 or scored:
        return beam
    return Greedy(length_normalization == "hf" if forced_eos is None else beam.forced_eos, beam.processors)
