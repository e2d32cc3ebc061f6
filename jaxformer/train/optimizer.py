"""The paper's optimizer: Adam (β1 = 0.9, β2 = 0.98, ε = 1e-9) and the warm-up/inverse-square-root
learning rate of §5.3 (Eq. 3).
"""

from __future__ import annotations

import jax.numpy as jnp
import optax


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

