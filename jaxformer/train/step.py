"""The pure train and eval steps, the train state (parameters and Adam moments), and
their jitted, sharded forms.

Shapes: B batch, L row length. The losses: :mod:`jaxformer.train.losses`.
"""

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


def create_train_state(model: Transformer, rng: chex.PRNGKey, tx: optax.GradientTransformation,
                       example_shape: tuple[int, int] = (1, 8)) -> TrainState:
    """Initialises parameters (float32 unless the config says otherwise) and Adam state, as
    plain arrays (the logical-axis boxes of ``model.init`` removed)."""
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
    """:func:`create_train_state` with each array created directly in its shard: parameters
    and Adam moments by their logical axis names (:data:`jaxformer.model.sharding.LOGICAL_AXIS_RULES`),
    counters replicated. The same key gives the same values on every mesh.

    Returns:
      ``(state, layout)``: the state of plain arrays, and its :class:`Layout`.
    """
    init, layout, _ = jit_sharded_init(model, tx, mesh, example_shape)
    return init(rng), layout


def jit_sharded_init(model: Transformer, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                     example_shape: tuple[int, int] = (1, 8)
                     ) -> tuple[Callable[[chex.PRNGKey], TrainState], Layout, Any]:
    """:func:`create_sharded_train_state` in parts: ``(init, layout, abstract_state)``: the
    jitted ``init(rng)`` and the state's shapes, dtypes and shardings
    (:func:`abstract_train_state`), a resumed run's restore target."""
    boxed_state = functools.partial(_boxed_train_state, model, tx, example_shape)
    abstract, layout = abstract_train_state(model, tx, mesh, example_shape)

    def init_train_state(rng):
        return nn.unbox(boxed_state(rng))

    init = jax.jit(init_train_state, in_shardings=layout.replicated, out_shardings=layout.state)
    return init, layout, abstract


def jit_state_from_params(model: Transformer, tx: optax.GradientTransformation, layout: Layout
                          ) -> Callable[[Any], TrainState]:
    """Jitted ``start(params) -> TrainState``: step 0 and Adam's moments at zero around
    given parameters, which are donated (a fine-tune's start: no initial parameters are
    computed beside the loaded ones), laid out as ``layout``."""
    def start(params):
        state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        return state.replace(step=jnp.zeros((), jnp.int32))   # as _boxed_train_state's

    return jax.jit(start, in_shardings=(layout.params,), out_shardings=layout.state, donate_argnums=0)


def abstract_train_state(model: Transformer, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                         example_shape: tuple[int, int] = (1, 8)) -> tuple[Any, Layout]:
    """The train state's shapes, dtypes and shardings on ``mesh``, without computing it:
    ``(abstract_state, layout)``, a tree of ``jax.ShapeDtypeStruct`` with shardings (an
    orbax restore target) and the :class:`Layout`.

    Raises:
      ValueError: a sharded dimension (heads, d_ff, vocabulary) is not divisible by the
        ``model`` axis (:func:`jaxformer.model.sharding.tree_shardings`).
    """
    boxed = jax.eval_shape(functools.partial(_boxed_train_state, model, tx, example_shape),
                           jax.random.key(0))
    shardings = tree_shardings(boxed, mesh)
    abstract = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      nn.unbox(boxed), shardings)
    return abstract, Layout(mesh=mesh, state=shardings)


def _batch_loss(params, batch, rng, *, model: Transformer, smoothing: float, deterministic: bool):
    pad_id = model.config.pad_id
    # Packed batches (jaxformer.data.batching.collate_packed) carry segment ids; bucketed ones do not.
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
    gradient of the full batch, whatever the padding of each micro-batch. The rows are a
    multiple of ``steps`` (the batcher rounds them so).
    """
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
    """One optimizer update; pure. Jit it with the statics bound (see :func:`jit_train_step`).

    Non-finite guard: when the loss or the gradient norm is NaN/inf (an overflow, a
    bad batch, a diverging run), the update is skipped — parameters and optimizer
    state stay as they were, only ``step`` advances (the batch is consumed) — and the
    step is reported in ``metrics["skipped"]``. Its loss sums are zeroed so the
    running averages stay finite. The choice is a ``lax.cond`` (only the taken branch
    runs; no per-element select) and needs no host sync; the host reads ``skipped``
    with the other metrics every ``log_every`` steps (see :func:`jaxformer.train.trainer.train`).

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
