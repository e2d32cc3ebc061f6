"""Scaled dot-product attention (a pure function) and the per-head projections.

Sizes are distinct so a swapped axis fails: B=2, H=3, T=5, S=7, K=11 (D=33).
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
from absl.testing import parameterized

from jaxformer import MultiHeadAttention, TransformerConfig, scaled_dot_product_attention

B, H, T, S, K = 2, 3, 5, 7, 11
D = H * K
DTYPES = (("float32", jnp.float32), ("bfloat16", jnp.bfloat16), ("float16", jnp.float16))
# Comparison tolerances against the float64 reference, per compute dtype.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 5e-2, jnp.float16: 5e-3}


def _qkv(dtype=jnp.float32, t=T, s=S, seed=0):
    # NumPy data: eager jax.random calls compile one program per shape (slow on CPU).
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, t, K), np.float32)
    k = rng.standard_normal((B, H, s, K), np.float32)
    v = rng.standard_normal((B, H, s, K), np.float32)
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def _masks():
    padding = np.ones((B, 1, 1, S), bool)
    padding[0, ..., 4:] = False                      # example 0: 4 real keys
    general = np.random.default_rng(7).random((B, 1, T, S)) < 0.6
    general[..., 0] = True                           # every query keeps >= 1 key
    return {"none": None, "padding": jnp.asarray(padding), "general": jnp.asarray(general)}


def _numpy_sdpa(q, k, v, mask):
    """softmax(Q Kᵀ / √K) V written out with NumPy (float64)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("bhtk,bhsk->bhts", q, k) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = np.where(np.asarray(mask), scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    weights = np.exp(scores)
    weights = weights / weights.sum(-1, keepdims=True)
    return weights @ v, weights


class ScaledDotProductAttentionTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("no_mask", "none"), ("padding_mask", "padding"),
                                    ("general_mask", "general"))
    def test_matches_numpy_softmax(self, mask_name):
        q, k, v = _qkv()
        mask = _masks()[mask_name]
        out, weights = self.variant(scaled_dot_product_attention)(q, k, v, mask)
        chex.assert_shape(out, (B, H, T, K))
        chex.assert_shape(weights, (B, H, T, S))
        assert weights.dtype == jnp.float32
        expected_out, expected_w = _numpy_sdpa(q, k, v, mask)
        np.testing.assert_allclose(weights, expected_w, atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(out, expected_out, atol=1e-5, rtol=1e-5)
        # The loop-based reference of numpy_reference agrees as well.
        ref_out, ref_w = ref.attention(q, k, v, mask)
        np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(weights, ref_w, atol=1e-6)
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*DTYPES)
    def test_fully_masked_rows_are_zero_and_differentiable(self, dtype):
        q, k, v = _qkv(dtype)
        # Example 1 has no key at all (an all-padding source); in example 0 the
        # queries 1 and 3 have no key either.
        mask = np.ones((B, 1, T, S), bool)
        mask[0, 0, :, 5:] = False
        mask[0, 0, 1] = False
        mask[0, 0, 3] = False
        mask[1] = False
        mask = jnp.asarray(mask)
        out, weights = self.variant(scaled_dot_product_attention)(q, k, v, mask)
        assert out.dtype == dtype
        chex.assert_tree_all_finite((out, weights))
        np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)
        np.testing.assert_array_equal(weights[1], 0.0)
        for row in (1, 3):
            np.testing.assert_array_equal(np.asarray(out[0, :, row], np.float32), 0.0)
            np.testing.assert_array_equal(weights[0, :, row], 0.0)
        np.testing.assert_array_equal(weights[0, :, :, 5:], 0.0)
        # The rows with keys still match the reference.
        ref_out, ref_w = ref.attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                       v.astype(jnp.float32), mask)
        np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=TOL[dtype] * 4,
                                   rtol=TOL[dtype])
        np.testing.assert_allclose(weights, ref_w, atol=TOL[dtype])

        def loss(q, k, v):
            o, w = scaled_dot_product_attention(q, k, v, mask)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(w * w)

        grads = self.variant(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        chex.assert_tree_all_finite(grads)
        for g, x in zip(grads, (q, k, v), strict=True):
            assert g.dtype == x.dtype
        dq, dk, dv = (np.asarray(g, np.float32) for g in grads)
        # Nothing flows into or out of the fully masked parts.
        np.testing.assert_array_equal(dq[1], 0.0)
        np.testing.assert_array_equal(dk[1], 0.0)
        np.testing.assert_array_equal(dv[1], 0.0)
        np.testing.assert_array_equal(dq[0, :, 1], 0.0)
        np.testing.assert_array_equal(dk[0, :, 5:], 0.0)
        np.testing.assert_array_equal(dv[0, :, 5:], 0.0)
        assert np.abs(dq[0]).sum() > 0 and np.abs(dv[0]).sum() > 0

    @chex.variants(with_jit=True, without_jit=True)
    def test_attention_dropout(self):
        q, k, v = _qkv()
        fn = self.variant(lambda q, k, v, rng: scaled_dot_product_attention(
            q, k, v, None, dropout_rate=0.5, dropout_rng=rng))
        # "rbg" keys: the threefry bit generator takes seconds to compile on CPU.
        key1, key2 = jax.random.key(1, impl="rbg"), jax.random.key(2, impl="rbg")
        out1, w1 = fn(q, k, v, key1)
        out1b, _ = fn(q, k, v, key1)
        out2, w2 = fn(q, k, v, key2)
        plain, w0 = _numpy_sdpa(q, k, v, None)
        np.testing.assert_array_equal(out1, out1b)          # reproducible
        assert not np.allclose(out1, out2)                  # key-dependent
        assert not np.allclose(out1, plain)
        np.testing.assert_allclose(w1, w0, atol=1e-6)       # weights are pre-dropout
        np.testing.assert_allclose(w2, w0, atol=1e-6)


# ------------------------------------------------------------- per-head projections

def _mha_config():
    return TransformerConfig(src_vocab_size=31, tgt_vocab_size=29, d_model=D, num_heads=H, d_ff=23,
                             num_encoder_layers=1, num_decoder_layers=1, max_len=16)


def test_project_query_key_value_shapes_and_values():
    mha = MultiHeadAttention(_mha_config())
    rng = np.random.default_rng(1)
    x_BTD = rng.standard_normal((B, T, D), np.float32)
    ctx_BSD = rng.standard_normal((B, S, D), np.float32)
    # eval_shape: a compiled init (random initialisers) costs seconds on CPU.
    shapes = jax.eval_shape(lambda x: mha.init(jax.random.key(0), x,
                                               method=MultiHeadAttention.project_key_value), ctx_BSD)
    p = nn.unbox(shapes["params"])   # plain shapes, without the logical-axis boxes
    chex.assert_shape([p["query_kernel"], p["key_kernel"], p["value_kernel"]], (D, H, K))
    chex.assert_shape([p["query_bias"], p["key_bias"], p["value_bias"]], (H, K))
    chex.assert_shape(p["out_kernel"], (H, K, D))
    chex.assert_shape(p["out_bias"], (D,))
    # Random values, biases included, so a dropped bias fails.
    p = jax.tree.map(lambda a: rng.standard_normal(a.shape, np.float32) / np.sqrt(a.shape[0]), p)
    variables = {"params": p}

    q, (k, v), q_ctx = jax.jit(lambda variables, x, ctx: (
        mha.apply(variables, x, method=MultiHeadAttention.project_query),
        mha.apply(variables, ctx, method=MultiHeadAttention.project_key_value),
        mha.bind(variables).project_query(ctx)))(variables, x_BTD, ctx_BSD)   # bound module too
    chex.assert_shape(q, (B, H, T, K))
    chex.assert_shape([k, v], (B, H, S, K))
    chex.assert_shape(q_ctx, (B, H, S, K))
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    for h in range(H):          # NumPy per head: x W_h + b_h
        np.testing.assert_allclose(q[:, h], x_BTD @ p["query_kernel"][:, h] + p["query_bias"][h], atol=1e-5)
        np.testing.assert_allclose(k[:, h], ctx_BSD @ p["key_kernel"][:, h] + p["key_bias"][h], atol=1e-5)
        np.testing.assert_allclose(v[:, h], ctx_BSD @ p["value_kernel"][:, h] + p["value_bias"][h], atol=1e-5)
