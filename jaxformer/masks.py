"""Attention masks: the one mask convention of jaxformer.

Convention: masks are boolean and ``True`` means "may attend". They broadcast
against attention scores ``[B, H, Tq, Tk]``. Special ids come from the tokenizer or
the config (``pad_id``), never a literal 0.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp


def create_padding_mask(tokens: chex.Array, pad_id: int) -> chex.Array:
    """Key-padding mask: which key positions hold real tokens.

    Args:
      tokens: integer ids ``[B, L]``.
      pad_id: the padding id (from the tokenizer / ``TransformerConfig.pad_id``).

    Returns:
      bool ``[B, 1, 1, L]``, ``True`` where ``tokens != pad_id``.
    """
    chex.assert_rank(tokens, 2)
    mask = (tokens != pad_id)[:, None, None, :]
    chex.assert_shape(mask, (tokens.shape[0], 1, 1, tokens.shape[1]))
    return mask


def create_causal_mask(length: int) -> chex.Array:
    """Look-ahead mask of the decoder's self-attention (§3.2.3).

    Args:
      length: target length T.

    Returns:
      bool ``[T, T]``, lower triangular: query t may attend to keys 0..t.
    """
    mask = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    chex.assert_shape(mask, (length, length))
    return mask


def create_decoder_mask(tgt: chex.Array, pad_id: int) -> chex.Array:
    """Decoder self-attention mask: causal AND target key padding.

    Args:
      tgt: target ids ``[B, T]``.
      pad_id: the padding id.

    Returns:
      bool ``[B, 1, T, T]``.
    """
    batch, length = tgt.shape
    mask = create_causal_mask(length)[None, None] & create_padding_mask(tgt, pad_id)
    chex.assert_shape(mask, (batch, 1, length, length))
    return mask
