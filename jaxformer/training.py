"""Loss, learning-rate schedule, optimizer and the pure train/eval steps.

Shapes: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from jaxformer.model import Transformer
from jaxformer.sharding import Layout, constrain, tree_shardings, under_mesh

Metrics = dict[str, jax.Array]


def transformer_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
    """The paper's learning rate (§5.3, Eq. 3), with optax's 0-based count.

    lr = scale · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), where
    ``step = count + 1`` so the first update (count 0) gets a non-zero rate.
    """
    if warmup_steps <= 0:
        raise ValueError(f"warmup_steps must be positive, got {warmup_steps}.")

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)

    return schedule


def make_optimizer(schedule: optax.Schedule, grad_clip: float | None = None) -> optax.GradientTransformation:
    """Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 (§5.3), optionally after global-norm clipping."""
    adam = optax.adam(schedule, b1=0.9, b2=0.98, eps=1e-9)
    if grad_clip:
        return optax.chain(optax.clip_by_global_norm(grad_clip), adam)
    return adam


def label_smoothed_cross_entropy(logits_BTV, targets_BT, weights_BT, smoothing: float):
    """Label-smoothed cross entropy (§5.4) from logits, without a one-hot tensor.

    The smoothed target puts ``1 - smoothing`` on the reference token and spreads
    ``smoothing`` evenly over the other V-1 tokens. The entropy of that target is
    subtracted, so a perfect prediction of the smoothed target has loss 0. Positions
    with weight 0 (padding) contribute nothing to the loss or to its smoothing term.

    Args:
      logits_BTV: logits, any float dtype (computed in float32).
      targets_BT: int reference ids.
      weights_BT: float weights (1 real token, 0 pad).
      smoothing: ε_ls in [0, 1).

    Returns:
      ``(loss_sum, nll_sum)`` float32 scalars: weighted sums of the smoothed loss and
      of the plain negative log-likelihood.

    Raises:
      ValueError: ``smoothing`` outside [0, 1).
    """
    chex.assert_rank(logits_BTV, 3)
    chex.assert_shape([targets_BT, weights_BT], logits_BTV.shape[:2])
    confidence, low, normalizer = _smoothing_constants(smoothing, logits_BTV.shape[-1])
    log_probs = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll_BT = -jnp.take_along_axis(log_probs, targets_BT[..., None], axis=-1)[..., 0]
    if smoothing > 0.0:
        sum_others_BT = -jnp.sum(log_probs, axis=-1) - nll_BT
        loss_BT = confidence * nll_BT + low * sum_others_BT - normalizer
    else:
        loss_BT = nll_BT
    return jnp.sum(loss_BT * weights_BT), jnp.sum(nll_BT * weights_BT)


def _smoothing_constants(smoothing: float, vocab: int):
    """(confidence, low, normalizer) of the smoothed target distribution.

    The normalizer is that distribution's entropy, so a perfect prediction has loss 0.
    Raises ValueError for ``smoothing`` outside [0, 1).
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1) (the share of probability spread over "
                         f"the other tokens), got {smoothing}.")
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
    # The softmax part of d(loss)/d(logits) goes through the projection here, while
    # the probabilities are at hand; the backward pass only scales these results and
    # adds the one-hot and uniform parts (XLA may still schedule these dots late).
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
    """:func:`label_smoothed_cross_entropy` of ``decoder_output @ kernel + bias``, fused.

    The same values and gradients as projecting to logits and calling
    :func:`label_smoothed_cross_entropy`, with less memory traffic: a custom VJP
    sends the softmax through the projection's two backward matmuls during the
    forward pass, so the backward pass never re-reads or transposes the ``[B·T, V]``
    logits (the largest tensor of a training step). The one-hot and uniform parts of
    the gradient are a gather, a scatter-add and a row sum. Gradients are exact for
    ``loss_sum`` and ``nll_sum`` (any cotangents) and for ``weights``; ``correct`` is
    flat in the logits.

    Args:
      decoder_output_BTD: ``[B, T, D]``, any float dtype (the matmuls run in it,
        with float32 accumulation).
      kernel_DV: ``[D, V]`` (e.g. :meth:`jaxformer.Transformer.output_projection_weights`).
      bias_V: ``[V]`` or ``None``.
      targets_BT: int reference ids in ``[0, V)``.
      weights_BT: float weights (1 real token, 0 pad).
      smoothing: ε_ls in [0, 1) (§5.4), a Python float.

    Returns:
      ``(loss_sum, nll_sum, correct)`` float32 scalars: weighted sums of the smoothed
      loss, of the plain NLL, and of positions whose reference has the largest logit.

    Raises:
      ValueError: ``smoothing`` outside [0, 1).
    """
    _smoothing_constants(smoothing, kernel_DV.shape[-1])      # validates smoothing
    batch, length, d_model = decoder_output_BTD.shape
    chex.assert_shape(kernel_DV, (d_model, None))
    chex.assert_shape([targets_BT, weights_BT], (batch, length))
    if bias_V is not None:
        chex.assert_shape(bias_V, (kernel_DV.shape[1],))
    rows = batch * length
    return _projected_cross_entropy(decoder_output_BTD.reshape(rows, d_model), kernel_DV.astype(
        decoder_output_BTD.dtype), bias_V, targets_BT.reshape(rows), weights_BT.reshape(rows).astype(
        jnp.float32), float(smoothing))


class TrainState(train_state.TrainState):
    """Step, parameters and optimizer state (flax's ``TrainState``)."""


def create_train_state(model: Transformer, rng: chex.PRNGKey, tx: optax.GradientTransformation,
                       example_shape: tuple[int, int] = (1, 8)) -> TrainState:
    """Initialises parameters (float32 unless the config says otherwise) and Adam state.

    The state holds plain arrays: the logical-axis boxes of ``model.init`` are removed.
    """
    return nn.unbox(jax.jit(functools.partial(_boxed_train_state, model, tx, example_shape))(rng))


def _boxed_train_state(model, tx, example_shape, rng):
    ids = jnp.ones(example_shape, jnp.int32)
    params = model.init(rng, ids, ids)["params"]          # leaves boxed with logical axis names
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)   # Adam moments boxed alike
    # A Python-int step would be traced as a weak type and recompile on the second step.
    return state.replace(step=jnp.zeros((), jnp.int32))


def create_sharded_train_state(model: Transformer, rng: chex.PRNGKey, tx: optax.GradientTransformation,
                               mesh: jax.sharding.Mesh, example_shape: tuple[int, int] = (1, 8)
                               ) -> tuple[TrainState, Layout]:
    """Like :func:`create_train_state`, but each array is created directly in its shard.

    Parameters and Adam moments are sharded by their logical axis names through
    :data:`jaxformer.sharding.LOGICAL_AXIS_RULES`; counters are replicated. The same
    key gives the same values on every mesh.

    Returns:
      ``(state, layout)``: the state of plain arrays, and its :class:`Layout`.

    Raises:
      ValueError: a sharded dimension (heads, d_ff, vocabulary) is not divisible by
        the ``model`` axis.
    """
    init = functools.partial(_boxed_train_state, model, tx, example_shape)
    _, layout = abstract_train_state(model, tx, mesh, example_shape)
    state = jax.jit(lambda r: nn.unbox(init(r)), in_shardings=layout.replicated,
                    out_shardings=layout.state)(rng)
    return state, layout


def abstract_train_state(model: Transformer, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                         example_shape: tuple[int, int] = (1, 8)) -> tuple[Any, Layout]:
    """The train state's shapes, dtypes and shardings on ``mesh``, without computing it.

    Returns:
      ``(abstract_state, layout)``: a tree of ``jax.ShapeDtypeStruct`` with shardings
      (an orbax restore target) and the :class:`Layout`.

    Raises:
      ValueError: as :func:`create_sharded_train_state`.
    """
    boxed = jax.eval_shape(functools.partial(_boxed_train_state, model, tx, example_shape),
                           jax.random.key(0))
    shardings = tree_shardings(boxed, mesh)
    abstract = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      nn.unbox(boxed), shardings)
    return abstract, Layout(mesh=mesh, state=shardings)


def _batch_loss(params, batch, rng, *, model: Transformer, smoothing: float, deterministic: bool):
    pad_id = model.config.pad_id
    # Packed batches (jaxformer.batching.collate_packed) carry segment ids; bucketed ones do not.
    decoder_output, kernel, bias = model.apply(
        {"params": params}, batch["src"], batch["tgt_in"], deterministic=deterministic,
        rngs={"dropout": rng}, src_segments=batch.get("src_segments"),
        tgt_segments=batch.get("tgt_segments"), method=Transformer.features)
    chex.assert_shape(decoder_output, batch["tgt_out"].shape + (model.config.d_model,))
    weights = (batch["tgt_out"] != pad_id).astype(jnp.float32)
    loss_sum, nll_sum, correct = projected_cross_entropy(decoder_output, kernel, bias, batch["tgt_out"],
                                                         weights, smoothing)
    tokens = jnp.sum(weights)
    # Mean over real target tokens; sums go out as metrics so averages stay exact.
    return loss_sum / jnp.maximum(tokens, 1.0), {
        "loss_sum": loss_sum, "nll_sum": nll_sum, "correct": correct, "tokens": tokens}


def _summed_loss(params, batch, rng, *, model: Transformer, smoothing: float):
    loss, metrics = _batch_loss(params, batch, rng, model=model, smoothing=smoothing,
                                deterministic=False)
    return metrics["loss_sum"], metrics


def _accumulated_grads(params, batch, rng, *, model: Transformer, smoothing: float, steps: int):
    """Loss metrics and mean-per-token gradients of ``batch``, ``steps`` micro-batches at a time.

    Micro-batch ``i`` takes rows ``i, i + steps, i + 2·steps, …`` (so every data shard
    contributes to each) and dropout key ``fold_in(rng, i)``. Gradients of the loss
    *sums* are added up and divided by the whole batch's token count: exactly the
    gradient of the full batch, whatever the padding of each micro-batch.
    """
    rows = batch["src"].shape[0]
    if rows % steps:
        raise ValueError(f"A batch of {rows} rows does not split into grad_accum_steps={steps} "
                         f"micro-batches; make the rows a multiple of it.")

    def split(x_BL):   # [B, L] → [steps, B/steps, L]; micro-batch i = rows i::steps
        micro = jnp.swapaxes(x_BL.reshape((rows // steps, steps) + x_BL.shape[1:]), 0, 1)
        return constrain(micro, (None, "batch", "length"))

    micro_batches = jax.tree_util.tree_map(split, batch)
    grad_fn = jax.grad(functools.partial(_summed_loss, model=model, smoothing=smoothing), has_aux=True)

    def body(carry, inputs):
        index, micro_batch = inputs
        grads, metrics = grad_fn(params, micro_batch, jax.random.fold_in(rng, index))
        return jax.tree_util.tree_map(jnp.add, carry, (grads, metrics)), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, (params, jax.eval_shape(
        grad_fn, params, jax.tree_util.tree_map(lambda x: x[0], micro_batches), rng)[1]))
    (grad_sums, metrics), _ = jax.lax.scan(body, zeros, (jnp.arange(steps), micro_batches))
    grads = jax.tree_util.tree_map(lambda g: g / jnp.maximum(metrics["tokens"], 1.0), grad_sums)
    return metrics, grads


def train_step(state: TrainState, batch: dict[str, jax.Array], rng: chex.PRNGKey, *,
               model: Transformer, smoothing: float, grad_accum_steps: int = 1
               ) -> tuple[TrainState, Metrics]:
    """One optimizer update; pure. Jit it with the statics bound (see :func:`jit_train_step`).

    Non-finite guard: when the loss or the gradient norm is NaN/inf (an overflow, a
    bad batch, a diverging run), the update is skipped — parameters and optimizer
    state stay as they were, only ``step`` advances (the batch is consumed) — and the
    step is reported in ``metrics["skipped"]``. Its loss sums are zeroed so the
    running averages stay finite. The choice is a ``lax.cond`` (only the taken branch
    runs; no per-element select) and needs no host sync; the host reads ``skipped``
    with the other metrics every ``log_every`` steps (see :func:`jaxformer.trainer.train`).

    Args:
      state: the train state (donated by the jitted wrapper).
      batch: ``src [B,S]``, ``tgt_in [B,T]``, ``tgt_out [B,T]`` int32; packed batches
        also ``src_segments [B,S]`` and ``tgt_segments [B,T]``.
      rng: the run's root dropout key; this step uses ``fold_in(rng, state.step)``.
      grad_accum_steps: split the batch into this many micro-batches, run them one
        after another (a ``lax.scan``: activations of one micro-batch in memory) and
        apply one update with the whole batch's gradient.

    Returns:
      ``(new_state, metrics)``, metrics as float32 sums (``loss_sum``, ``nll_sum``,
      ``correct``) with the denominator ``tokens``, plus ``grad_norm``, ``steps``
      (1) and ``skipped`` (1 when the update was skipped as non-finite, else 0).
    """
    dropout_rng = jax.random.fold_in(rng, state.step)
    if grad_accum_steps > 1:
        metrics, grads = _accumulated_grads(state.params, batch, dropout_rng, model=model,
                                            smoothing=smoothing, steps=grad_accum_steps)
    else:
        grad_fn = jax.value_and_grad(
            functools.partial(_batch_loss, model=model, smoothing=smoothing, deterministic=False),
            has_aux=True)
        (_, metrics), grads = grad_fn(state.params, batch, dropout_rng)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(metrics["loss_sum"]) & jnp.isfinite(grad_norm)
    # Keep the old parameters and optimizer state when the update is not finite. A
    # cond runs one branch: no per-element select over params and Adam moments, and
    # the update can be written in place into the donated buffers.
    new_state = jax.lax.cond(finite, lambda s: s.apply_gradients(grads=grads),
                             lambda s: s.replace(step=s.step + 1), state)
    metrics = jax.tree_util.tree_map(lambda m: jnp.where(finite, m, jnp.zeros_like(m)),
                                     dict(metrics, grad_norm=grad_norm))
    skipped = 1.0 - finite.astype(jnp.float32)
    return new_state, dict(metrics, steps=jnp.ones((), jnp.float32), skipped=skipped)


def eval_step(params: Any, batch: dict[str, jax.Array], *, model: Transformer,
              smoothing: float) -> Metrics:
    """Loss sums on one batch in eval mode (no dropout)."""
    _, metrics = _batch_loss(params, batch, jax.random.key(0), model=model, smoothing=smoothing,
                             deterministic=True)
    return metrics


def jit_train_step(model: Transformer, smoothing: float, *, layout: Layout | None = None,
                   grad_accum_steps: int = 1):
    """``train_step`` jitted with its statics bound and the state donated.

    With a ``layout`` (from :func:`create_sharded_train_state`) the step has explicit
    in/out shardings: state as laid out, batch rows over ``data``, key and metrics
    replicated; it is traced with the mesh active so activation constraints apply.
    """
    step = functools.partial(train_step, model=model, smoothing=smoothing,
                             grad_accum_steps=grad_accum_steps)
    if layout is None:
        return jax.jit(step, donate_argnames=("state",))
    jitted = jax.jit(step, in_shardings=(layout.state, layout.batch, layout.replicated),
                     out_shardings=(layout.state, layout.replicated), donate_argnames=("state",))
    return under_mesh(jitted, layout.mesh)


def jit_eval_step(model: Transformer, smoothing: float, *, layout: Layout | None = None):
    """``eval_step`` jitted; with a ``layout``, params and batch sharded, metrics replicated."""
    step = functools.partial(eval_step, model=model, smoothing=smoothing)
    if layout is None:
        return jax.jit(step)
    jitted = jax.jit(step, in_shardings=(layout.params, layout.batch), out_shardings=layout.replicated)
    return under_mesh(jitted, layout.mesh)


def add_metrics(total: Metrics | None, new: Metrics) -> Metrics:
    """Accumulates metric sums on device (no host sync)."""
    return new if total is None else jax.tree_util.tree_map(jnp.add, total, new)
