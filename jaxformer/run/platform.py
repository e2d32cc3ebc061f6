"""The CPU for JAX when libtpu is installed but no TPU attached (JAX would try the TPU backend
first: a metadata query, warnings and ``/tmp/libtpu_lockfile``); ``import jaxformer`` calls it."""

from __future__ import annotations

import glob
import importlib.util
import os


def tpu_attached() -> bool:
    """Whether TPU device nodes are there: ``/dev/accel*`` (v2-v5e) or ``/dev/vfio/N`` (v5p, v6e)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def skip_absent_tpu() -> bool:
    """Chooses the CPU when libtpu is installed, no TPU attached, no GPU plugin installed and
    ``JAX_PLATFORMS`` unset; before JAX's first computation. Returns whether it did."""
    import jax

    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or tpu_attached():
        return False
    if importlib.util.find_spec("libtpu") is None:
        return False
    if importlib.util.find_spec("jax_plugins") is not None:
        return False   # a GPU plugin (CUDA, ROCm) is installed: JAX picks the platform
    jax.config.update("jax_platforms", "cpu")
    return True
