"""The paper's optimizer (§5.3): Adam and the warm-up/inverse-square-root learning rate (Eq. 3),
or a warm-up/stable/decay schedule that ends at zero on the step budget."""

from __future__ import annotations

import jax.numpy as jnp
import optax


def transformer_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
    """§5.3, Eq. 3: ``scale · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)``, ``step = count + 1``
    (optax counts from 0; the first update gets a non-zero rate)."""

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)

    return schedule


def wsd_schedule(d_model: int, warmup_steps: int, total_steps: int, decay_fraction: float,
                 scale: float = 1.0) -> optax.Schedule:
    """Warm-up, stable, decay (Hägele et al. 2024 §3; MiniCPM's WSD): linear warm-up to Eq. 3's
    peak ``scale · d_model^-0.5 · warmup^-0.5``, held, then linear decay over the last
    ``decay_fraction · total_steps`` updates, the last (count ``total_steps - 1``) getting
    ``peak / decay_steps``."""
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
    """The schedule ``--lr-schedule`` names: ``inverse_sqrt`` or ``wsd``."""
    if name == "wsd":
        return wsd_schedule(d_model, warmup_steps, total_steps, decay_fraction, scale)
    return transformer_schedule(d_model, warmup_steps, scale)


def make_optimizer(schedule: optax.Schedule, grad_clip: float | None = None) -> optax.GradientTransformation:
    """Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9 (§5.3), optionally after global-norm clipping."""
    adam = optax.adam(schedule, b1=0.9, b2=0.98, eps=1e-9)
    if grad_clip:
        return optax.chain(optax.clip_by_global_norm(grad_clip), adam)
    return adam
