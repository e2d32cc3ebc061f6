"""``attention_backend="pallas"``: Pallas's TPU splash attention (:mod:`jaxformer.model.splash`).

On this CPU the kernel runs in Pallas's interpret mode, checked against the reference
core with the equivalent dense mask: both dtypes, padding, causal, packed segments,
rows with no key, forward and backward; then the whole model against the reference
backend, and the real train step compiled for a TPU v5e slice with the native kernel.
Shapes stay small (B=2, H=2, K=8, lengths 100–300): interpret mode is slow.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.model import sharding, splash
from jaxformer.model.masks import (
    PADDING_SEGMENT,
    create_segment_mask,
    decoder_masks,
    dense_from_segments,
    encoder_mask,
)

PAD = 0


def _packed_ids(rng, rows: int, length: int, vocab: int, *, segments: int = 2):
    """Ids ``[rows, length]`` and segment ids: ``segments`` pairs of random lengths, then
    padding (segment 0); the last row is all padding (ids pad, segments 0)."""
    ids = np.full((rows, length), PAD, np.int32)
    seg = np.zeros((rows, length), np.int32)
    for r in range(rows - 1):
        at = 0
        for s in range(1, segments + 1):
            n = int(rng.integers(1, length // segments))
            ids[r, at:at + n] = rng.integers(4, vocab, n)
            seg[r, at:at + n] = s
            at += n
    return jnp.asarray(ids), jnp.asarray(seg)


def _broadcast(mask, q_len, kv_len):
    return np.broadcast_to(np.asarray(mask), (mask.shape[0], 1, q_len, kv_len))


def test_segment_ids_reproduce_every_mask_the_model_builds():
    """segments → dense equals the model's dense mask: padding, packed rows, causal, the
    all-padding row, and the Marian start token (position 0 holds the pad id)."""
    for seed, packed in ((0, False), (1, False), (0, True), (1, True), (2, True)):
        rng = np.random.default_rng(seed)
        src, src_seg = _packed_ids(rng, 4, 11, 20, segments=seed + 1)
        tgt, tgt_seg = _packed_ids(rng, 4, 7, 20, segments=seed + 1)
        tgt = tgt.at[:, 0].set(PAD)                    # Marian: decoding starts with the pad id
        ss, ts = (src_seg, tgt_seg) if packed else (None, None)
        enc = encoder_mask(src, PAD, ss)
        self_mask, cross = decoder_masks(src, tgt, PAD, ss, ts)
        assert (enc.causal, self_mask.causal, cross.causal) == (False, True, False)
        for mask, (q_len, kv_len) in ((enc, (11, 11)), (self_mask, (7, 7)), (cross, (7, 11))):
            from_segments = dense_from_segments(mask.q_segments, mask.kv_segments, mask.causal)
            np.testing.assert_array_equal(from_segments, _broadcast(mask.dense, q_len, kv_len))
        # padding keys carry the id no query has; the dense masks are the model's own
        assert np.all(np.asarray(enc.kv_segments)[np.asarray(src) == PAD] == PADDING_SEGMENT)
        assert np.all(np.asarray(self_mask.kv_segments)[:, 0] != PADDING_SEGMENT)   # the start token
    np.testing.assert_array_equal(enc.dense, jf.create_padding_mask(src, PAD)
                                  & create_segment_mask(src_seg, src_seg))
    # a pytree with the causal flag static, as the layers (and nn.scan) pass it on
    leaves, treedef = jax.tree_util.tree_flatten(self_mask)
    assert len(leaves) == 3 and jax.tree_util.tree_unflatten(treedef, leaves).causal


def _attention_inputs(dtype, q_len, kv_len, causal, batch=2, heads=2, head_dim=8):
    """q/k/v and packed, padded segment ids, with rows that have no key at all."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, heads, n, head_dim)), dtype)
               for n in (q_len, kv_len, kv_len))
    q_seg = np.zeros((batch, q_len), np.int32)
    q_seg[:, : q_len // 3], q_seg[:, q_len // 3: q_len - 9] = 1, 2        # last 9: pad queries (0)
    if causal:   # self-attention: the keys are the queries, padding marked
        kv_seg = np.where(q_seg > 0, q_seg, PADDING_SEGMENT)
        kv_seg[1, :] = PADDING_SEGMENT                                     # row 1: no key at all
    else:        # cross-attention: source segments 1 and 2, then padding
        kv_seg = np.full((batch, kv_len), PADDING_SEGMENT, np.int32)
        kv_seg[0, : kv_len // 2], kv_seg[0, kv_len // 2: kv_len - 20] = 1, 2
        kv_seg[0, 5:15] = PADDING_SEGMENT                                  # padding inside a segment
        # row 1 stays all padding: an all-padding source
    return q, k, v, jnp.asarray(q_seg), jnp.asarray(kv_seg, jnp.int32)


# float32: the kernel's online softmax (float32 throughout) differs from the reference
# only in rounding order: measured ≤ 4e-7 (outputs) and ≤ 2e-6 (gradients, |g| ≤ 5).
# bfloat16: both cast the probabilities to bfloat16 before the value matmul, but the
# kernel casts them unnormalised, block by block (flash attention), and both round the
# output to bfloat16 (8 bits: one ulp is 2^-7 ≈ 0.008 at 1): measured ≤ 0.016 (outputs,
# one or two ulps; the bfloat16 reference itself is 0.008 off float32) and ≤ 0.008
# (gradients).
TOLERANCES = {jnp.float32: dict(out=1e-5, grad=1e-5), jnp.bfloat16: dict(out=2e-2, grad=2e-2)}


@pytest.mark.parametrize("dtype,causal,q_len,kv_len", [
    (jnp.float32, False, 130, 300),     # cross-attention: S over three kv blocks of 128
    (jnp.bfloat16, True, 300, 300),     # decoder self-attention: 3 × 3 blocks, causal ones skipped
])
def test_splash_matches_the_reference_core_forward_and_backward(dtype, causal, q_len, kv_len):
    q, k, v, q_seg, kv_seg = _attention_inputs(dtype, q_len, kv_len, causal)
    dense = dense_from_segments(q_seg, kv_seg, causal)
    cotangent = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)

    def splash_loss(q, k, v):
        out = splash.splash_dot_product_attention(q, k, v, q_seg, kv_seg, causal=causal, interpret=True)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    def reference_loss(q, k, v):
        out, _ = jf.scaled_dot_product_attention(q, k, v, dense)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))  # noqa: E731
    (got_grads, got), (want_grads, want) = grad(splash_loss)(q, k, v), grad(reference_loss)(q, k, v)
    tol = TOLERANCES[dtype]
    assert got.dtype == dtype and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol["out"],
                               rtol=tol["out"])
    # rows with no key: zeros, not the mean of v; and no NaN anywhere, backward included
    no_key = ~np.asarray(dense).any(-1)[:, 0]                              # [B, T]
    assert no_key[1].all() and no_key[0].sum() == 9
    np.testing.assert_array_equal(np.asarray(got, np.float32).transpose(0, 2, 1, 3)[no_key], 0.0)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=tol["grad"],
                                   rtol=tol["grad"], err_msg=name)


def test_under_a_mesh_the_kernel_runs_per_shard_and_gives_the_same_output():
    """On a (data=4, model=2) mesh the kernel runs in shard_map over batch and heads."""
    q, k, v, q_seg, kv_seg = _attention_inputs(jnp.float32, 100, 100, True, batch=4)
    attend = jax.jit(lambda *a: splash.splash_dot_product_attention(*a, causal=True, interpret=True))
    alone = attend(q, k, v, q_seg, kv_seg)
    with jax.set_mesh(sharding.make_mesh("data=4,model=2")):
        text = attend.lower(q, k, v, q_seg, kv_seg).as_text()
        split = attend(q, k, v, q_seg, kv_seg)
    # one example and one head per device (length padded to 128)
    assert "sdy.manual_computation" in text and "tensor<1x1x128x8xf32>" in text
    np.testing.assert_allclose(split, alone, atol=1e-6)


def test_interpret_mode_is_the_default_on_cpu_and_gpus_are_refused(monkeypatch):
    assert splash._interpret_mode(None) is True and splash._interpret_mode(False) is False
    assert splash.padded_length(130) == (256, 256) and splash.padded_length(300) == (384, 128)
    assert splash.padded_length(1024) == (1024, 512)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="'cudnn'.*'xla'"):
        splash._interpret_mode(None)


def test_pallas_model_matches_the_reference_backend_logits_and_gradients():
    """The tiny model on a padded, packed batch: the same logits and parameter gradients;
    the cached decoding step (plain masks) runs XLA's attention and agrees too."""
    config = jf.preset("tiny", src_vocab_size=40, num_encoder_layers=1, num_decoder_layers=1)
    rng = np.random.default_rng(3)
    src, src_seg = _packed_ids(rng, 2, 37, 40)
    tgt, tgt_seg = _packed_ids(rng, 2, 29, 40)
    params = nn.unbox(jax.jit(jf.Transformer(config).init)(jax.random.key(0), src, tgt))["params"]
    weights = jnp.asarray(rng.standard_normal((2, 29, 40)), jnp.float32)

    def run(backend):
        model = jf.Transformer(config.replace(attention_backend=backend))

        def loss(p):
            logits = model.apply({"params": p}, src, tgt, src_segments=src_seg, tgt_segments=tgt_seg)
            return jnp.sum(logits * weights), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        memory = model.apply({"params": params}, src[:1], method=jf.Transformer.encode)
        cache = model.apply({"params": params}, memory, src[:1], 4, method=jf.Transformer.init_cache)
        step = jax.jit(lambda c: model.apply({"params": params}, tgt[:1, :1], c,
                                             method=jf.Transformer.decode_step)[0])(cache)
        return logits, grads, step

    logits, grads, step = run("pallas")
    want_logits, want_grads, want_step = run("reference")
    np.testing.assert_allclose(logits, want_logits, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(step, want_step, atol=2e-5, rtol=1e-5)
    jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4),
                           grads, want_grads)
