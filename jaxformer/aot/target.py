"""Compile-only devices on a CPU host, and the run's mesh over them.

``jax.experimental.topologies.get_topology_desc`` asks libtpu (or the CUDA plugin) for
the devices of a slice that is not attached: programs lowered for them compile to real
executables, with the compiler's memory and cost analyses and out-of-memory errors. No
TPU backend starts (as MaxText's ``train_compile.py``).
"""

from __future__ import annotations

import os

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxformer.aot.chips import SliceSpec, gpu_target_config
from jaxformer.model.sharding import MESH_AXES, make_mesh, parse_mesh


def _quiet_libtpu(spec: SliceSpec) -> None:
    """What libtpu asks a TPU VM's metadata server for, given instead: without it, it
    queries the server (and waits) and warns about the accelerator type and workers.
    Only the compile tool sets these, never an import of jaxformer."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # Compile-only devices touch no chip: several processes may load libtpu at once
    # (without this the second fails on /tmp/libtpu_lockfile).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", spec.name)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def target_devices(spec: SliceSpec, num_slices: int = 1) -> list[jax.Device]:
    """The compile-only devices of ``num_slices`` slices of ``spec`` (``num_slices`` ≥ 1):
    TPU chips from libtpu (one device per chip, or per megacore chip on v4/v5p; slices
    joined over DCN), or ``num_slices`` hosts of CUDA GPUs from the jax CUDA plugin (no
    GPU and no driver needed, the host's ``ptxas`` compiles).

    Raises:
      RuntimeError: libtpu or the CUDA plugin is not installed, or refuses the topology.
    """
    from jax.experimental.topologies import get_topology_desc

    if spec.chip_config_name == "gpu":
        extra, kind = "gpu-aot", "CUDA"
        describe = lambda: get_topology_desc(  # noqa: E731
            platform="cuda", topology_name="", target_config=gpu_target_config(spec.chip),
            topology=f"{num_slices}x1x{spec.chips}")
    else:
        extra, kind = "tpu", "TPU"
        _quiet_libtpu(spec)
        describe = lambda: get_topology_desc(  # noqa: E731
            platform="tpu", topology_name=spec.topology, chip_config_name=spec.chip_config_name,
            chips_per_host_bounds=spec.chips_per_host_bounds, num_slices=num_slices)
    try:
        return list(describe().devices)
    except (RuntimeError, NotImplementedError) as e:   # not installed, or refusing (JaxRuntimeError)
        raise RuntimeError(f"No compile-only {kind} devices for {spec.name} ({spec.topology}): "
                           f"{str(e).strip().splitlines()[0]}. Install it, paired with this jax, with "
                           f"pip install 'jaxformer[{extra}]'.") from e


def target_mesh(devices: list[jax.Device], spec: str | None, num_slices: int = 1) -> Mesh:
    """The run's ``(data, fsdp, model)`` mesh over target ``devices``; over several slices
    ``data`` (a multiple of ``num_slices``) spans them (DCN) and ``fsdp``, ``model`` stay
    inside each (MaxText's ``dcn_data_parallelism``). Raises ``ValueError`` where the mesh
    does not fit the devices."""
    if num_slices == 1:
        return make_mesh(spec, devices)
    sizes = parse_mesh(spec, len(devices))
    ici = (sizes["data"] // num_slices, sizes["fsdp"], sizes["model"])
    grid = mesh_utils.create_hybrid_device_mesh(ici, (num_slices, 1, 1), devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
