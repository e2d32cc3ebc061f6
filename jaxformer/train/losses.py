"""Label-smoothed cross entropy (§5.4): from logits, and fused with the output projection so
the ``[B, T, V]`` logits are never stored for the backward pass. N = B·T rows."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp

from jaxformer.model.sharding import constrain


def label_smoothed_cross_entropy(logits_BTV, targets_BT, weights_BT, smoothing: float):
    """``(loss_sum, nll_sum)`` float32: weighted sums of the smoothed loss (§5.4: ``1 - smoothing``
    on the reference, ``smoothing`` spread over the other V-1 tokens, its entropy subtracted so
    a perfect prediction has loss 0) and of the plain NLL; no one-hot tensor.

    Args:
      logits_BTV: any float dtype (computed in float32).
      targets_BT: int reference ids; weights_BT: float, 1 real token, 0 pad.
      smoothing: ε_ls in [0, 1).
    """
    chex.assert_rank(logits_BTV, 3)
    chex.assert_shape([targets_BT, weights_BT], logits_BTV.shape[:2])
    confidence, low, normalizer = _smoothing_constants(smoothing, logits_BTV.shape[-1])
    log_probs = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll_BT = -jnp.take_along_axis(log_probs, targets_BT[..., None], axis=-1)[..., 0]
    sum_others_BT = -jnp.sum(log_probs, axis=-1) - nll_BT   # low = normalizer = 0 without smoothing
    loss_BT = confidence * nll_BT + low * sum_others_BT - normalizer
    return jnp.sum(loss_BT * weights_BT), jnp.sum(nll_BT * weights_BT)


def _smoothing_constants(smoothing: float, vocab: int):
    """``(confidence, low, normalizer)`` of the smoothed target; the normalizer is its entropy."""
    confidence, low = 1.0 - smoothing, smoothing / (vocab - 1)
    if not smoothing:
        return confidence, low, 0.0
    normalizer = -(confidence * math.log(confidence) + (vocab - 1) * low * math.log(low))
    return confidence, low, normalizer


def _projected_loss_parts(x_ND, kernel_DV, bias_V, targets_N, weights_N, smoothing):
    """Logits in float32, per-row loss and NLL, softmax, and the number correct."""
    logits_NV = jnp.dot(x_ND, kernel_DV, preferred_element_type=jnp.float32)
    if bias_V is not None:
        logits_NV = logits_NV + bias_V.astype(jnp.float32)[None, :]
    logits_NV = constrain(logits_NV, ("batch", "vocab"))
    vocab = logits_NV.shape[-1]
    max_N = jnp.max(logits_NV, axis=-1)
    exp_NV = jnp.exp(logits_NV - max_N[:, None])
    sum_exp_N = jnp.sum(exp_NV, axis=-1)
    lse_N = max_N + jnp.log(sum_exp_N)
    reference_N = jnp.take_along_axis(logits_NV, targets_N[:, None], axis=-1)[:, 0]
    nll_N = lse_N - reference_N
    if smoothing > 0.0:
        confidence, low, normalizer = _smoothing_constants(smoothing, vocab)
        sum_others_N = vocab * lse_N - jnp.sum(logits_NV, axis=-1) - nll_N   # -Σ_{v≠y} log p_v
        loss_N = confidence * nll_N + low * sum_others_N - normalizer
    else:
        loss_N = nll_N
    # Correct when the reference has the largest logit (a tie counts): shares the max.
    correct_N = (reference_N >= max_N).astype(jnp.float32)
    return loss_N, nll_N, correct_N, exp_NV / sum_exp_N[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _projected_cross_entropy(x_ND, kernel_DV, bias_V, targets_N, weights_N, smoothing):
    loss_N, nll_N, correct_N, _ = _projected_loss_parts(x_ND, kernel_DV, bias_V, targets_N, weights_N,
                                                        smoothing)
    return jnp.sum(loss_N * weights_N), jnp.sum(nll_N * weights_N), jnp.sum(correct_N * weights_N)


def _projected_cross_entropy_fwd(x_ND, kernel_DV, bias_V, targets_N, weights_N, smoothing):
    loss_N, nll_N, correct_N, probs_NV = _projected_loss_parts(x_ND, kernel_DV, bias_V, targets_N,
                                                             weights_N, smoothing)
    # The softmax part of d(loss)/d(logits) through the projection, while the probabilities
    # are at hand; the backward pass scales it and adds the one-hot and uniform parts.
    weighted_f32_NV = probs_NV * weights_N[:, None]
    weighted_NV = weighted_f32_NV.astype(x_ND.dtype)
    dx_ND = jnp.dot(weighted_NV, kernel_DV.T, preferred_element_type=jnp.float32)
    dkernel_DV = jnp.dot(x_ND.T, weighted_NV, preferred_element_type=jnp.float32)
    dbias_V = None if bias_V is None else jnp.sum(weighted_f32_NV, axis=0)
    outputs = (jnp.sum(loss_N * weights_N), jnp.sum(nll_N * weights_N), jnp.sum(correct_N * weights_N))
    residuals = (x_ND, kernel_DV, bias_V, targets_N, weights_N, (loss_N, nll_N, correct_N), dx_ND,
                 dkernel_DV, dbias_V)
    return outputs, residuals


def _projected_cross_entropy_bwd(smoothing, residuals, cotangents):
    x_ND, kernel_DV, bias_V, targets_N, weights_N, per_row, dx_ND, dkernel_DV, dbias_V = residuals
    g_loss, g_nll, g_correct = cotangents    # `correct` is flat in the logits, linear in the weights
    vocab = kernel_DV.shape[-1]
    confidence, low, _ = _smoothing_constants(smoothing, vocab)
    # d(loss_n)/d(logits_n) = p_n - (confidence - low)·onehot(y_n) - low,
    # d(nll_n)/d(logits_n)  = p_n - onehot(y_n).
    g_probs = g_loss + g_nll
    g_onehot_N = (g_loss * (confidence - low) + g_nll) * weights_N          # per row
    g_uniform_N = g_loss * low * weights_N
    kernel_f32 = kernel_DV.astype(jnp.float32)
    dx = (g_probs * dx_ND - g_onehot_N[:, None] * jnp.take(kernel_f32, targets_N, axis=1).T
          - g_uniform_N[:, None] * jnp.sum(kernel_f32, axis=1)[None, :])
    x_f32 = x_ND.astype(jnp.float32)
    onehot_part_VD = jnp.zeros((vocab, x_ND.shape[1]), jnp.float32).at[targets_N].add(
        g_onehot_N[:, None] * x_f32)
    dkernel = (g_probs * dkernel_DV - onehot_part_VD.T
               - jnp.sum(g_uniform_N[:, None] * x_f32, axis=0)[:, None])
    dbias = None
    if bias_V is not None:
        onehot_part_V = jnp.zeros((vocab,), jnp.float32).at[targets_N].add(g_onehot_N)
        dbias = (g_probs * dbias_V - onehot_part_V - jnp.sum(g_uniform_N)).astype(bias_V.dtype)
    loss_N, nll_N, correct_N = per_row
    dweights = g_loss * loss_N + g_nll * nll_N + g_correct * correct_N
    return (dx.astype(x_ND.dtype), dkernel.astype(kernel_DV.dtype), dbias, None,
            dweights.astype(weights_N.dtype))


_projected_cross_entropy.defvjp(_projected_cross_entropy_fwd, _projected_cross_entropy_bwd)


def projected_cross_entropy(decoder_output_BTD, kernel_DV, bias_V, targets_BT, weights_BT,
                            smoothing: float):
    """:func:`label_smoothed_cross_entropy` of ``decoder_output @ kernel + bias``, fused: a custom
    VJP sends the softmax through the projection's backward matmuls in the forward pass, so
    the ``[N, V]`` logits are never re-read; the one-hot and uniform parts are a gather, a
    scatter-add and a row sum.

    Args:
      decoder_output_BTD: any float dtype (the matmuls run in it, float32 accumulation).
      kernel_DV, bias_V: the output projection (``bias_V`` may be ``None``).
      targets_BT: int ids in ``[0, V)``; weights_BT: float, 1 real token, 0 pad.
      smoothing: ε_ls in [0, 1), a Python float.

    Returns:
      ``(loss_sum, nll_sum, correct)`` float32: weighted sums of the smoothed loss, the NLL and
      the positions whose reference has the largest logit.
    """
    batch, length, d_model = decoder_output_BTD.shape
    chex.assert_shape(kernel_DV, (d_model, None))
    chex.assert_shape([targets_BT, weights_BT], (batch, length))
    if bias_V is not None:
        chex.assert_shape(bias_V, (kernel_DV.shape[1],))
    rows = batch * length
    return _projected_cross_entropy(decoder_output_BTD.reshape(rows, d_model), kernel_DV.astype(
        decoder_output_BTD.dtype), bias_V, targets_BT.reshape(rows), weights_BT.reshape(rows).astype(
        jnp.float32), float(smoothing))

