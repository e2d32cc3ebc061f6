"""Scaled dot-product attention (§3.2.1) and multi-head attention (§3.2.2).

Shapes: B batch, S keys, T queries, D d_model, H heads, K = D / H. Masks follow
:mod:`jaxformer.model.masks` (bool, True = attend). Backends: the reference core,
:func:`jax.nn.dot_product_attention` (``"xla"``, ``"cudnn"``), the splash kernel (``"pallas"``).
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.model.config import TransformerConfig
from jaxformer.model.dropout import keep_mask
from jaxformer.model.masks import AttentionMask
from jaxformer.model.matmul import weight_einsum
from jaxformer.model.sharding import constrain
from jaxformer.model.splash import splash_dot_product_attention


def _single_head_attention(q_TK, k_SK, v_SK, mask_TS, keep_TS):
    """softmax(q kᵀ / √K + M) v of one example and head, scores in float32; a fully masked
    query gets zero weights and output (masked scores are float32's minimum, then zeroed)."""
    scale = jnp.asarray(q_TK.shape[-1] ** -0.5, q_TK.dtype)
    scores_TS = jnp.einsum("TK,SK->TS", q_TK * scale, k_SK, preferred_element_type=jnp.float32)
    scores_TS = jnp.where(mask_TS, scores_TS, jnp.finfo(jnp.float32).min)
    weights_TS = jnp.where(mask_TS, jax.nn.softmax(scores_TS, axis=-1), 0.0)
    dropped_TS = weights_TS * keep_TS
    out_TK = jnp.einsum("TS,SK->TK", dropped_TS.astype(v_SK.dtype), v_SK)
    return out_TK, weights_TS


def _check_qkv(q, k, v, mask):
    """Asserts ``q [B, H, T, K]``, ``k``, ``v [B, H, S, K]`` and a bool mask; ``(B, H, T, S)``."""
    chex.assert_rank([q, k, v], 4)
    chex.assert_shape([k, v], (*q.shape[:2], k.shape[2], q.shape[3]))
    if mask is not None:
        chex.assert_type(mask, bool)
    return (*q.shape[:3], k.shape[2])


def scaled_dot_product_attention(q, k, v, mask=None, *, dropout_rate: float = 0.0,
                                 dropout_rng: chex.PRNGKey | None = None):
    """Attention(Q, K, V) = softmax(QKᵀ/√d_k)V (Eq. 1), the one-head core vmapped over H and B.

    ``q [B, H, T, K]`` (any float dtype), ``k``, ``v [B, H, S, K]``, an optional bool ``mask``
    broadcasting to ``[B, H, T, S]`` (True = attend), dropout on the weights with ``dropout_rng``
    → ``(outputs [B, H, T, K]`` in ``v.dtype``, pre-dropout float32 ``weights [B, H, T, S])``;
    fully masked rows give zeros.
    """
    batch, heads, q_len, kv_len = _check_qkv(q, k, v, mask)
    full = (batch, heads, q_len, kv_len)
    mask = jnp.broadcast_to(True if mask is None else mask, full)
    if dropout_rng is not None and dropout_rate > 0.0:
        keep, keep_probability = keep_mask(dropout_rng, dropout_rate, full)
        keep = keep.astype(jnp.float32) / keep_probability
    else:
        keep = jnp.ones(full, jnp.float32)
    per_head = jax.vmap(_single_head_attention)          # over H
    per_example = jax.vmap(per_head)                      # over B
    return per_example(q, k, v, mask, keep)


def fused_dot_product_attention(q, k, v, mask=None, *, implementation: str | None = None):
    """:func:`scaled_dot_product_attention`'s outputs ``[B, H, T, K]`` (``v.dtype``; no dropout
    or weights) by :func:`jax.nn.dot_product_attention`, ``implementation`` ``None`` (JAX
    picks), ``"xla"`` or ``"cudnn"`` (NVIDIA, 16-bit). Softmax in float32; a fully masked
    query gets zeros (the fused kernels would return the mean of ``v``)."""
    batch, heads, q_len, _ = _check_qkv(q, k, v, mask)
    to_BLHK = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  (the fused API's layout)
    out_dtype = v.dtype
    if q.dtype == jnp.float16 and implementation != "cudnn" and jax.default_backend() == "cpu":
        # XLA:CPU has no float16 dot with float32 accumulation, which the fused API asks
        # for under jit ("precision F16_F16_F32 is not supported"): compute in float32.
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    out_BTHK = jax.nn.dot_product_attention(to_BLHK(q), to_BLHK(k), to_BLHK(v), mask=mask,
                                            implementation=implementation)
    out_BHTK = jnp.swapaxes(out_BTHK, 1, 2).astype(out_dtype)
    if mask is not None:
        any_key_BHT1 = jnp.broadcast_to(jnp.any(mask, axis=-1, keepdims=True),
                                        (batch, heads, q_len, 1))
        out_BHTK = jnp.where(any_key_BHT1, out_BHTK, jnp.zeros((), out_BHTK.dtype))
    return out_BHTK


class MultiHeadAttention(nn.Module):
    """Multi-head attention (§3.2.2), head axes in the weights: ``query``/``key``/``value``
    kernels ``[D, H, K]`` with biases ``[H, K]``, ``out`` kernel ``[H, K, D]`` with bias ``[D]``.
    The reference backend sows ``intermediates/attention_weights [B, H, T, S]``."""

    config: TransformerConfig

    def setup(self):
        c = self.config
        shape_in = (c.d_model, c.num_heads, c.head_dim)
        init = nn.with_logical_partitioning(nn.initializers.xavier_uniform(in_axis=0, out_axis=(1, 2)),
                                            ("embed", "heads", "kv"))
        bias = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("heads", "kv"))
        self.query_kernel = self.param("query_kernel", init, shape_in, c.parameter_dtype)
        self.key_kernel = self.param("key_kernel", init, shape_in, c.parameter_dtype)
        self.value_kernel = self.param("value_kernel", init, shape_in, c.parameter_dtype)
        self.query_bias = self.param("query_bias", bias, shape_in[1:], c.parameter_dtype)
        self.key_bias = self.param("key_bias", bias, shape_in[1:], c.parameter_dtype)
        self.value_bias = self.param("value_bias", bias, shape_in[1:], c.parameter_dtype)
        out_init = nn.with_logical_partitioning(
            nn.initializers.xavier_uniform(in_axis=(0, 1), out_axis=2), ("heads", "kv", "embed"))
        self.out_kernel = self.param("out_kernel", out_init, shape_in[1:] + (c.d_model,),
                                     c.parameter_dtype)
        out_bias = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",))
        self.out_bias = self.param("out_bias", out_bias, (c.d_model,), c.parameter_dtype)

    def _project(self, x_BLD, kernel_DHK, bias_HK):
        dtype = self.config.compute_dtype
        # [B, L, H, K] first: the matmul's natural output, so the kernel is never
        # transposed (XLA would otherwise re-transpose it at every decoding step).
        y_BLHK = weight_einsum("BLD,DHK->BLHK", x_BLD, kernel_DHK, self.config)
        y_BHLK = jnp.swapaxes(y_BLHK + bias_HK.astype(dtype)[None, None, :, :], 1, 2)
        return constrain(y_BHLK, ("batch", "heads", "length", "kv"))

    def project_query(self, x_BTD):
        """Queries ``[B, H, T, K]`` from ``[B, T, D]``."""
        return self._project(x_BTD, self.query_kernel, self.query_bias)

    def project_key_value(self, x_BSD):
        """Keys and values ``[B, H, S, K]`` from ``[B, S, D]`` (cacheable per source)."""
        return (self._project(x_BSD, self.key_kernel, self.key_bias),
                self._project(x_BSD, self.value_kernel, self.value_bias))

    def attend(self, q_BHTK, k_BHSK, v_BHSK, mask, deterministic: bool):
        """Attention of projected heads, then the output projection → ``[B, T, D]``. ``mask``:
        an ``AttentionMask``, a bool array broadcasting to ``[B, H, T, S]`` (cached steps) or ``None``."""
        c = self.config
        dense = mask.dense if isinstance(mask, AttentionMask) else mask
        if c.attention_backend == "reference":
            rng = None
            if not deterministic and c.attention_dropout_rate > 0.0:
                rng = self.make_rng("dropout")
            out_BHTK, weights_BHTS = scaled_dot_product_attention(
                q_BHTK, k_BHSK, v_BHSK, dense, dropout_rate=c.attention_dropout_rate, dropout_rng=rng)
            self.sow("intermediates", "attention_weights", weights_BHTS)
        elif c.attention_backend == "pallas" and isinstance(mask, AttentionMask):
            out_BHTK = splash_dot_product_attention(q_BHTK, k_BHSK, v_BHSK, mask.q_segments,
                                                    mask.kv_segments, causal=mask.causal)
        else:
            # Splash is a prefill/training kernel: the cached decoding step (one query, a
            # plain bool mask) runs "pallas" models on XLA's attention.
            implementation = "xla" if c.attention_backend == "pallas" else c.attention_backend
            out_BHTK = fused_dot_product_attention(q_BHTK, k_BHSK, v_BHSK, dense,
                                                   implementation=implementation)
        out_BTD = weight_einsum("BHTK,HKD->BTD", out_BHTK, self.out_kernel, c)
        out_BTD = out_BTD + self.out_bias.astype(c.compute_dtype)[None, None, :]
        return constrain(out_BTD, ("batch", "length", "embed"))

    def __call__(self, x_BTD, context_BSD, mask, deterministic: bool = True):
        """Queries from ``x_BTD``, keys/values from ``context_BSD`` → ``[B, T, D]``."""
        q = self.project_query(x_BTD)
        k, v = self.project_key_value(context_BSD)
        return self.attend(q, k, v, mask, deterministic)
