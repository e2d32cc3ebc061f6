"""The CPU for JAX when libtpu is installed but no TPU attached (JAX would try the TPU backend
first: a metadata query, warnings and ``/tmp/libtpu_lockfile``); ``import jaxformer`` calls it.
Imports no JAX: the CTranslate2 engine's path stays light."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys


def tpu_attached() -> bool:
    """Whether TPU device nodes are there: ``/dev/accel*`` (v2-v5e) or ``/dev/vfio/N`` (v5p, v6e)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def skip_absent_tpu() -> bool:
    """Chooses the CPU when libtpu is installed, no TPU attached, no GPU plugin installed and
    ``JAX_PLATFORMS`` unset; before JAX's first computation. Returns whether it did. Before
    ``import jax`` it sets ``JAX_PLATFORMS=cpu`` (which JAX reads at import), after it JAX's config."""
    jax = sys.modules.get("jax")
    if os.environ.get("JAX_PLATFORMS") or (jax and jax.config.jax_platforms) or tpu_attached():
        return False
    if importlib.util.find_spec("libtpu") is None:
        return False
    if importlib.util.find_spec("jax_plugins") is not None:
        return False   # a GPU plugin (CUDA, ROCm) is installed: JAX picks the platform
    if jax is None:
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        jax.config.update("jax_platforms", "cpu")
    return True


def accelerator_present() -> bool:
    """Whether JAX would find a TPU or GPU here, judged without importing it: ``JAX_PLATFORMS``
    naming one, TPU device nodes, or a GPU plugin (``jax_plugins``) beside NVIDIA/ROCm device nodes."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(name in platforms for name in ("tpu", "cuda", "gpu", "rocm"))
    gpu_nodes = glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd")
    return tpu_attached() or bool(gpu_nodes and importlib.util.find_spec("jax_plugins") is not None)
