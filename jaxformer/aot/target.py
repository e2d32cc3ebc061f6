"""Compile-only TPU devices on a CPU host, and the run's mesh over them.

``jax.experimental.topologies.get_topology_desc`` asks ``libtpu`` (the ``tpu`` extra:
``pip install 'jaxformer[tpu]'``) for the devices of a slice that is not attached:
programs lowered for them compile to real TPU executables, with the compiler's memory
and cost analyses, and fail with the same out-of-memory error as on the chips. No TPU
backend starts: the CPU stays JAX's platform (MaxText's ``train_compile.py`` works the
same way).
"""

from __future__ import annotations

import os

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxformer.aot.chips import SliceSpec
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


def tpu_devices(spec: SliceSpec, num_slices: int = 1) -> list[jax.Device]:
    """The compile-only devices of ``num_slices`` slices of ``spec`` (one per chip, or per
    megacore chip on v4/v5p), connected over DCN when ``num_slices > 1``.

    Raises:
      RuntimeError: libtpu is not installed, or refuses the topology.
    """
    if num_slices < 1:
        raise ValueError(f"--num-slices must be at least 1, got {num_slices}.")
    _quiet_libtpu(spec)
    from jax.experimental.topologies import get_topology_desc

    try:
        topology = get_topology_desc(platform="tpu", topology_name=spec.topology,
                                     chip_config_name=spec.chip_config_name,
                                     chips_per_host_bounds=spec.chips_per_host_bounds,
                                     num_slices=num_slices)
    except (RuntimeError, NotImplementedError) as e:   # libtpu missing or refusing (JaxRuntimeError)
        raise RuntimeError(f"No compile-only TPU devices for {spec.name} ({spec.topology}): "
                           f"{str(e).strip().splitlines()[0]}. Install libtpu, paired with this jax, "
                           f"with pip install 'jaxformer[tpu]'.") from e
    return list(topology.devices)


def gpu_devices(spec: SliceSpec, num_hosts: int = 1) -> list[jax.Device]:
    """Compile-only CUDA devices: ``num_hosts`` nodes of ``spec``'s GPUs (the jax CUDA
    plugin: pip install 'jaxformer[gpu-aot]'; no GPU and no driver needed, the host's
    ``ptxas`` compiles).

    Raises:
      RuntimeError: the plugin is missing, or refuses the topology.
    """
    from jax.experimental.topologies import get_topology_desc

    from jaxformer.aot.chips import gpu_target_config

    try:
        topology = get_topology_desc(platform="cuda", topology_name="", target_config=gpu_target_config(
            spec.chip), topology=f"{num_hosts}x1x{spec.chips}")
    except (RuntimeError, NotImplementedError) as e:   # no plugin; or the plugin's JaxRuntimeError
        raise RuntimeError(f"No compile-only CUDA devices for {spec.name}: {str(e).strip().splitlines()[0]}. "
                           f"Install the jax CUDA plugin with pip install 'jaxformer[gpu-aot]'.") from e
    return list(topology.devices)


def target_devices(spec: SliceSpec, num_slices: int = 1) -> list[jax.Device]:
    """:func:`tpu_devices` or :func:`gpu_devices`, by the target's kind."""
    return gpu_devices(spec, num_slices) if spec.chip_config_name == "gpu" else tpu_devices(spec, num_slices)


def target_mesh(devices: list[jax.Device], spec: str | None, num_slices: int = 1) -> Mesh:
    """The run's ``(data, fsdp, model)`` mesh over target ``devices``. Over several slices
    the ``data`` axis spans them (DCN: only the gradient all-reduce crosses slices) and
    ``fsdp`` and ``model`` stay inside each slice (ICI), as MaxText's ``dcn_data_parallelism``.

    Raises:
      ValueError: the mesh does not fit the devices, or ``data`` is not a multiple of
        the slice count.
    """
    sizes = parse_mesh(spec, len(devices))
    if num_slices == 1:
        return make_mesh(spec, devices)
    if sizes["data"] % num_slices:
        raise ValueError(f"--mesh data={sizes['data']} must be a multiple of --num-slices {num_slices}: "
                         f"the data axis spans the slices.")
    ici = (sizes["data"] // num_slices, sizes["fsdp"], sizes["model"])
    grid = mesh_utils.create_hybrid_device_mesh(ici, (num_slices, 1, 1), devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
