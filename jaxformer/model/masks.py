"""Attention masks: the one mask convention of jaxformer.

Convention: masks are boolean and ``True`` means "may attend". They broadcast
against attention scores ``[B, H, Tq, Tk]``. Special ids come from the tokenizer or
the config (``pad_id``), never a literal 0.
"""

from __future__ import annotations

import chex
import jax
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

    Position 0 holds the decoder start token and is never treated as padding, even
    when its id is ``pad_id``: Marian (and Hugging Face's ``shift_tokens_right``)
    starts decoding with the pad id. Targets are padded on the right, so no other
    position is affected.

    Args:
      tgt: target ids ``[B, T]`` (the shifted decoder input, start token first).
      pad_id: the padding id.

    Returns:
      bool ``[B, 1, T, T]``.
    """
    batch, length = tgt.shape
    is_start_1L = (jnp.arange(length) == 0)[None, :]
    keys_B11T = ((tgt != pad_id) | is_start_1L)[:, None, None, :]
    mask = create_causal_mask(length)[None, None] & keys_B11T
    chex.assert_shape(mask, (batch, 1, length, length))
    return mask


def create_segment_mask(query_segments: chex.Array, key_segments: chex.Array) -> chex.Array:
    """Packed rows: a query may attend only to keys of its own segment (sentence).

    Args:
      query_segments: int ``[B, Tq]``, the segment number of each query position.
      key_segments: int ``[B, Tk]``.

    Returns:
      bool ``[B, 1, Tq, Tk]``; combine with the padding or decoder mask by ``&``.
    """
    chex.assert_rank([query_segments, key_segments], 2)
    mask = query_segments[:, None, :, None] == key_segments[:, None, None, :]
    chex.assert_shape(mask, (query_segments.shape[0], 1, query_segments.shape[1], key_segments.shape[1]))
    return mask


def segment_positions(segments: chex.Array) -> chex.Array:
    """Positions that restart at 0 where the segment number changes: int32 ``[B, L]``.

    ``[[1, 1, 1, 2, 2, 0]]`` → ``[[0, 1, 2, 0, 1, 0]]`` (padding gets some position;
    it is masked out everywhere).
    """
    chex.assert_rank(segments, 2)
    index = jnp.arange(segments.shape[1], dtype=jnp.int32)[None, :]
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], jnp.bool_),
                              segments[:, 1:] != segments[:, :-1]], axis=1)
    start_of_segment = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return index - start_of_segment
