"""Test strictness, set before JAX initialises its backends.

* 8 fake CPU devices, so every sharding path runs on a laptop or CI.
* ``jax_numpy_rank_promotion="raise"``: implicit rank broadcasting is an error.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
