"""Attention masks: bool, ``True`` = "may attend", broadcasting against the scores
``[B, H, Tq, Tk]``; the padding id comes from the tokenizer or config, never a literal 0.

The model's masks are "key not padding AND same segment (AND causal)", carried as an
:class:`AttentionMask`: dense (reference and fused backends) and as segment ids (splash).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# The kv segment id of padding keys, which no query carries (segments are numbered 1, 2, …).
PADDING_SEGMENT = np.iinfo(np.int32).min


def create_padding_mask(tokens: chex.Array, pad_id: int) -> chex.Array:
    """Key-padding mask of ids ``tokens [B, L]``: bool ``[B, 1, 1, L]``, True where ``!= pad_id``."""
    chex.assert_rank(tokens, 2)
    return (tokens != pad_id)[:, None, None, :]


def create_causal_mask(length: int) -> chex.Array:
    """Look-ahead mask (§3.2.3): bool ``[T, T]``, lower triangular (query t sees keys 0..t)."""
    return jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))


def create_decoder_mask(tgt: chex.Array, pad_id: int) -> chex.Array:
    """Decoder self-attention mask of shifted target ids ``tgt [B, T]``: causal AND target key
    padding, bool ``[B, 1, T, T]``. Position 0, the start token, is never padding (Marian
    starts with the pad id; targets are padded on the right)."""
    chex.assert_rank(tgt, 2)
    return create_causal_mask(tgt.shape[1])[None, None] & _decoder_keys(tgt, pad_id)[:, None, None, :]


def _decoder_keys(tgt: chex.Array, pad_id: int) -> chex.Array:
    """bool ``[B, T]``: target keys not padding, or position 0 (:func:`create_decoder_mask`)."""
    is_start_1T = (jnp.arange(tgt.shape[1]) == 0)[None, :]
    return (tgt != pad_id) | is_start_1T


def create_segment_mask(query_segments: chex.Array, key_segments: chex.Array) -> chex.Array:
    """Packed rows: query segments int ``[B, Tq]``, key segments ``[B, Tk]`` → bool
    ``[B, 1, Tq, Tk]``, True where they are equal (combine with ``&``)."""
    chex.assert_rank([query_segments, key_segments], 2)
    return query_segments[:, None, :, None] == key_segments[:, None, None, :]


def segment_positions(segments: chex.Array) -> chex.Array:
    """Positions restarting at 0 where the segment changes, int32 ``[B, L]``:
    ``[[1, 1, 1, 2, 2, 0]]`` → ``[[0, 1, 2, 0, 1, 0]]`` (padding's is masked out)."""
    chex.assert_rank(segments, 2)
    index = jnp.arange(segments.shape[1], dtype=jnp.int32)[None, :]
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], jnp.bool_),
                              segments[:, 1:] != segments[:, :-1]], axis=1)
    start_of_segment = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return index - start_of_segment


@struct.dataclass
class AttentionMask:
    """One mask in both forms (a pytree, ``causal`` static): ``dense`` bool broadcasting to
    ``[B, 1, Tq, Tk]`` equals ``dense_from_segments(q_segments, kv_segments, causal)`` of int32
    ``[B, Tq]``, ``[B, Tk]`` segments (1 unpacked; padding keys :data:`PADDING_SEGMENT`)."""

    dense: jax.Array
    q_segments: jax.Array
    kv_segments: jax.Array
    causal: bool = struct.field(pytree_node=False, default=False)


def dense_from_segments(q_segments: chex.Array, kv_segments: chex.Array, causal: bool) -> chex.Array:
    """The dense mask of segment ids, as the splash kernel reads them: bool ``[B, 1, Tq, Tk]``,
    same segment (and, if ``causal``, key not after query)."""
    mask = create_segment_mask(q_segments, kv_segments)
    if causal:
        chex.assert_equal(q_segments.shape[1], kv_segments.shape[1])
        mask = mask & create_causal_mask(q_segments.shape[1])[None, None]
    return mask


def _segments(keys_valid_BL, query_len, q_segments=None, kv_segments=None):
    """``(q_segments [B, Tq], kv_segments [B, L])`` int32 (1 unpacked); invalid keys get
    :data:`PADDING_SEGMENT`."""
    batch = keys_valid_BL.shape[0]
    if q_segments is None:
        q_segments = jnp.ones((batch, query_len), jnp.int32)
        kv_segments = jnp.ones(keys_valid_BL.shape, jnp.int32)
    kv_segments = jnp.where(keys_valid_BL, kv_segments.astype(jnp.int32), PADDING_SEGMENT)
    return q_segments.astype(jnp.int32), kv_segments


def encoder_mask(src: chex.Array, pad_id: int, src_segments: chex.Array | None = None) -> AttentionMask:
    """Encoder self-attention mask of ``src [B, S]``: key padding (& same ``src_segments``),
    dense ``[B, 1, 1, S]`` (``[B, 1, S, S]`` packed)."""
    dense = create_padding_mask(src, pad_id)
    if src_segments is not None:
        dense = dense & create_segment_mask(src_segments, src_segments)
    q_segments, kv_segments = _segments(src != pad_id, src.shape[1], src_segments, src_segments)
    return AttentionMask(dense=dense, q_segments=q_segments, kv_segments=kv_segments)


def decoder_masks(src: chex.Array, tgt: chex.Array, pad_id: int, src_segments: chex.Array | None = None,
                  tgt_segments: chex.Array | None = None) -> tuple[AttentionMask, AttentionMask]:
    """The decoder's ``(tgt_mask, src_mask)`` of ``src [B, S]``, shifted ``tgt [B, T]`` (packed:
    both segment arrays): :func:`create_decoder_mask` & same segment, dense ``[B, 1, T, T]``;
    source key padding & target segment j sees source segment j, ``[B, 1, 1, S]`` (``[B, 1, T, S]``)."""
    tgt_dense = create_decoder_mask(tgt, pad_id)
    src_dense = create_padding_mask(src, pad_id)
    if tgt_segments is not None:
        src_dense = src_dense & create_segment_mask(tgt_segments, src_segments)   # [B,1,T,S]
        tgt_dense = tgt_dense & create_segment_mask(tgt_segments, tgt_segments)   # [B,1,T,T]
    length = tgt.shape[1]
    tgt_q, tgt_kv = _segments(_decoder_keys(tgt, pad_id), length, tgt_segments, tgt_segments)
    src_q, src_kv = _segments(src != pad_id, length, tgt_segments, src_segments)
    return (AttentionMask(dense=tgt_dense, q_segments=tgt_q, kv_segments=tgt_kv, causal=True),
            AttentionMask(dense=src_dense, q_segments=src_q, kv_segments=src_kv))
