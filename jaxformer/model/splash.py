"""Splash attention, Pallas's TPU flash-attention kernel (``attention_backend="pallas"``),
wrapped as MaxText's ``attention_op`` does: per example on ``[H, L, K]`` heads, masks as
segment ids, no ``[T, S]`` scores in HBM. Native on TPU, interpret mode on CPU (tests), not
on GPU; under a mesh in ``jax.shard_map`` over the batch and head axes (XLA cannot split a
``pallas_call``). Shapes: B batch, H heads, T queries, S keys, K head width.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec

from jaxformer.model.masks import PADDING_SEGMENT, dense_from_segments
from jaxformer.model.sharding import logical_to_mesh_spec

_LANES = 128                  # the kernel's blocks are multiples of the TPU's 128 lanes
_BLOCKS = (512, 256, 128)     # MaxText's default sa_block_* is 512


def padded_length(length: int) -> tuple[int, int]:
    """``(padded length, block)``: ``length`` rounded up to a multiple of 128 and the
    largest of 512, 256, 128 that divides it (the kernel tiles the length by its block)."""
    padded = -(-length // _LANES) * _LANES
    return padded, next(b for b in _BLOCKS if padded % b == 0)


def _target_platform() -> str:
    """The active mesh's platform (compile-only TPU devices too), else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()


def _interpret_mode(interpret: bool | None) -> bool:
    """``interpret`` resolved: ``None`` = native on TPU, interpret mode on CPU; on a GPU
    (splash is a TPU kernel) a ``ValueError`` naming the backends to use."""
    if interpret is not None:
        return interpret
    platform = _target_platform()
    if platform in ("gpu", "cuda", "rocm"):
        raise ValueError(f"attention_backend='pallas' runs Pallas's TPU splash-attention kernel, which "
                         f"does not run on {platform}; use attention_backend='cudnn' (flash attention "
                         f"on NVIDIA GPUs) or 'xla'.")
    return platform != "tpu"


def _kernel(heads: int, q_len: int, kv_len: int, causal: bool, interpret: bool):
    """The splash kernel of ``[heads, q_len, K]`` queries, ``[heads, kv_len, K]`` keys (padded
    lengths); built per trace (it holds arrays), the library caches the mask analysis."""
    _, block_q = padded_length(q_len)
    _, block_kv = padded_length(kv_len)
    blocks = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                               block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
                               block_q_dq=block_q, block_kv_dq=block_kv)
    one_head = (splash_mask.CausalMask((q_len, kv_len)) if causal
                else splash_mask.FullMask((q_len, kv_len)))
    return splash.make_splash_mha(splash_mask.MultiHeadMask([one_head] * heads), block_sizes=blocks,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)


def _fitting(axes, size: int, mesh) -> str | tuple[str, ...] | None:
    """The mesh axes of one dimension's rule, or ``None`` (replicated) if they do not divide ``size``."""
    if axes is None:
        return None
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return axes if size % int(np.prod([mesh.shape[a] for a in names])) == 0 else None


def _run_kernel(q_BHTK, k_BHSK, v_BHSK, q_segments_BT, kv_segments_BS, causal: bool, interpret: bool):
    """The kernel on padded inputs per example; under a mesh in ``shard_map`` over batch and heads."""

    def per_shard(q, k, v, q_segments, kv_segments):
        kernel = _kernel(q.shape[1], q.shape[2], k.shape[2], causal, interpret)
        one = lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=splash.SegmentIds(q=qs, kv=ks))  # noqa: E731
        return jax.vmap(one)(q, k, v, q_segments, kv_segments)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return per_shard(q_BHTK, k_BHSK, v_BHSK, q_segments_BT, kv_segments_BS)
    batch, heads = q_BHTK.shape[:2]
    batch_axes = _fitting(logical_to_mesh_spec(("batch",))[0], batch, mesh)
    head_axes = _fitting(logical_to_mesh_spec(("heads",))[0], heads, mesh)
    heads_spec = PartitionSpec(batch_axes, head_axes, None, None)
    segments_spec = PartitionSpec(batch_axes, None)
    # check_vma=False: a pallas_call states no varying-axes rule (MaxText's check_rep=False).
    sharded = jax.shard_map(per_shard, mesh=mesh, in_specs=(heads_spec,) * 3 + (segments_spec,) * 2,
                            out_specs=heads_spec, check_vma=False)
    return sharded(q_BHTK, k_BHSK, v_BHSK, q_segments_BT, kv_segments_BS)


def splash_dot_product_attention(q_BHTK, k_BHSK, v_BHSK, q_segments_BT, kv_segments_BS, *,
                                 causal: bool, interpret: bool | None = None):
    """softmax(QKᵀ/√K + M)V ``[B, H, T, K]`` (``v``'s dtype) by the splash kernel: queries
    ``[B, H, T, K]``, keys/values ``[B, H, S, K]`` (float32 or bfloat16, any K), the mask M as
    segment ids int ``[B, T]``/``[B, S]`` (:func:`~jaxformer.model.masks.dense_from_segments`);
    a query with no key gets zeros. Softmax in float32; no dropout, no weights. ``interpret``:
    Pallas interpret mode, ``None`` = native on TPU, interpreted on CPU. Raises ``ValueError``:
    ``interpret=None`` on a GPU (use ``"cudnn"`` or ``"xla"``)."""
    batch, heads, q_len, head_dim = q_BHTK.shape
    kv_len = k_BHSK.shape[2]
    chex.assert_shape([k_BHSK, v_BHSK], (batch, heads, kv_len, head_dim))
    chex.assert_shape(q_segments_BT, (batch, q_len))
    chex.assert_shape(kv_segments_BS, (batch, kv_len))
    if causal:
        chex.assert_equal(q_len, kv_len)
    interpret = _interpret_mode(interpret)
    q_segments_BT = q_segments_BT.astype(jnp.int32)
    kv_segments_BS = kv_segments_BS.astype(jnp.int32)
    q_padded, _ = padded_length(q_len)
    kv_padded, _ = padded_length(kv_len)

    def pad(x, length, value=0):    # along axis 2 ([B,H,L,K]) or 1 ([B,L])
        axis = 2 if x.ndim == 4 else 1
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, length - x.shape[axis])
        return jnp.pad(x, widths, constant_values=value)

    # The kernel does not scale; scaled in q's dtype as the reference core does.
    q_BHTK_scaled = q_BHTK * jnp.asarray(head_dim ** -0.5, q_BHTK.dtype)
    out_BHTK = _run_kernel(pad(q_BHTK_scaled, q_padded), pad(k_BHSK, kv_padded), pad(v_BHSK, kv_padded),
                           pad(q_segments_BT, q_padded, PADDING_SEGMENT),
                           pad(kv_segments_BS, kv_padded, PADDING_SEGMENT), causal, interpret)
    out_BHTK = out_BHTK[:, :, :q_len].astype(v_BHSK.dtype)
    # Rows with no key (an all-padding source; a pad query of a packed row): zeros.
    # XLA fuses the comparison into the reduction; no [B, T, S] array is built.
    any_key_B1T1 = jnp.any(dense_from_segments(q_segments_BT, kv_segments_BS, causal), axis=-1,
                           keepdims=True)
    return jnp.where(any_key_B1T1, out_BHTK, jnp.zeros((), out_BHTK.dtype))
