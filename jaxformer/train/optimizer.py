"""The paper's optimizer: Adam (β1 = 0.9, β2 = 0.98, ε = 1e-9) and the warm-up/inverse-square-root
learning rate of §5.3 (Eq. 3), or a warm-up/stable/decay schedule that ends at zero on the
step budget.
"""

from __future__ import annotations

import math
import warnings

import jax.numpy as jnp
import optax

from jaxformer.run.config import SCHEDULES


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


def wsd_schedule(d_model: int, warmup_steps: int, total_steps: int, decay_fraction: float,
                 scale: float = 1.0) -> optax.Schedule:
    """Warm-up, stable, decay: a linear warm-up to the paper's peak rate, that rate held,
    then a linear decay that reaches zero at ``total_steps``.

    The peak is Eq. 3's value at the end of warm-up, ``scale · d_model^-0.5 · warmup^-0.5``,
    so ``--lr-scale`` means the same under both schedules. The decay takes the last
    ``decay_fraction · total_steps`` updates; the last update (count ``total_steps - 1``)
    gets ``peak / decay_steps``. A fixed budget trained this way ends in a minimum the
    inverse square root never reaches (Hägele et al. 2024, "Scaling Laws and
    Compute-Optimal Training Beyond Fixed Training Durations", §3: linear cool-down over
    the last 20% matches cosine; Hu et al. 2024, MiniCPM, name it WSD).

    Raises:
      ValueError: non-positive steps, or ``decay_fraction`` outside (0, 1].
    """
    if warmup_steps <= 0 or total_steps <= 0:
        raise ValueError(f"warmup_steps and total_steps must be positive, got {warmup_steps} and "
                         f"{total_steps}.")
    if not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction must be in (0, 1], got {decay_fraction}.")
    peak = scale * d_model ** -0.5 * warmup_steps ** -0.5
    decay_steps = max(1, round(decay_fraction * total_steps))

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = jnp.minimum(1.0, (count + 1.0) / warmup_steps)
        cool = jnp.clip((total_steps - count) / decay_steps, 0.0, 1.0)
        return peak * jnp.minimum(warm, cool)

    return schedule


def make_schedule(name: str, *, d_model: int, warmup_steps: int, total_steps: int,
                  decay_fraction: float, scale: float = 1.0) -> optax.Schedule:
    """The schedule named by ``--lr-schedule`` (:data:`SCHEDULES`).

    Raises:
      ValueError: an unknown name, or a ``scale`` whose peak learning rate (at the end of
        warmup) overflows float32: every update would write inf or NaN weights.
    """
    if name == "inverse_sqrt":
        schedule = transformer_schedule(d_model, warmup_steps, scale)
    elif name == "wsd":
        schedule = wsd_schedule(d_model, warmup_steps, total_steps, decay_fraction, scale)
    else:
        raise ValueError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {name!r}.")
    with warnings.catch_warnings():   # numpy's "overflow in cast" of the scale: named below instead
        warnings.simplefilter("ignore", RuntimeWarning)
        peak = float(schedule(warmup_steps))
    if not math.isfinite(peak):
        raise ValueError(f"--lr-scale {scale:g} makes the peak learning rate overflow float32 ({peak}): "
                         f"every update would write inf or NaN weights; the paper's rate is --lr-scale 1.")
    return schedule


def make_optimizer(schedule: optax.Schedule, grad_clip: float | None = None) -> optax.GradientTransformation:
    """Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 (§5.3), optionally after global-norm clipping."""
    adam = optax.adam(schedule, b1=0.9, b2=0.98, eps=1e-9)
    if grad_clip:
        return optax.chain(optax.clip_by_global_norm(grad_clip), adam)
    return adam
