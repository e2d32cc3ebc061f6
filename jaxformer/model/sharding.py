"""Meshes ``("data", "fsdp", "model")``, the one logical-axis rules table, the shardings of
state and batches: one code path for a laptop, a GPU and a multi-host slice.

Parameters carry logical axis names that :data:`LOGICAL_AXIS_RULES` maps onto mesh axes;
:func:`constrain` lays out activations under an active mesh (:func:`under_mesh`). Names:
``batch`` [B], ``length`` [S or T], ``embed`` [D], ``heads`` [H], ``kv`` [K], ``mlp`` [F],
``vocab`` [V], ``layers`` [N].
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")   # the mesh axes that split batch rows

# Logical axis → mesh axis (None = replicated): batch rows over ``data`` × ``fsdp``;
# parameters and Adam moments over ``fsdp`` on ``embed`` (ZeRO-3, MaxText's and T5X's
# ``fsdp``); heads, FFN width and vocabulary over ``model`` (Megatron tensor parallelism).
# Rules apply in order and a mesh axis serves one dimension per array, so activations
# ``(batch, length, embed)`` give ``fsdp`` to the batch and only parameters split ``embed``.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("heads", "model"),
    ("mlp", "model"),
    ("vocab", "model"),
    ("embed", "fsdp"),
    ("kv", None),
    ("length", None),
    ("layers", None),
)


def parse_mesh_axes(spec: str | None) -> dict[str, int]:
    """The axis sizes ``spec`` (``"data=4,model=2"``) names, syntax only (no device count). Raises
    ``ValueError``: bad syntax, an unknown or repeated axis name, or a size below 1."""
    sizes: dict[str, int] = {}
    for part in filter(None, (spec or "").replace(" ", "").split(",")):
        name, eq, value = part.partition("=")
        problem = ("expected comma-separated axis=size pairs, e.g. 'data=4,model=2'; got " + repr(part)
                   if not eq or not value.isdigit() else
                   f"unknown axis {name!r}; the axes are {MESH_AXES}" if name not in MESH_AXES else
                   f"axis {name!r} given twice" if name in sizes else
                   f"axis {name!r} must have size >= 1" if int(value) < 1 else None)
        if problem:
            raise ValueError(f"Bad --mesh {spec!r}: {problem}.")
        sizes[name] = int(value)
    return sizes


def parse_mesh(spec: str | None, num_devices: int) -> dict[str, int]:
    """Mesh axis sizes of ``"data=4,model=2"``: an axis left out gets size 1, except ``data``, which takes the
    devices the others leave (``"model=2"`` on 8 devices is ``data=4,fsdp=1,model=2``; ``None``: all on
    ``data``). Raises ``ValueError``: as :func:`parse_mesh_axes`, or sizes whose product is not
    ``num_devices``."""
    sizes = {"model": 1, "fsdp": 1, **parse_mesh_axes(spec)}
    sizes.setdefault("data", max(1, num_devices // (sizes["model"] * sizes["fsdp"])))
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"--mesh {spec!r} gives {' × '.join(f'{a}={sizes[a]}' for a in MESH_AXES)} = "
                         f"{math.prod(sizes.values())} devices, but there are {num_devices}; the product "
                         f"of the axis sizes must equal the device count.")
    return {axis: sizes[axis] for axis in MESH_AXES}


def first_devices(count: int | None) -> list[jax.Device] | None:
    """The first ``count`` devices of a single-process run (``--devices``); ``None`` = all. Raises
    ``ValueError``: ``count`` in a multi-process run, or more devices than there are."""
    if count is None:
        return None
    devices = jax.devices()
    if jax.process_count() > 1 or not 1 <= count <= len(devices):
        raise ValueError(f"--devices {count}: " + (
            "a multi-process run uses every device of every process; leave --devices out (or set "
            "CUDA_VISIBLE_DEVICES / TPU topology per process)." if jax.process_count() > 1 else
            f"this process has {len(devices)} {devices[0].platform} device(s); choose 1 to "
            f"{len(devices)}, or leave it out to use them all."))
    return devices[:count]


def check_mesh_divides(mesh: Mesh, config: Any, *, loaded_from: str | None = None) -> None:
    """Refuses a mesh whose ``fsdp`` axis does not divide ``d_model`` or whose ``model`` axis does not divide
    ``num_heads`` and ``d_ff`` (and, given ``loaded_from``, the run a fine-tune loads, the vocabulary sizes),
    before data is prepared. Raises ``ValueError``: naming each size that does not divide and the fix."""
    fsdp, model = mesh.shape.get("fsdp", 1), mesh.shape.get("model", 1)
    sizes = [("d_model", config.d_model, "fsdp", fsdp), ("num_heads", config.num_heads, "model", model),
             ("d_ff", config.d_ff, "model", model)]
    if loaded_from is not None:
        sizes += [("src_vocab_size", config.src_vocab_size, "model", model),
                  ("tgt_vocab_size", config.tgt_vocab_size, "model", model)]
    problems = [f"{name} {size} is not a multiple of the mesh's {axis} axis ({ways})"
                for name, size, axis, ways in sizes if size % ways]
    if problems:
        named = "--mesh " + ", ".join(f"{a}={n}" for a, n in mesh.shape.items()) + ": " + "; ".join(problems)
        raise ValueError(named + (
            f". These are the sizes of the run --init-from {loaded_from} loads, which a fine-tune keeps: "
            f"choose a mesh whose 'fsdp' size divides its d_model and whose 'model' size divides its "
            f"num_heads, d_ff and vocabulary sizes." if loaded_from is not None else
            ". Choose a mesh whose 'fsdp' size divides d_model and whose 'model' size divides num_heads "
            "and d_ff, or other model sizes."))


def batch_shards(mesh: Mesh) -> int:
    """How many ways batch rows are split: ``data`` × ``fsdp``."""
    return math.prod(mesh.shape.get(axis, 1) for axis in BATCH_AXES)


def make_mesh(spec: str | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh(('data', 'fsdp', 'model'))`` of ``spec`` (:func:`parse_mesh`, which raises)
    over ``devices`` (default: ``jax.devices()``, every process's)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh(spec, len(devices))
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def logical_to_mesh_spec(logical_names: Sequence[str | None]) -> PartitionSpec:
    """Logical names (e.g. ``("embed", "heads", "kv")``) → a mesh ``PartitionSpec``."""
    return nn.logical_to_mesh_axes(tuple(logical_names), LOGICAL_AXIS_RULES)


def constrain(x: jax.Array, logical_names: Sequence[str | None]) -> jax.Array:
    """``x`` laid out by one logical name per dimension; a no-op unless a mesh is active."""
    return nn.with_logical_constraint(x, tuple(logical_names), rules=LOGICAL_AXIS_RULES)


def under_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """``fn`` called (and traced) with ``mesh`` active, so :func:`constrain` applies; so is a
    jitted ``fn``'s ``lower`` (what :mod:`jaxformer.aot` compiles)."""

    def meshed(f):
        @functools.wraps(f)
        def call(*args, **kwargs):
            with jax.set_mesh(mesh):
                return f(*args, **kwargs)
        return call

    wrapper = meshed(fn)
    if hasattr(fn, "lower"):
        wrapper.lower = meshed(fn.lower)
    return wrapper


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def tree_shardings(boxed_tree: Any, mesh: Mesh) -> Any:
    """``NamedSharding`` on ``mesh`` per leaf of ``boxed_tree`` (e.g. the abstract train state), shaped as
    ``nn.unbox(boxed_tree)``: boxed leaves by the rules table, others replicated. Raises ``ValueError``: a
    sharded dimension its mesh axes do not divide (naming the parameter)."""
    mesh_specs = nn.logical_to_mesh(nn.get_partition_spec(boxed_tree), LOGICAL_AXIS_RULES)
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(mesh_specs, is_leaf=is_spec)
    for (path, spec), value in zip(flat, treedef.flatten_up_to(nn.unbox(boxed_tree))):
        check_divisible(_path_name(path), value.shape, spec, mesh)
    return jax.tree_util.tree_unflatten(treedef, [NamedSharding(mesh, spec) for _, spec in flat])


def check_divisible(name: str, shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> None:
    """Raises ``ValueError`` unless each dimension of ``shape`` divides by its mesh axes in ``spec``."""
    for dim, axes in zip(shape, spec):
        size = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
        if dim % size:
            raise ValueError(
                f"{name} has shape {tuple(shape)}: a dimension of {dim} is split over mesh axis "
                f"{'×'.join((axes,) if isinstance(axes, str) else axes)} of size {size}, which does not "
                f"divide it. Choose a mesh whose 'model' size divides num_heads, d_ff and the vocabulary "
                f"size (e.g. --vocab-size a multiple of it) and whose 'fsdp' size divides d_model, or "
                f"smaller axes.")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where everything of a run lives: the mesh and the train state's shardings."""

    mesh: Mesh
    state: Any   # a TrainState-shaped tree of NamedSharding

    @classmethod
    def for_params(cls, mesh: Mesh, boxed_params: Any) -> Layout:
        """The layout of parameters alone (decoding): ``boxed_params`` (abstract, boxed) on ``mesh``."""
        return cls(mesh=mesh, state=types.SimpleNamespace(params=tree_shardings(boxed_params, mesh)))

    @property
    def batch(self) -> NamedSharding:
        """Batches ``[B, L]``: rows split over ``data`` × ``fsdp`` (the ``batch`` rule)."""
        return NamedSharding(self.mesh, logical_to_mesh_spec(("batch", "length")))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def params(self) -> Any:
        return self.state.params

    @property
    def data_size(self) -> int:
        """How many ways batch rows are split (:func:`batch_shards`)."""
        return batch_shards(self.mesh)


def shard_batch(batch: Mapping[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """This process's rows (name → int ``[b, L]``, a contiguous block) as global arrays of the
    batch ``sharding`` (:attr:`Layout.batch`), ``b`` × the mesh's processes rows, a multiple of
    ``data`` × ``fsdp`` (the batching code sizes batches so)."""
    processes, _ = mesh_processes(sharding.mesh)
    return {name: jax.make_array_from_process_local_data(
                sharding, np.asarray(local), (len(local) * processes,) + np.shape(local)[1:])
            for name, local in batch.items()}


def mesh_processes(mesh: Mesh) -> tuple[int, int]:
    """``(count, position)`` of the processes owning devices of ``mesh`` and this one among them."""
    owners = sorted({d.process_index for d in mesh.devices.flat})
    return len(owners), owners.index(jax.process_index())


def process_barrier(name: str, timeout_s: float = 24 * 3600) -> None:
    """Waits until every process reaches the barrier ``name`` (once per run), the coordination service's as
    JAX's array serialization uses (no device work: no gloo timeout). Raises ``jax.errors.JaxRuntimeError``:
    ``timeout_s`` passed, or a process left the cluster."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the client JAX's array_serialization waits on

    distributed.global_state.client.wait_at_barrier(f"jaxformer:{name}", int(timeout_s * 1000))


def to_host(tree: Any) -> Any:
    """NumPy copies of a tree of arrays, gathered from every process when sharded across them."""
    leaves = jax.tree_util.tree_leaves(tree)
    if jax.process_count() == 1 or all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def abstract_state(state: Any) -> Any:
    """``ShapeDtypeStruct`` tree of ``state`` with each array's sharding (an orbax restore target)."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, auto: bool = False) -> bool:
    """Starts ``jax.distributed`` (before any other JAX use) given any argument or ``auto``
    (JAX detects the cluster); whether it did."""
    if coordinator_address is None and num_processes is None and process_id is None and not auto:
        return False
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    return True
