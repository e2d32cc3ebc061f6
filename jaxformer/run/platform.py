"""Which JAX platform a command runs on, when the user did not say (``JAX_PLATFORMS``).

With ``libtpu`` installed (the ``tpu`` extra, for ``jaxformer-compile``) JAX tries the
TPU backend first on any machine: on a CPU host libtpu then queries a metadata server,
warns about the accelerator type and workers, and takes ``/tmp/libtpu_lockfile``
before JAX falls back to the CPU. ``import jaxformer`` calls :func:`skip_absent_tpu`
(and the commands that run a model again), so a CPU host never starts the TPU backend.
"""

from __future__ import annotations

import glob
import importlib.util
import os


def tpu_attached() -> bool:
    """Whether this machine shows TPU chips: ``/dev/accel*`` (v2-v5e) or ``/dev/vfio/N``
    (v5p, v6e), the device nodes libtpu opens."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def skip_absent_tpu() -> bool:
    """Runs JAX on the CPU when libtpu is installed but no TPU is attached, no GPU plugin
    is installed and ``JAX_PLATFORMS`` is unset. Must run before the first JAX
    computation; returns whether it chose the CPU."""
    import jax

    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or tpu_attached():
        return False
    if importlib.util.find_spec("libtpu") is None:
        return False
    if importlib.util.find_spec("jax_plugins") is not None:
        return False   # a GPU plugin (CUDA, ROCm) is installed: JAX picks the platform
    jax.config.update("jax_platforms", "cpu")
    return True
