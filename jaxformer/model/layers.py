"""The boxes of the paper's Figure 1, one small Linen module each.

Glossary of shapes: B batch, S source length, T target length, D d_model,
H heads, K = D / H, F d_ff, V vocabulary size, L either length.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.attention import MultiHeadAttention
from jaxformer.model.config import TransformerConfig
from jaxformer.model.dropout import Dropout
from jaxformer.model.matmul import dense_dot_general
from jaxformer.model.sharding import constrain


def _partitioned(init, *names):
    """``init`` whose parameter carries logical axis names (see :mod:`jaxformer.model.sharding`)."""
    return nn.with_logical_partitioning(init, names)


def layer_norm(config: TransformerConfig, name: str | None = None) -> nn.LayerNorm:
    """LayerNorm over D (float32 statistics, ε = ``config.layer_norm_epsilon``)."""
    return nn.LayerNorm(epsilon=config.layer_norm_epsilon, dtype=config.compute_dtype,
                        param_dtype=config.parameter_dtype,
                        scale_init=_partitioned(nn.initializers.ones_init(), "embed"),
                        bias_init=_partitioned(nn.initializers.zeros_init(), "embed"), name=name)


def sinusoidal_positional_encoding(max_len: int, d_model: int, layout: str = "interleaved",
                                   pad_id: int = 0) -> np.ndarray:
    """The positional table of §3.5, float32 NumPy ``[1, max_len, D]``: ``"interleaved"``
    (paper) PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(…); ``"split"``
    (Marian's ``MarianSinusoidalPositionalEmbedding``) sines in ``[0, D/2)``, cosines after;
    ``"fairseq"`` (transformers' ``M2M100SinusoidalPositionalEmbedding.get_embedding``, from
    fairseq): sin(p · e^(-i·ln(10000)/(D/2 - 1))) then the cosines, for p = ``pad_id`` + 1 + pos
    (fairseq counts positions past the padding index), in float32 as torch computes it."""
    if layout == "fairseq":
        half = d_model // 2
        rate = np.exp(np.arange(half, dtype=np.float32) * np.float32(-np.log(10000.0) / (half - 1)))
        angle = np.arange(pad_id + 1, pad_id + 1 + max_len, dtype=np.float32)[:, None] * rate[None, :]
        return np.concatenate([np.sin(angle), np.cos(angle)], axis=1)[None].astype(np.float32)
    position = np.arange(max_len, dtype=np.float64)[:, None]
    angle = position / np.power(10000.0, np.arange(0, d_model, 2, dtype=np.float64) / d_model)
    sin, cos = np.sin(angle), np.cos(angle[:, : d_model // 2])
    if layout == "split":
        table = np.concatenate([sin, cos], axis=1)
    else:   # interleaved
        table = np.zeros((max_len, d_model), dtype=np.float64)
        table[:, 0::2], table[:, 1::2] = sin, cos
    return table[None].astype(np.float32)


class Embedding(nn.Module):
    """Token embedding scaled by √d_model (§3.4); shared, its table transposed is the output
    projection too."""

    vocab_size: int
    config: TransformerConfig

    def setup(self):
        c = self.config
        self.embedding = self.param(
            "embedding", _partitioned(nn.initializers.normal(stddev=c.d_model ** -0.5), "vocab", "embed"),
            (self.vocab_size, c.d_model), c.parameter_dtype)

    def __call__(self, ids_BL):
        """ids ``[B, L]`` int → ``[B, L, D]`` in the compute dtype."""
        c = self.config
        x = jnp.take(self.embedding, ids_BL, axis=0)
        if c.matmul_dtype is not None:   # the table's rows as the tied projection sees them
            x = x.astype(c.matmul_dtype)
        x = x.astype(c.compute_dtype) * jnp.asarray(np.sqrt(c.d_model), c.compute_dtype)
        return constrain(x, ("batch", "length", "embed"))


class OutputProjection(nn.Module):
    """The final linear layer's parameters (Figure 1, "Linear") when embeddings are not
    shared: ``kernel [D, V]`` (LeCun normal), ``bias [V]``."""

    vocab_size: int
    config: TransformerConfig

    def setup(self):
        c = self.config
        self.kernel = self.param("kernel", _partitioned(nn.initializers.lecun_normal(), "embed", "vocab"),
                                 (c.d_model, self.vocab_size), c.parameter_dtype)
        self.bias = self.param("bias", _partitioned(nn.initializers.zeros_init(), "vocab"),
                               (self.vocab_size,), c.parameter_dtype)

    def weights(self):
        """``(kernel [D, V], bias [V])`` in the compute dtype."""
        dtype = self.config.compute_dtype
        return self.kernel.astype(dtype), self.bias.astype(dtype)


class PositionalEncoding(nn.Module):
    """Adds the sinusoidal table and applies embedding dropout (§3.5, §5.4)."""

    config: TransformerConfig

    def setup(self):
        c = self.config
        self.table = sinusoidal_positional_encoding(c.max_len, c.d_model, c.positional_layout,   # [1, N, D]
                                                    c.pad_id)
        self.dropout = Dropout(c.dropout_rate)

    def __call__(self, x_BLD, deterministic: bool, offset=0, positions_BL=None, ids_BL=None):
        """Adds PE rows ``offset .. offset+L-1`` (``offset`` may be traced), or rows ``positions_BL``
        (int ``[B, L]``, packed rows). ``ids_BL`` (int ``[B, L]``): with the ``"fairseq"`` layout a
        pad token gets no position (transformers' zero row at ``padding_idx``; a pad that M2M100
        generates is embedded so)."""
        length = x_BLD.shape[1]
        pe_1LD = jnp.asarray(self.table)
        if positions_BL is not None:
            chex.assert_shape(positions_BL, x_BLD.shape[:2])
            pe_1LD = jnp.take(pe_1LD[0], positions_BL, axis=0)       # [B, L, D]
        elif isinstance(offset, int) and offset == 0:
            pe_1LD = pe_1LD[:, :length]
        else:
            pe_1LD = jax.lax.dynamic_slice_in_dim(pe_1LD, offset, length, axis=1)
        if ids_BL is not None and self.config.positional_layout == "fairseq":
            pe_1LD = jnp.where((ids_BL == self.config.pad_id)[:, :, None], 0.0, pe_1LD)
        return self.dropout(x_BLD + pe_1LD.astype(x_BLD.dtype), deterministic=deterministic)


_ACTIVATIONS = {"relu": nn.relu, "swish": nn.swish,
                # exact (erf) GELU, as torch's and Hugging Face's "gelu"; not the tanh form
                "gelu": lambda x: nn.gelu(x, approximate=False)}


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = act(x W1 + b1) W2 + b2 (§3.3, Eq. 2), act = ``config.activation`` (paper: ReLU)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BLD):
        c = self.config
        dense = dict(dtype=c.compute_dtype, param_dtype=c.parameter_dtype, dot_general=dense_dot_general(c))
        xavier, zeros = nn.initializers.xavier_uniform(), nn.initializers.zeros_init()
        w1 = nn.Dense(c.d_ff, name="w1", kernel_init=_partitioned(xavier, "embed", "mlp"),
                      bias_init=_partitioned(zeros, "mlp"), **dense)
        hidden_BLF = _ACTIVATIONS[c.activation](w1(x_BLD))
        hidden_BLF = constrain(hidden_BLF, ("batch", "length", "mlp"))
        return nn.Dense(c.d_model, name="w2", kernel_init=_partitioned(xavier, "mlp", "embed"),
                        bias_init=_partitioned(zeros, "embed"), **dense)(hidden_BLF)


class AddNorm(nn.Module):
    """Residual and LayerNorm around one sub-layer (§3.1, §5.4): ``"post"`` (paper)
    ``LayerNorm(x + Dropout(Sublayer(x)))``, ``"pre"`` ``x + Dropout(Sublayer(LayerNorm(x)))``.
    Use as ``x = add_norm(x, sublayer(add_norm.sublayer_input(x)), deterministic)``."""

    config: TransformerConfig

    def setup(self):
        c = self.config
        self.norm = layer_norm(c)
        self.dropout = Dropout(c.dropout_rate)

    def sublayer_input(self, x):
        """What the sub-layer sees: ``x`` (post-norm) or ``LayerNorm(x)`` (pre-norm)."""
        return self.norm(x) if self.config.norm_position == "pre" else x

    def __call__(self, x, sublayer_output, deterministic: bool):
        y = x + self.dropout(sublayer_output, deterministic=deterministic)
        return self.norm(y) if self.config.norm_position == "post" else y


class EncoderLayer(nn.Module):
    """Self-attention → Add & Norm → FFN → Add & Norm."""

    config: TransformerConfig

    def setup(self):
        self.self_attention = MultiHeadAttention(self.config)
        self.attention_norm = AddNorm(self.config)
        self.feed_forward = PositionwiseFeedForward(self.config)
        self.feed_forward_norm = AddNorm(self.config)

    def __call__(self, x_BSD, src_mask, deterministic: bool):
        """``x_BSD [B, S, D]`` → ``[B, S, D]``. ``src_mask``: an ``AttentionMask`` (or bool array)
        broadcasting to ``[B, H, S, S]``, **True = may attend** (padding ``[B, 1, 1, S]``,
        ``[B, 1, S, S]`` packed); a query with no key gets zeros."""
        y = self.attention_norm.sublayer_input(x_BSD)
        x_BSD = self.attention_norm(x_BSD, self.self_attention(y, y, src_mask, deterministic),
                                    deterministic)
        y = self.feed_forward_norm.sublayer_input(x_BSD)
        return self.feed_forward_norm(x_BSD, self.feed_forward(y), deterministic)


class DecoderLayer(nn.Module):
    """Masked self-attention → cross-attention → FFN, each with Add & Norm (§3.1)."""

    config: TransformerConfig

    def setup(self):
        self.self_attention = MultiHeadAttention(self.config)
        self.self_attention_norm = AddNorm(self.config)
        self.cross_attention = MultiHeadAttention(self.config)
        self.cross_attention_norm = AddNorm(self.config)
        self.feed_forward = PositionwiseFeedForward(self.config)
        self.feed_forward_norm = AddNorm(self.config)

    def __call__(self, x_BTD, encoder_output_BSD, tgt_mask, src_mask, deterministic: bool):
        """Teacher-forced: ``x_BTD [B, T, D]`` and ``encoder_output_BSD [B, S, D]`` → ``[B, T, D]``.
        Masks (``AttentionMask`` or bool, **True = may attend**): ``tgt_mask`` broadcasting to
        ``[B, H, T, T]`` (:func:`create_decoder_mask`), ``src_mask`` to ``[B, H, T, S]``."""
        y = self.self_attention_norm.sublayer_input(x_BTD)
        x_BTD = self.self_attention_norm(
            x_BTD, self.self_attention(y, y, tgt_mask, deterministic), deterministic)
        k, v = self.cross_attention.project_key_value(encoder_output_BSD)
        return self._cross_and_feed_forward(x_BTD, k, v, src_mask, deterministic)

    def _cross_and_feed_forward(self, x_BTD, cross_k, cross_v, src_mask, deterministic):
        y = self.cross_attention_norm.sublayer_input(x_BTD)
        q = self.cross_attention.project_query(y)
        x_BTD = self.cross_attention_norm(
            x_BTD, self.cross_attention.attend(q, cross_k, cross_v, src_mask, deterministic),
            deterministic)
        y = self.feed_forward_norm.sublayer_input(x_BTD)
        return self.feed_forward_norm(x_BTD, self.feed_forward(y), deterministic)

    def cross_key_value(self, encoder_output_BSD):
        """Cross-attention keys/values ``[B, H, S, K]``, computed once per source."""
        return self.cross_attention.project_key_value(encoder_output_BSD)

    def step(self, x_B1D, cache, index, src_mask):
        """The embedded token ``x_B1D [B, 1, D]`` at position ``index`` (int32), this layer's
        ``LayerCache`` and bool ``src_mask [B, 1, 1, S]`` → ``(y [B, 1, D], updated LayerCache)``."""
        y = self.self_attention_norm.sublayer_input(x_B1D)
        q = self.self_attention.project_query(y)
        self_k, self_v = (jax.lax.dynamic_update_slice_in_dim(old, new.astype(old.dtype), index, axis=2)
                          for old, new in zip((cache.self_k, cache.self_v),
                                              self.self_attention.project_key_value(y)))
        causal_1_1_1_M = (jnp.arange(cache.self_k.shape[2]) <= index)[None, None, None, :]
        attended = self.self_attention.attend(q, self_k, self_v, causal_1_1_1_M, True)
        x_B1D = self.self_attention_norm(x_B1D, attended, True)
        x_B1D = self._cross_and_feed_forward(x_B1D, cache.cross_k, cache.cross_v, src_mask, True)
        return x_B1D, cache.replace(self_k=self_k, self_v=self_v)
