"""The pure train and eval steps, the train state (parameters and Adam moments), and their
jitted, sharded forms. Shapes: B batch, L row length."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from jaxformer.model.sharding import Layout, constrain, tree_shardings, under_mesh
from jaxformer.model.transformer import Transformer
from jaxformer.train.losses import projected_cross_entropy

Metrics = dict[str, jax.Array]


class TrainState(train_state.TrainState):
    """Step, parameters and optimizer state (flax's ``TrainState``)."""


def _boxed_train_state(model, tx, example_shape, rng):
    """The initial state, leaves boxed with their logical axis names; ``step`` an int32 array
    (a Python int would be traced as a weak type and recompile on the second step)."""
    ids = jnp.ones(example_shape, jnp.int32)
    state = TrainState.create(apply_fn=model.apply, params=model.init(rng, ids, ids)["params"], tx=tx)
    return state.replace(step=jnp.zeros((), jnp.int32))


def create_train_state(model: Transformer, rng: chex.PRNGKey, tx: optax.GradientTransformation,
                       example_shape: tuple[int, int] = (1, 8)) -> TrainState:
    """Initial parameters and Adam state as plain arrays (the logical-axis boxes removed)."""
    return nn.unbox(jax.jit(functools.partial(_boxed_train_state, model, tx, example_shape))(rng))


def abstract_train_state(model: Transformer, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                         example_shape: tuple[int, int] = (1, 8)) -> tuple[Any, Layout]:
    """``(abstract_state, layout)``: the state's ``jax.ShapeDtypeStruct`` tree with its shardings
    on ``mesh`` (an orbax restore target), computing nothing. Raises ``ValueError`` when a
    sharded width does not divide by the ``model`` axis."""
    boxed = jax.eval_shape(functools.partial(_boxed_train_state, model, tx, example_shape),
                           jax.random.key(0))
    shardings = tree_shardings(boxed, mesh)
    abstract = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      nn.unbox(boxed), shardings)
    return abstract, Layout(mesh=mesh, state=shardings)


def jit_sharded_init(model: Transformer, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                     example_shape: tuple[int, int] = (1, 8)
                     ) -> tuple[Callable[[chex.PRNGKey], TrainState], Layout, Any]:
    """``(init, layout, abstract_state)``: the jitted ``init(rng)`` creating each array in its
    shard (parameters and moments by logical axis names, counters replicated; the same key
    gives the same values on every mesh) and :func:`abstract_train_state`'s two."""
    abstract, layout = abstract_train_state(model, tx, mesh, example_shape)
    boxed_state = functools.partial(_boxed_train_state, model, tx, example_shape)
    init = jax.jit(lambda rng: nn.unbox(boxed_state(rng)), in_shardings=layout.replicated,
                   out_shardings=layout.state)
    return init, layout, abstract


def create_sharded_train_state(model: Transformer, rng: chex.PRNGKey, tx: optax.GradientTransformation,
                               mesh: jax.sharding.Mesh, example_shape: tuple[int, int] = (1, 8)
                               ) -> tuple[TrainState, Layout]:
    """``(state, layout)``: :func:`create_train_state` with each array created in its shard."""
    init, layout, _ = jit_sharded_init(model, tx, mesh, example_shape)
    return init(rng), layout


def jit_state_from_params(model: Transformer, tx: optax.GradientTransformation, layout: Layout
                          ) -> Callable[[Any], TrainState]:
    """Jitted ``start(params)``: step 0 and zero Adam moments around the given (donated)
    parameters, laid out as ``layout`` (a fine-tune's start)."""
    def start(params):
        state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        return state.replace(step=jnp.zeros((), jnp.int32))

    return jax.jit(start, in_shardings=(layout.params,), out_shardings=layout.state, donate_argnums=0)


def _batch_loss(params, batch, rng, *, model: Transformer, smoothing: float, deterministic: bool):
    """``(mean loss per real target token, metric sums)``; packed batches carry segment ids."""
    decoder_output, kernel, bias = model.apply(
        {"params": params}, batch["src"], batch["tgt_in"], deterministic=deterministic,
        rngs={"dropout": rng}, src_segments=batch.get("src_segments"),
        tgt_segments=batch.get("tgt_segments"), method=Transformer.features)
    chex.assert_shape(decoder_output, batch["tgt_out"].shape + (model.config.d_model,))
    weights = (batch["tgt_out"] != model.config.pad_id).astype(jnp.float32)
    loss_sum, nll_sum, correct = projected_cross_entropy(decoder_output, kernel, bias, batch["tgt_out"],
                                                         weights, smoothing)
    tokens = jnp.sum(weights)
    return loss_sum / jnp.maximum(tokens, 1.0), {
        "loss_sum": loss_sum, "nll_sum": nll_sum, "correct": correct, "tokens": tokens}


def _summed_loss(params, batch, rng, *, model: Transformer, smoothing: float):
    """``(loss sum, metric sums)``: what micro-batches add up."""
    _, metrics = _batch_loss(params, batch, rng, model=model, smoothing=smoothing, deterministic=False)
    return metrics["loss_sum"], metrics


def _accumulated_grads(params, batch, rng, *, model: Transformer, smoothing: float, steps: int):
    """Metric sums and mean-per-token gradients of ``batch`` (rows a multiple of ``steps``), in
    ``steps`` micro-batches: rows ``i::steps`` (every data shard in each), dropout key
    ``fold_in(rng, i)``. Loss-sum gradients are added and divided by the batch's tokens:
    exactly the full batch's gradient."""
    rows = batch["src"].shape[0]
    chex.assert_equal(rows % steps, 0)

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
    """One optimizer update; pure (:func:`jit_train_step` jits it). A non-finite loss or gradient
    norm skips the update (``lax.cond``, no host sync): only ``step`` advances, the metrics
    are zeroed and ``skipped`` is 1.

    Args:
      batch: ``src [B,S]``, ``tgt_in [B,T]``, ``tgt_out [B,T]`` int32; packed batches also
        ``src_segments [B,S]``, ``tgt_segments [B,T]``.
      rng: the run's root dropout key; the step uses ``fold_in(rng, state.step)``.
      grad_accum_steps: micro-batches run in a ``lax.scan``, one update for the whole batch.

    Returns:
      ``(new_state, metrics)``: float32 sums ``loss_sum``, ``nll_sum``, ``correct``, ``tokens``,
      ``grad_norm``, ``steps`` (1), ``skipped`` (0 or 1).
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
    # A cond, not a select: one branch runs, the update is written in place into the donated buffers.
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
    """``train_step`` jitted, the state donated; with a ``layout``, state as laid out, batch rows
    over ``data``, key and metrics replicated, traced under the mesh."""
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
