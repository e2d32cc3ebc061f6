"""The weight matmuls in a narrower operand dtype, ``config.matmul_dtype`` (CTranslate2's
``compute_type``, Marian's ``--gemm-type``): operands in it, summed and returned in ``dtype``.
LayerNorm, softmax, residuals and the attention core keep ``dtype``; the embedding lookup
rounds its rows too, so float32 and cast parameters (:func:`cast_matmul_weights`) agree.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer.model.config import TransformerConfig


def weight_einsum(subscripts: str, x, kernel, config: TransformerConfig):
    """``jnp.einsum(subscripts, x, kernel)``, operands in ``matmul_dtype``, summed in ``compute_dtype``."""
    compute = config.compute_dtype
    if config.matmul_dtype is None:
        return jnp.einsum(subscripts, x.astype(compute), kernel.astype(compute))
    operand = jnp.dtype(config.matmul_dtype)
    return jnp.einsum(subscripts, x.astype(operand), kernel.astype(operand), preferred_element_type=compute)


def dense_dot_general(config: TransformerConfig):
    """:class:`flax.linen.Dense`'s ``dot_general`` as :func:`weight_einsum` computes."""
    if config.matmul_dtype is None:
        return jax.lax.dot_general
    operand, compute = jnp.dtype(config.matmul_dtype), config.compute_dtype

    @functools.wraps(jax.lax.dot_general)
    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        del preferred_element_type   # Dense asks for none; the product is summed in the compute dtype
        return jax.lax.dot_general(lhs.astype(operand), rhs.astype(operand), dimension_numbers,
                                   precision=precision, preferred_element_type=compute, **kwargs)

    return dot_general


def cast_matmul_weights(params, config: TransformerConfig):
    """``params`` with the weight matrices (``*kernel``, ``embedding``) in ``matmul_dtype`` (if
    set), once, so decoding steps do not cast them; biases and LayerNorm keep their dtype."""
    if config.matmul_dtype is None:
        return params
    operand = jnp.dtype(config.matmul_dtype)

    def cast(path, x):
        name = str(getattr(path[-1], "key", ""))
        return x.astype(operand) if name == "embedding" or name.endswith("kernel") else x

    return jax.tree_util.tree_map_with_path(cast, params)
