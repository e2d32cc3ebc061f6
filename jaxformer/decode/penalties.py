"""Logit processors against repetition (as fairseq, CTranslate2, Hugging Face): hashable
callables ``(scores_RV, seqs_RM, step) -> scores_RV`` on float scores ``[R, V]`` (R = batch ×
beams) for position ``step``, given the tokens generated before it (int ``[R, M]``, later
positions ignored). Strategies apply them in order (transformers' ``LogitsProcessorList``) to
logits or beam log-probabilities; a banned token gets ``-inf``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxformer.model.validation import check_count, check_real


@dataclasses.dataclass(frozen=True)
class RepetitionPenalty:
    """CTRL's repetition penalty (Keskar et al. 2019, §4.1; transformers'
    ``RepetitionPenaltyLogitsProcessor``): a token generated before has its score divided by
    ``penalty`` where positive, multiplied where negative. ``ValueError`` unless finite > 0."""

    penalty: float

    def __post_init__(self):   # a float: RepetitionPenalty(2) and (2.0) are one static argument
        object.__setattr__(self, "penalty", check_real("repetition_penalty", self.penalty, above=0.0))

    def __call__(self, scores_RV: jax.Array, seqs_RM: jax.Array, step: jax.Array) -> jax.Array:
        seen = _scatter_mask(seqs_RM, jnp.arange(seqs_RM.shape[1])[None, :] < step, scores_RV.shape[-1])
        penalized = jnp.where(scores_RV > 0, scores_RV / self.penalty, scores_RV * self.penalty)
        return jnp.where(seen, penalized, scores_RV)


@dataclasses.dataclass(frozen=True)
class NoRepeatNGram:
    """Bans each token that would repeat an n-gram of ``size`` (fairseq ``--no-repeat-ngram-size``,
    transformers' ``NoRepeatNGramLogitsProcessor``). ``ValueError`` unless an integer ≥ 1."""

    size: int

    def __post_init__(self):
        object.__setattr__(self, "size", check_count("no_repeat_ngram_size", self.size))

    def __call__(self, scores_RV: jax.Array, seqs_RM: jax.Array, step: jax.Array) -> jax.Array:
        return jnp.where(banned_ngram_mask(seqs_RM, step, self.size, scores_RV.shape[1]), -jnp.inf, scores_RV)


def penalties(no_repeat_ngram_size: int = 0, repetition_penalty: float = 1.0) -> tuple:
    """The processors of the two repetition flags (0 and 1 = off), in transformers' order;
    ``ValueError`` for a size not an integer ≥ 0 or a penalty not a finite number > 0."""
    size = check_count("no_repeat_ngram_size", no_repeat_ngram_size, minimum=0)
    penalty = RepetitionPenalty(repetition_penalty)
    return ((penalty,) if penalty.penalty != 1.0 else ()) + ((NoRepeatNGram(size),) if size else ())


def apply_processors(processors: tuple, scores_RV: jax.Array, seqs_RM: jax.Array, step: jax.Array):
    """``scores_RV`` after each processor in turn, as float32."""
    scores_RV = scores_RV.astype(jnp.float32)
    for processor in processors:
        scores_RV = processor(scores_RV, seqs_RM, step)
    return scores_RV


def _scatter_mask(ids_RJ: jax.Array, keep_RJ: jax.Array, vocab: int) -> jax.Array:
    """bool ``[R, V]``: True at each ``ids_RJ[r, j]`` where ``keep_RJ[r, j]``."""
    rows = jnp.arange(ids_RJ.shape[0])[:, None]
    where = jnp.where(keep_RJ, ids_RJ, vocab)   # out of range: dropped
    return jnp.zeros((ids_RJ.shape[0], vocab), jnp.bool_).at[rows, where].set(True, mode="drop")


def banned_ngram_mask(seqs_RM: jax.Array, step: jax.Array, n: int, vocab: int) -> jax.Array:
    """bool ``[R, V]``: the tokens that would repeat an n-gram at ``step`` (an n-gram complete
    before ``step`` whose first n-1 equal ``seqs[step-n+1 : step]`` bans its last)."""
    length = seqs_RM.shape[1]
    if n > length:
        return jnp.zeros((seqs_RM.shape[0], vocab), jnp.bool_)
    windows = length - n + 1                                    # J: n-gram start positions
    match_RJ = jnp.arange(windows)[None, :] + n - 1 < step      # the n-gram ends before `step`
    for i in range(n - 1):                                      # its prefix equals the suffix
        suffix_R = jax.lax.dynamic_index_in_dim(seqs_RM, jnp.maximum(step - n + 1 + i, 0), axis=1,
                                                keepdims=True)
        match_RJ &= seqs_RM[:, i:i + windows] == suffix_R
    return _scatter_mask(seqs_RM[:, n - 1:n - 1 + windows], match_RJ, vocab)
