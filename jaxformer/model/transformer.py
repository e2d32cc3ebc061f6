"""The encoder-decoder Transformer (Vaswani et al. 2017, Figure 1). Shapes: B batch, S source
length, T target length, D d_model, H heads, K = D / H, V target vocabulary, M cache length::

    model = Transformer(config)
    variables = model.init(jax.random.key(0), src_BS, tgt_BT)
    logits_BTV = model.apply(variables, src_BS, tgt_BT)
    encoder_output_BSD = model.apply(variables, src_BS, method=Transformer.encode)

Target shifting (teacher forcing) is the caller's job: ``tgt`` is fed as given.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from jaxformer.model.config import TransformerConfig
from jaxformer.model.layers import Embedding, OutputProjection, PositionalEncoding
from jaxformer.model.masks import create_padding_mask, decoder_masks, encoder_mask, segment_positions
from jaxformer.model.matmul import weight_einsum
from jaxformer.model.sharding import constrain
from jaxformer.model.stacks import Decoder, Encoder
from jaxformer.model.validation import check_count, token_id_problem


@struct.dataclass
class LayerCache:
    """One decoder layer's cache: self-attention ``self_k``, ``self_v [B, H, M, K]`` (rows
    from ``index`` on unwritten), cross-attention ``cross_k``, ``cross_v [B, H, S, K]``."""

    self_k: jax.Array
    self_v: jax.Array
    cross_k: jax.Array
    cross_v: jax.Array


@struct.dataclass
class DecodeCache:
    """The state ``tokens_to_logits`` threads: a :class:`LayerCache` per decoder layer, bool
    ``src_mask [B, 1, 1, S]``, int32 ``index`` (tokens fed so far); batch first but ``index``."""

    layers: tuple[LayerCache, ...]
    src_mask: jax.Array
    index: jax.Array

    def map_beam_state(self, fn) -> DecodeCache:
        """``fn`` applied to the leaves beams of one sentence differ in: the self-attention K/V."""
        return self.replace(layers=tuple(layer.replace(self_k=fn(layer.self_k), self_v=fn(layer.self_v))
                                         for layer in self.layers))

    def select_rows(self, rows: jax.Array) -> DecodeCache:
        """The cache of the batch rows ``rows`` (int ``[R]``), in that order."""
        return jax.tree_util.tree_map(lambda x: x if x.ndim == 0 else x[rows], self)

    def with_length(self, length: int) -> DecodeCache:
        """The cache for ``length`` ≥ M positions: self-attention K/V zero-padded on axis 2."""
        current = self.layers[0].self_k.shape[2]
        return self.map_beam_state(lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, length - current), (0, 0)]))


class Transformer(nn.Module):
    """Encoder-decoder Transformer of ``config``; ``__call__`` = ``decode(encode(src), src, tgt)``.
    The public methods check their ids once (:meth:`_check`): rank, integer dtype, length
    ``<= max_len``, batch sizes; the range ``[0, vocab)`` on concrete arrays.

    Raises:
      ValueError: from every public method, one message naming each problem and its fix.
    """

    config: TransformerConfig

    def setup(self):
        c = self.config
        self.src_embedding = Embedding(c.src_vocab_size, c, name="src_embedding")
        self.tgt_embedding = (self.src_embedding if c.share_embeddings
                              else Embedding(c.tgt_vocab_size, c, name="tgt_embedding"))
        self.positional_encoding = PositionalEncoding(c)
        self.encoder = Encoder(c)
        self.decoder = Decoder(c)
        if not c.share_embeddings:
            self.output_projection = OutputProjection(c.tgt_vocab_size, c, name="output_projection")
        elif c.final_logits_bias:
            # Marian's bias on the tied projection (departs from the paper's tied Linear, §3.4).
            self.final_logits_bias = self.param(
                "final_logits_bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
                (c.tgt_vocab_size,), c.parameter_dtype)

    def _check(self, deterministic, src, tgt=None, src_segments=None, tgt_segments=None):
        """The entry check of ``src`` ids (given ``tgt``: its ids, both batch sizes, packed
        segments) and a bool ``deterministic`` ("no" would mean True); raises as :func:`_refuse`."""
        c = self.config
        if tgt is None:
            problems = [token_id_problem(src, name="src", vocab_size=c.src_vocab_size, max_len=c.max_len)]
        else:
            problems = [token_id_problem(tgt, name="tgt", vocab_size=c.tgt_vocab_size, max_len=c.max_len)]
            if not problems[0] and src.shape[0] != tgt.shape[0]:
                problems.append(f"src and tgt must have the same batch size, got src {src.shape} and "
                                f"tgt {tgt.shape}")
            if (src_segments is None) != (tgt_segments is None):
                problems.append("packed decoding needs both src_segments and tgt_segments, or neither")
        if not isinstance(deterministic, (bool, jnp.bool_)):
            problems.append(f"deterministic must be True or False, got {deterministic!r}")
        _refuse(problems)

    def _scan_problem(self, method: str) -> str | None:
        """Cached decoding runs the decoder layers one by one: not a scanned model's."""
        if self.config.scan_layers:
            return (f"{method} runs the unrolled decoder layers, but this model has scan_layers=True; "
                    f"decode with jaxformer.model.scan.unrolled(model, variables), which gives the same "
                    f"model and parameters unrolled (the decoders of jaxformer.decode do so themselves)")
        return None

    def encode(self, src, *, deterministic: bool = True, src_segments=None):
        """Source ids ``[B, S]`` int → ``encoder_output [B, S, D]``. Packed rows' ``src_segments``
        (int ``[B, S]``): each position attends only within its segment, positions restart."""
        c = self.config
        self._check(deterministic, src)
        positions = None
        if src_segments is not None:
            chex.assert_shape(src_segments, src.shape)
            positions = segment_positions(src_segments)
        src_mask = encoder_mask(src, c.pad_id, src_segments)
        src_x = self.positional_encoding(self.src_embedding(src), deterministic, positions_BL=positions,
                                       ids_BL=src)
        encoder_output = self.encoder(src_x, src_mask, deterministic)
        chex.assert_shape(encoder_output, src.shape + (c.d_model,))
        return encoder_output

    def _logits(self, decoder_output_BLD):
        kernel_DV, bias_V = self.output_projection_weights()
        logits = weight_einsum("BLD,DV->BLV", decoder_output_BLD, kernel_DV, self.config)
        if bias_V is not None:
            logits = logits + bias_V[None, None, :]
        return constrain(logits, ("batch", "length", "vocab"))

    def output_projection_weights(self):
        """The final linear layer ``(kernel [D, V], bias [V] or None)``, compute dtype (shared:
        the table transposed and ``final_logits_bias``)."""
        c = self.config
        if c.share_embeddings:
            bias_V = self.final_logits_bias.astype(c.compute_dtype) if c.final_logits_bias else None
            return self.tgt_embedding.embedding.astype(c.compute_dtype).T, bias_V
        return self.output_projection.weights()

    def decode(self, encoder_output, src, tgt, *, deterministic: bool = True, src_segments=None,
               tgt_segments=None):
        """Teacher-forced: ``encoder_output [B,S,D]``, its ``src [B,S]``, shifted target ids
        ``tgt [B,T]`` (``bos y1 y2 …``) → ``logits [B,T,V]``. Packed rows: ``src_segments [B,S]``,
        ``tgt_segments [B,T]``; target segment j attends to itself (causally) and source segment j."""
        return self._logits(self.decoder_output(encoder_output, src, tgt, deterministic=deterministic,
                                                src_segments=src_segments, tgt_segments=tgt_segments))

    def decoder_output(self, encoder_output, src, tgt, *, deterministic: bool = True,
                       src_segments=None, tgt_segments=None):
        """:meth:`decode` without the final projection: ``[B, T, D]`` (arguments as there)."""
        c = self.config
        self._check(deterministic, src, tgt, src_segments, tgt_segments)
        chex.assert_shape(encoder_output, src.shape + (c.d_model,))
        positions = None
        if tgt_segments is not None:
            chex.assert_shape(src_segments, src.shape)
            chex.assert_shape(tgt_segments, tgt.shape)
            positions = segment_positions(tgt_segments)
        # [B,1,T,T] and [B,1,1,S] ([B,1,T,S] packed), with their segment-id forms
        tgt_mask, src_mask = decoder_masks(src, tgt, c.pad_id, src_segments, tgt_segments)
        tgt_x = self.positional_encoding(self.tgt_embedding(tgt), deterministic, positions_BL=positions,
                                       ids_BL=tgt)
        decoder_output = self.decoder(tgt_x, encoder_output, tgt_mask, src_mask, deterministic)
        chex.assert_shape(decoder_output, tgt.shape + (c.d_model,))
        return decoder_output

    def __call__(self, src, tgt, *, deterministic: bool = True, src_segments=None, tgt_segments=None):
        """``src [B,S]``, shifted target input ``tgt [B,T]`` → ``logits [B,T,V]``; training:
        ``deterministic=False`` with a ``"dropout"`` rng. Packed rows (as :meth:`decode`) get
        the logits each pair gets alone."""
        encoder_output = self.encode(src, deterministic=deterministic, src_segments=src_segments)
        return self.decode(encoder_output, src, tgt, deterministic=deterministic,
                           src_segments=src_segments, tgt_segments=tgt_segments)

    def features(self, src, tgt, *, deterministic: bool = True, src_segments=None, tgt_segments=None):
        """``__call__`` before the logits, for fused losses: ``(decoder_output [B,T,D],
        kernel [D,V], bias [V] or None)``, ``logits = decoder_output @ kernel (+ bias)``."""
        encoder_output = self.encode(src, deterministic=deterministic, src_segments=src_segments)
        decoder_output = self.decoder_output(encoder_output, src, tgt, deterministic=deterministic,
                                             src_segments=src_segments, tgt_segments=tgt_segments)
        return (decoder_output, *self.output_projection_weights())

    def init_cache(self, encoder_output, src, max_decode_len: int) -> DecodeCache:
        """The cache of ``encoder_output [B, S, D]`` and ``src [B, S]`` for M = ``max_decode_len``
        positions (BOS included; an int in ``[1, max_len]``): zero self-attention K/V
        ``[B, H, M, K]``, cross-attention K/V ``[B, H, S, K]``, ``index = 0``."""
        c = self.config
        _refuse([self._scan_problem("init_cache")])
        max_decode_len = check_count("max_decode_len", max_decode_len, maximum=c.max_len)
        batch, src_len = src.shape
        chex.assert_shape(encoder_output, (batch, src_len, c.d_model))
        zeros = jnp.zeros((batch, c.num_heads, max_decode_len, c.head_dim), c.compute_dtype)
        layers = tuple(LayerCache(self_k=zeros, self_v=zeros, cross_k=k, cross_v=v)
                       for k, v in self.decoder.cross_key_values(encoder_output))
        return DecodeCache(layers=layers, src_mask=create_padding_mask(src, c.pad_id),
                           index=jnp.zeros((), jnp.int32))

    def decode_step(self, ids_B1, cache: DecodeCache):
        """``tokens_to_logits(ids, cache)``: the current token ``ids_B1 [B, 1]`` (BOS first) and
        the cache of :meth:`init_cache` or the last step → ``(logits [B, V]`` (the teacher-forced
        :meth:`decode` logits there), the cache one position on). A full cache is refused: its
        write would be clamped into the last position, silently."""
        chex.assert_shape(ids_B1, (cache.src_mask.shape[0], 1))
        # Concrete ids are range-checked here; inside jit the decoders check on the host.
        room, index = cache.layers[0].self_k.shape[-2] if cache.layers else None, cache.index
        full = room is not None and not isinstance(index, jax.core.Tracer) and int(index) >= room
        _refuse([self._scan_problem("decode_step"),
                 token_id_problem(ids_B1, name="ids_B1", vocab_size=self.config.tgt_vocab_size),
                 full and f"decode_step: the cache holds {room} positions and all are used (index "
                          f"{int(index)}); make it with init_cache(..., max_decode_len) large enough "
                          f"for every step"])
        x_B1D = self.positional_encoding(self.tgt_embedding(ids_B1), True, offset=cache.index, ids_BL=ids_B1)
        y_B1D, layers = self.decoder.step(x_B1D, cache.layers, cache.index, cache.src_mask)
        logits_B1V = self._logits(y_B1D)
        return logits_B1V[:, 0], cache.replace(layers=layers, index=cache.index + 1)


def _refuse(problems) -> None:
    """Raises ``ValueError`` naming every problem (falsy entries are none) and its fix."""
    problems = [p for p in problems if p]
    if problems:
        raise ValueError("; ".join(problems) + ".")
