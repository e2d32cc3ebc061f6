"""Dropout (§5.4, "Residual Dropout") with half ``jax.random.bernoulli``'s random-number
work: each 32-bit word gives two 16-bit uniforms. The keep probability is rounded to a
multiple of 2^-16 (off by at most 7.6e-6) and kept values are divided by exactly it,
so the expectation is unchanged.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
from flax import linen as nn

_LEVELS = 1 << 16


def keep_mask(rng: chex.PRNGKey, rate: float, shape: tuple[int, ...]) -> tuple[jax.Array, float]:
    """A Bernoulli mask ``keep bool [shape]``, each element kept with probability
    ``1 - rate`` (``rate`` in [0, 1)), and that probability as the mask uses it:
    rounded to a multiple of 2^-16."""
    threshold = round(rate * _LEVELS)
    size = math.prod(shape)
    words = jax.random.bits(rng, ((size + 1) // 2,), jnp.uint32)
    uniform16 = jnp.stack([words & 0xFFFF, words >> 16], axis=-1).reshape(-1)[:size]
    return uniform16.reshape(shape) >= threshold, 1.0 - threshold / _LEVELS


def dropout(x: jax.Array, rate: float, rng: chex.PRNGKey) -> jax.Array:
    """Inverted dropout of ``x`` (any shape and float dtype): kept values scaled by 1/keep."""
    if rate == 0.0:
        return x
    keep, keep_probability = keep_mask(rng, rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(keep_probability, x.dtype), jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """``nn.Dropout``'s interface (a ``"dropout"`` rng), with :func:`keep_mask`."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if deterministic or self.rate == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"))
