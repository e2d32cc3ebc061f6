"""Decoding penalties against repetition, applied inside the decoding loops.

Two rules, as fairseq, Marian/CTranslate2 and Hugging Face ``generate`` offer them:

* ``no_repeat_ngram_size`` n (fairseq ``--no-repeat-ngram-size``, transformers
  ``NoRepeatNGramLogitsProcessor``): a token that would complete an n-gram the
  hypothesis already holds is banned (score -inf). n = 1 bans every token generated
  before.
* ``repetition_penalty`` p (Keskar et al. 2019, CTRL §4.1; transformers
  ``RepetitionPenaltyLogitsProcessor``): the score of every token already generated is
  divided by p where positive and multiplied by p where negative, so p > 1 makes
  repeats less likely. It applies to what the decoder ranks: the log-probabilities in
  beam search (as ``generate`` applies its processors to log-softmax scores there),
  the logits in greedy decoding and sampling.

Both look only at the generated tokens (the decoder start token is never generated,
so an n-gram through it can never repeat). Shapes: R rows (batch × beams), M the
longest output, V the vocabulary; ``seqs_RM`` holds the tokens generated so far at
positions ``< step`` (anything after is ignored).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxformer.model.validation import check_count, check_real


@dataclasses.dataclass(frozen=True)
class Penalties:
    """The repetition rules of one decoder (hashable: a static argument of the jitted
    decoders). The defaults change nothing and compile nothing extra.

    Raises:
      ValueError: ``no_repeat_ngram_size`` not an integer ≥ 0, or ``repetition_penalty``
        not a finite number > 0.
    """

    no_repeat_ngram_size: int = 0     # 0 = off
    repetition_penalty: float = 1.0   # 1 = off

    def __post_init__(self):
        # Stored as int and float: Penalties(2.0) == Penalties(2) would share a compiled
        # decoder that runs range(2.0). NumPy scalars are taken as Python ones.
        object.__setattr__(self, "no_repeat_ngram_size",
                           check_count("no_repeat_ngram_size", self.no_repeat_ngram_size, minimum=0))
        object.__setattr__(self, "repetition_penalty", check_real(
            "repetition_penalty", self.repetition_penalty, above=0.0))   # 1 = off; > 1 penalises repeats

    @property
    def active(self) -> bool:
        return self.no_repeat_ngram_size > 0 or self.repetition_penalty != 1.0

    def apply(self, scores_RV: jax.Array, seqs_RM: jax.Array, step: jax.Array, *,
              banned_value: float) -> jax.Array:
        """``scores_RV`` (float ``[R, V]``) after both rules, for the token at position
        ``step`` of ``seqs_RM`` (int ``[R, M]``); banned tokens get ``banned_value``."""
        if self.repetition_penalty != 1.0:
            scores_RV = repetition_penalized(scores_RV, seqs_RM, step, self.repetition_penalty)
        if self.no_repeat_ngram_size > 0:
            banned = banned_ngram_mask(seqs_RM, step, self.no_repeat_ngram_size, scores_RV.shape[-1])
            scores_RV = jnp.where(banned, banned_value, scores_RV)
        return scores_RV


NO_PENALTIES = Penalties()


def _scatter_mask(ids_RJ: jax.Array, keep_RJ: jax.Array, vocab: int) -> jax.Array:
    """bool ``[R, V]``: True at each ``ids_RJ[r, j]`` where ``keep_RJ[r, j]``."""
    rows = jnp.arange(ids_RJ.shape[0])[:, None]
    where = jnp.where(keep_RJ, ids_RJ, vocab)   # out of range: dropped
    return jnp.zeros((ids_RJ.shape[0], vocab), jnp.bool_).at[rows, where].set(True, mode="drop")


def generated_mask(seqs_RM: jax.Array, step: jax.Array, vocab: int) -> jax.Array:
    """bool ``[R, V]``: the tokens at positions ``< step`` of each row."""
    positions = jnp.arange(seqs_RM.shape[1])[None, :]
    return _scatter_mask(seqs_RM, positions < step, vocab)


def repetition_penalized(scores_RV: jax.Array, seqs_RM: jax.Array, step: jax.Array,
                         penalty: float) -> jax.Array:
    """CTRL's repetition penalty on the tokens generated so far (module docstring)."""
    seen = generated_mask(seqs_RM, step, scores_RV.shape[-1])
    penalized = jnp.where(scores_RV > 0, scores_RV / penalty, scores_RV * penalty)
    return jnp.where(seen, penalized, scores_RV)


def banned_ngram_mask(seqs_RM: jax.Array, step: jax.Array, n: int, vocab: int) -> jax.Array:
    """bool ``[R, V]``: the tokens that would repeat an n-gram at position ``step``.

    An n-gram starting at j (``seqs[j : j+n]``, complete before ``step``) bans its last
    token when its first n-1 tokens equal the last n-1 generated ones,
    ``seqs[step-n+1 : step]``. O(M · n) per row, one scatter.
    """
    length = seqs_RM.shape[1]
    if n > length:
        return jnp.zeros((seqs_RM.shape[0], vocab), jnp.bool_)
    windows = length - n + 1                                    # J: n-gram start positions
    starts = jnp.arange(windows)[None, :]
    match_RJ = starts + n - 1 < step                            # the n-gram ends before `step`
    for i in range(n - 1):                                      # its prefix equals the suffix
        suffix_R = jax.lax.dynamic_index_in_dim(seqs_RM, jnp.maximum(step - n + 1 + i, 0), axis=1,
                                                keepdims=True)
        match_RJ &= seqs_RM[:, i:i + windows] == suffix_R
    return _scatter_mask(seqs_RM[:, n - 1:n - 1 + windows], match_RJ, vocab)
