"""The weight matmuls in a narrower operand dtype: ``config.matmul_dtype``.

Every matmul of activations with a weight matrix goes through :func:`weight_einsum` or
:func:`dense_dot_general`: in ``dtype``, or with ``"bfloat16"`` operands summed and
returned in ``dtype`` (what bfloat16 matmul units compute, and CTranslate2's
``compute_type`` and Marian's ``--gemm-type`` choose for decoding; timings in
``benchmarks/README.md``). LayerNorm, softmax, residuals, the attention core and the
fused training loss keep ``dtype``. Weights stored in ``matmul_dtype``
(:func:`cast_matmul_weights`, once per run) are used as they are; the embedding lookup
rounds its rows too, so float32 and cast parameters compute the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer.model.config import TransformerConfig


def weight_einsum(subscripts: str, x, kernel, config: TransformerConfig):
    """``jnp.einsum(subscripts, x, kernel)`` of activations ``x`` and a weight ``kernel``
    (any float dtypes) with operands in ``config.matmul_dtype``; the product in (and
    summed in) ``config.compute_dtype``."""
    compute = config.compute_dtype
    if config.matmul_dtype is None:
        return jnp.einsum(subscripts, x.astype(compute), kernel.astype(compute))
    operand = jnp.dtype(config.matmul_dtype)
    return jnp.einsum(subscripts, x.astype(operand), kernel.astype(operand), preferred_element_type=compute)


def dense_dot_general(config: TransformerConfig):
    """The ``dot_general`` for :class:`flax.linen.Dense` layers (``dtype=compute_dtype``):
    :func:`jax.lax.dot_general` with operands in ``config.matmul_dtype`` and the result
    in the compute dtype; plain ``dot_general`` when ``matmul_dtype`` is ``None``."""
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
    """``params`` with the weight matrices (``*kernel``, ``embedding``) in
    ``config.matmul_dtype``, once, so the decoding steps do not cast them again;
    biases and LayerNorm parameters keep their dtype. ``params`` unchanged when
    ``matmul_dtype`` is ``None``."""
    if config.matmul_dtype is None:
        return params
    operand = jnp.dtype(config.matmul_dtype)

    def cast(path, x):
        name = str(getattr(path[-1], "key", ""))
        return x.astype(operand) if name == "embedding" or name.endswith("kernel") else x

    return jax.tree_util.tree_map_with_path(cast, params)
