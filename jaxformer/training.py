"""Loss, learning-rate schedule, optimizer and the pure train/eval steps.

Shapes: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

import functools
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
    """
    chex.assert_rank(logits_BTV, 3)
    chex.assert_shape([targets_BT, weights_BT], logits_BTV.shape[:2])
    vocab = logits_BTV.shape[-1]
    log_probs = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll_BT = -jnp.take_along_axis(log_probs, targets_BT[..., None], axis=-1)[..., 0]
    if smoothing > 0.0:
        confidence, low = 1.0 - smoothing, smoothing / (vocab - 1)
        sum_others_BT = -jnp.sum(log_probs, axis=-1) - nll_BT
        normalizer = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low))
        loss_BT = confidence * nll_BT + low * sum_others_BT - normalizer
    else:
        loss_BT = nll_BT
    return jnp.sum(loss_BT * weights_BT), jnp.sum(nll_BT * weights_BT)


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
    # Packed batches (jaxformer.data.collate_packed) carry segment ids; bucketed ones do not.
    logits = model.apply({"params": params}, batch["src"], batch["tgt_in"],
                         deterministic=deterministic, rngs={"dropout": rng},
                         src_segments=batch.get("src_segments"), tgt_segments=batch.get("tgt_segments"))
    chex.assert_shape(logits, batch["tgt_out"].shape + (model.config.tgt_vocab_size,))
    weights = (batch["tgt_out"] != pad_id).astype(jnp.float32)
    loss_sum, nll_sum = label_smoothed_cross_entropy(logits, batch["tgt_out"], weights, smoothing)
    # Correct when the reference token has the largest logit (a tie counts as correct):
    # a max, which XLA shares with log_softmax's, instead of a separate argmax pass.
    logits_f32 = logits.astype(jnp.float32)
    reference_logit = jnp.take_along_axis(logits_f32, batch["tgt_out"][..., None], axis=-1)[..., 0]
    correct = jnp.sum((reference_logit >= jnp.max(logits_f32, axis=-1)) * weights)
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
    running averages stay finite. Detection costs one ``jnp.where`` per parameter and
    no host sync; the host reads ``skipped`` with the other metrics every
    ``log_every`` steps (see :func:`jaxformer.trainer.train`).

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
    updated = state.apply_gradients(grads=grads)
    # Keep the old parameters and optimizer state where the update is not finite.
    new_state = updated.replace(
        params=jax.tree_util.tree_map(functools.partial(jnp.where, finite), updated.params, state.params),
        opt_state=jax.tree_util.tree_map(functools.partial(jnp.where, finite), updated.opt_state,
                                         state.opt_state))
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
