"""Loss, learning-rate schedule, optimizer and the pure train/eval steps.

Shapes: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from jaxformer.model import Transformer

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
    """Initialises parameters (float32 unless the config says otherwise) and Adam state."""
    ids = jnp.ones(example_shape, jnp.int32)
    params = jax.jit(model.init)(rng, ids, ids)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    # A Python-int step would be traced as a weak type and recompile on the second step.
    return state.replace(step=jnp.zeros((), jnp.int32))


def _batch_loss(params, batch, rng, *, model: Transformer, smoothing: float, deterministic: bool):
    pad_id = model.config.pad_id
    # Packed batches (jaxformer.data.collate_packed) carry segment ids; bucketed ones do not.
    logits = model.apply({"params": params}, batch["src"], batch["tgt_in"],
                         deterministic=deterministic, rngs={"dropout": rng},
                         src_segments=batch.get("src_segments"), tgt_segments=batch.get("tgt_segments"))
    chex.assert_shape(logits, batch["tgt_out"].shape + (model.config.tgt_vocab_size,))
    weights = (batch["tgt_out"] != pad_id).astype(jnp.float32)
    loss_sum, nll_sum = label_smoothed_cross_entropy(logits, batch["tgt_out"], weights, smoothing)
    correct = jnp.sum((jnp.argmax(logits, -1) == batch["tgt_out"]) * weights)
    tokens = jnp.sum(weights)
    # Mean over real target tokens; sums go out as metrics so averages stay exact.
    return loss_sum / jnp.maximum(tokens, 1.0), {
        "loss_sum": loss_sum, "nll_sum": nll_sum, "correct": correct, "tokens": tokens}


def train_step(state: TrainState, batch: dict[str, jax.Array], rng: chex.PRNGKey, *,
               model: Transformer, smoothing: float) -> tuple[TrainState, Metrics]:
    """One optimizer update; pure. Jit it with the statics bound (see :func:`jit_train_step`).

    Args:
      state: the train state (donated by the jitted wrapper).
      batch: ``src [B,S]``, ``tgt_in [B,T]``, ``tgt_out [B,T]`` int32; packed batches
        also ``src_segments [B,S]`` and ``tgt_segments [B,T]``.
      rng: the run's root dropout key; this step uses ``fold_in(rng, state.step)``.

    Returns:
      ``(new_state, metrics)``, metrics as sums (``loss_sum``, ``nll_sum``,
      ``correct``) with the denominator ``tokens``, plus ``grad_norm`` and ``lr``-free
      ``finite`` (1.0 when loss and gradients are finite).
    """
    dropout_rng = jax.random.fold_in(rng, state.step)
    grad_fn = jax.value_and_grad(
        functools.partial(_batch_loss, model=model, smoothing=smoothing, deterministic=False),
        has_aux=True)
    (_, metrics), grads = grad_fn(state.params, batch, dropout_rng)
    grad_norm = optax.global_norm(grads)
    new_state = state.apply_gradients(grads=grads)
    metrics = dict(metrics, grad_norm=grad_norm, steps=jnp.ones((), jnp.float32))
    return new_state, metrics


def eval_step(params: Any, batch: dict[str, jax.Array], *, model: Transformer,
              smoothing: float) -> Metrics:
    """Loss sums on one batch in eval mode (no dropout)."""
    _, metrics = _batch_loss(params, batch, jax.random.key(0), model=model, smoothing=smoothing,
                             deterministic=True)
    return metrics


def jit_train_step(model: Transformer, smoothing: float):
    """``train_step`` jitted with its statics bound and the state donated."""
    return jax.jit(functools.partial(train_step, model=model, smoothing=smoothing),
                   donate_argnames=("state",))


def jit_eval_step(model: Transformer, smoothing: float):
    return jax.jit(functools.partial(eval_step, model=model, smoothing=smoothing))


def add_metrics(total: Metrics | None, new: Metrics) -> Metrics:
    """Accumulates metric sums on device (no host sync)."""
    return new if total is None else jax.tree_util.tree_map(jnp.add, total, new)
