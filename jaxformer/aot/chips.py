"""Accelerator chips and slice names: what the compile tool compiles for and judges against.
:data:`CHIPS`: each chip's HBM, dense bf16 peak, HBM and inter-chip bandwidth (vendors'
figures); :func:`slice_spec` maps the names users rent (``v4-8``, ``v5e-16``, ``h100-8``)
to what ``get_topology_desc`` takes, as MaxText's ``accelerator_to_spec_map.py`` names
them: v4 and v5p names count TensorCores (two per chip, one "megacore" device per chip),
v5e and v6e names count chips."""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip (per-chip figures)."""

    name: str
    hbm_bytes: int            # memory one device may use
    bf16_flops: float         # dense peak, FLOP/s
    hbm_bandwidth: float      # bytes/s
    ici_bandwidth: float      # bytes/s per chip, bidirectional inter-chip links (NVLink for GPUs)


# Cloud TPU system architecture (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e: v4's ICI is
# 2,400 Gbit/s); NVIDIA H100 and H200 SXM datasheets (dense bf16, NVLink 900 GB/s).
CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", 32 * GiB, 275e12, 1200e9, 300e9),
    "v5e": Chip("TPU v5e", 16 * GiB, 197e12, 819e9, 400e9),
    "v5p": Chip("TPU v5p", 95 * GiB, 459e12, 2765e9, 1200e9),
    "v6e": Chip("TPU v6e (Trillium)", 32 * GiB, 918e12, 1640e9, 800e9),
    "h100": Chip("NVIDIA H100 SXM", 80 * 10**9, 989e12, 3.35e12, 900e9),
    "h200": Chip("NVIDIA H200 SXM", 141 * 10**9, 989e12, 4.8e12, 900e9),
}


@dataclasses.dataclass(frozen=True)
class SliceSpec:
    """A TPU slice or GPU node as ``get_topology_desc`` takes it."""

    name: str                  # "v5e-16"
    chip: str                  # a key of CHIPS
    topology: str              # "v5e:4x4"
    chip_config_name: str      # "megacore" (one device per v4/v5p chip), "default", or "gpu"
    chips_per_host_bounds: tuple[int, int, int]
    chips: int


# chips → topology shape, for the slice sizes Cloud TPU sells
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8"}
_SHAPES_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_FAMILIES = {  # name prefix: (chip, topology prefix, config, cores per chip in the name, shapes)
    "v4": ("v4", "v4", "megacore", 2, _SHAPES_3D),
    "v5p": ("v5p", "v5", "megacore", 2, _SHAPES_3D),
    "v5e": ("v5e", "v5e", "default", 1, _SHAPES_2D),
    "v6e": ("v6e", "v6e", "default", 1, _SHAPES_2D),
}

# GPU nodes: ``h100-8`` = 8 GPUs of one host over NVLink (more hosts: --num-slices).
GPU_NODES = {"h100": 8, "h200": 8}

# What XLA's GPU compiler needs to know of a chip it cannot see (a GpuTargetConfigProto,
# xla/stream_executor/device_description.proto), from the vendor's specifications:
# H100/H200 SXM, compute capability 9.0, 132 SMs, 50 MiB L2, 1.98 GHz boost.
_HOPPER = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
               shared_memory_per_core=233472, threads_per_core_limit=2048, core_count=132, fpus_per_core=128,
               block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535,
               l2_cache_size=50 * 2**20, clock_rate_ghz=1.98, shared_memory_per_block_optin=232448,
               registers_per_core_limit=65536, registers_per_block_limit=65536, thread_dim_limit_x=1024,
               thread_dim_limit_y=1024, thread_dim_limit_z=64)


def gpu_target_config(chip: str) -> str:
    """The text-format ``GpuTargetConfigProto`` of an ``h100`` or ``h200``, which
    ``get_topology_desc(platform="cuda", target_config=...)`` takes."""
    spec = CHIPS[chip]
    fields = {**_HOPPER, "memory_bandwidth": int(spec.hbm_bandwidth), "device_memory_size": spec.hbm_bytes}
    body = "".join(f"  {k}: {v}\n" for k, v in fields.items())
    return (f"gpu_device_info {{\n{body}  cuda_compute_capability {{ major: 9 }}\n"
            f'  device_vendor: "NVIDIA Corporation"\n  name: "{spec.name}"\n}}\n'
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 1 }}\n'
            f'device_description_str: "{spec.name}"\n')


def slice_names() -> list[str]:
    """Every slice name :func:`slice_spec` knows, e.g. ``v4-8 … v6e-256``."""
    return [f"{family}-{chips * cores}" for family, (_, _, _, cores, shapes) in _FAMILIES.items()
            for chips in shapes] + [f"{chip}-{count}" for chip, count in GPU_NODES.items()]


def slice_spec(name: str) -> SliceSpec:
    """The topology of a slice name (``v4-8``, ``v5e-16``, ``v5p-128``, ``v6e-8``, ``h100-8``);
    ``ValueError`` for any other, listing the known ones."""
    family, _, size = name.lower().partition("-")
    if family in GPU_NODES and size == str(GPU_NODES[family]):
        return SliceSpec(name.lower(), family, f"1x1x{size}", "gpu", (1, 1, 1), int(size))
    if family in _FAMILIES and size.isdigit():
        chip, prefix, config, cores, shapes = _FAMILIES[family]
        chips = int(size) // cores
        if int(size) % cores == 0 and chips in shapes:
            # A v5e/v6e host holds up to 8 chips (2x4); slices of 16 and more are 2x2 per host.
            bounds = (2, 4, 1) if chips == 8 and cores == 1 else (2, 2, 1)
            return SliceSpec(name.lower(), chip, f"{prefix}:{shapes[chips]}", config, bounds, chips)
    raise ValueError(f"Unknown TPU slice {name!r}; known: {', '.join(slice_names())}.")
