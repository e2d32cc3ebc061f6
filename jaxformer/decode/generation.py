"""A model's own generation rules, as transformers' ``generate`` applies them: which ids are
never generated (:func:`banned_mask`; transformers' ``bad_words_ids``) and a forced first
token (:class:`ForcedFirstToken`; its ``forced_bos_token_id``, the target language of
M2M100/NLLB). The decoder start id is the decoders' ``bos_id``. V vocabulary, R rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def banned_mask(vocab: int, *, bos_id: int, pad_id: int, banned_ids: tuple | None = None) -> jax.Array:
    """bool ``[V]``: the ids never generated: ``banned_ids`` (``()``: none, as ``generate`` without
    ``bad_words_ids``), or by default (``None``) pad and the decoder start ``bos_id``."""
    banned = (pad_id, bos_id) if banned_ids is None else tuple(banned_ids)
    if not banned:
        return jnp.zeros((vocab,), jnp.bool_)
    return jnp.isin(jnp.arange(vocab), jnp.asarray(banned, jnp.int32))


@dataclasses.dataclass(frozen=True)
class ForcedFirstToken:
    """A logit processor (:mod:`jaxformer.decode.penalties`' contract): at step 0 every score but
    ``token_id``'s is -inf and its is 0 (transformers' ``ForcedBOSTokenLogitsProcessor``);
    later steps pass through."""

    token_id: int

    def __post_init__(self):
        object.__setattr__(self, "token_id", int(self.token_id))

    def __call__(self, scores_RV: jax.Array, seqs_RM: jax.Array, step: jax.Array) -> jax.Array:
        forced_1V = (jnp.arange(scores_RV.shape[-1]) == self.token_id)[None, :]
        return jnp.where(step == 0, jnp.where(forced_1V, 0.0, -jnp.inf), scores_RV)


def with_forced_first(strategy, token_id: int | None):
    """``strategy`` with :class:`ForcedFirstToken` ``token_id`` after its processors (``None``:
    unchanged), as ``generate`` puts ``ForcedBOSTokenLogitsProcessor`` after the penalties."""
    if token_id is None:
        return strategy
    return dataclasses.replace(strategy, processors=(*strategy.processors, ForcedFirstToken(token_id)))
