"""A run's programs compiled for a target this host lacks, and reported
(:mod:`jaxformer.aot.report`): the jitted train step on a packed batch and beam search,
lowered from ``jax.ShapeDtypeStruct`` inputs with their shardings (a model too large for
this host lowers all the same) and compiled for compile-only devices:
``jax.experimental.topologies.get_topology_desc`` asks libtpu (or the CUDA plugin) for a
slice that is not attached, and no TPU backend starts (as MaxText's ``train_compile.py``).
Reports are kept as JSON behind its SHA-256 under a key of everything they depend on
(sources, library and libtpu versions, tracing settings, target, program inputs)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import mesh_utils
from jax.experimental.serialize_executable import serialize
from jax.sharding import AxisType, Mesh

from jaxformer.aot import report
from jaxformer.aot.chips import CHIPS, SliceSpec, gpu_target_config, slice_spec
from jaxformer.data.batching import check_batch_rows, rows_per_batch
from jaxformer.decode.beam_search import Beam
from jaxformer.decode.decoding import jit_decoder
from jaxformer.decode.exported import ExportCache, _read_verified, _write_atomically
from jaxformer.model.config import TransformerConfig, preset
from jaxformer.model.sharding import MESH_AXES, make_mesh, parse_mesh
from jaxformer.model.transformer import Transformer
from jaxformer.train.optimizer import make_optimizer, transformer_schedule
from jaxformer.train.step import abstract_train_state, jit_train_step

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxformer" / "compile"
COST_KEYS = ("flops", "bytes accessed")


def target_devices(spec: SliceSpec, num_slices: int = 1) -> list[jax.Device]:
    """The compile-only devices of ``num_slices`` slices of ``spec``: TPU chips from libtpu
    (one device per chip, or per megacore chip on v4/v5p), or hosts of CUDA GPUs from the
    jax CUDA plugin (no GPU or driver needed: the host's ``ptxas`` compiles).
    ``RuntimeError``: libtpu or the plugin is missing or refuses the topology."""
    from jax.experimental.topologies import get_topology_desc

    gpu = spec.chip_config_name == "gpu"
    if gpu:
        where = dict(platform="cuda", topology_name="", target_config=gpu_target_config(spec.chip),
                     topology=f"{num_slices}x1x{spec.chips}")
    else:   # what libtpu would ask a TPU VM's metadata server for (and wait, and warn)
        for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", spec.name),
                            ("TPU_WORKER_HOSTNAMES", "localhost"),
                            ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):   # no chip is touched: no lock file
            os.environ.setdefault(name, value)
        where = dict(platform="tpu", topology_name=spec.topology, chip_config_name=spec.chip_config_name,
                     chips_per_host_bounds=spec.chips_per_host_bounds, num_slices=num_slices)
    try:
        return list(get_topology_desc(**where).devices)
    except (RuntimeError, NotImplementedError) as e:   # not installed, or refusing (JaxRuntimeError)
        raise RuntimeError(f"No compile-only {'CUDA' if gpu else 'TPU'} devices for {spec.name} "
                           f"({spec.topology}): {str(e).strip().splitlines()[0]}. Install it, paired with "
                           f"this jax, with pip install 'jaxformer[{'gpu-aot' if gpu else 'tpu'}]'.") from e


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


def _abstract_state(config: TransformerConfig, mesh: Mesh) -> tuple[Transformer, Any, Any]:
    """The model, and its train state and layout on ``mesh`` as ``ShapeDtypeStruct``s."""
    model, tx = Transformer(config), make_optimizer(transformer_schedule(config.d_model, 4000))
    return model, *abstract_train_state(model, tx, mesh)


def lower_train_step(config: TransformerConfig, mesh: Mesh, rows: int, length: int,
                     label_smoothing: float = 0.1, grad_accum_steps: int = 1) -> jax.stages.Lowered:
    """The train step on ``mesh`` for ``rows`` × ``length`` packed rows; ``rows`` divides by the
    data × fsdp axes × accumulation steps (``ValueError``: a sharded parameter does not)."""
    model, state, layout = _abstract_state(config, mesh)
    step = jit_train_step(model, label_smoothing, layout=layout, grad_accum_steps=grad_accum_steps)
    row = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=layout.batch)
    batch = dict.fromkeys(("src", "tgt_in", "tgt_out", "src_segments", "tgt_segments"), row)   # packed
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=layout.replicated)
    return step.lower(state, batch, key)


def lower_beam_search(config: TransformerConfig, mesh: Mesh, batch: int, src_len: int, beam_size: int = 4,
                      max_decode_len: int = 64) -> jax.stages.Lowered:
    """Beam search on ``mesh`` (parameters laid out as in training, sentences over ``data``)
    of ``batch`` sources of ``src_len`` ids; ``batch`` divides by the data × fsdp axes."""
    model, state, layout = _abstract_state(config, mesh)
    decoder = jit_decoder(model, Beam(beam_size), layout, max_decode_len=max_decode_len, bos_id=1, eos_id=2,
                          extra_len=50)   # the tool's limit: source length + 50
    src = jax.ShapeDtypeStruct((batch, src_len), jnp.int32, sharding=layout.batch)
    return decoder.lower(state.params, src)


LOWER = {"train_step": lower_train_step, "beam_search": lower_beam_search}


def _cache_path(directory: str | Path, **inputs: Any) -> Path:
    """The report file of a compile's ``inputs`` in ``directory``."""
    libtpu = next((d.version for d in importlib.metadata.distributions(name="libtpu")), "none")
    return Path(directory) / f"{ExportCache(directory).key('compile-report', libtpu, inputs)}.json"


def _host_cost(name: str, config: TransformerConfig, shape: dict, scanned: bool) -> dict[str, float]:
    """FLOPs and bytes of the program lowered for one host CPU device (scanned or unrolled layers)."""
    host = make_mesh(None, jax.devices("cpu")[:1])
    cost = LOWER[name](config.replace(scan_layers=scanned), host, **shape).cost_analysis()
    return {k: float(cost.get(k, 0.0)) for k in COST_KEYS}


def _compile(name: str, config: TransformerConfig, mesh: Mesh, shape: dict[str, Any], chip: report.Chip,
             on_gpu: bool, save: str | None) -> dict[str, Any]:
    """One program's report, or the verdict of a compile XLA:TPU stops as out of memory."""
    start = time.perf_counter()
    try:
        compiled = LOWER[name](config, mesh, **shape).compile()
    except Exception as e:
        if (needed := report.out_of_memory(e)) is None:
            raise
        return {"fits": False, "needed": needed[0], "hbm": needed[1],
                "compile_s": time.perf_counter() - start, "verdict": report.does_not_fit(*needed)}
    compile_s = time.perf_counter() - start
    cost, scale = compiled.cost_analysis() or {}, None
    if on_gpu and not cost:   # XLA:GPU counts nothing: the unrolled program on one host device does
        cost = {k: v / mesh.size for k, v in _host_cost(name, config, shape, False).items()}
    elif name == "train_step" and config.scan_layers:   # XLA counts a loop body once
        unrolled, scanned = (_host_cost(name, config, shape, s) for s in (False, True))
        scale = {k: unrolled[k] / scanned[k] if scanned[k] else 1.0 for k in COST_KEYS}
        cost = {k: float(cost.get(k, 0.0)) * scale[k] for k in COST_KEYS}
    # beam search: XLA counts its while body (one token per sentence) once
    tokens = shape["rows"] * shape["length"] if name == "train_step" else shape["batch"]
    if save:
        Path(save).mkdir(parents=True, exist_ok=True)
        (Path(save) / f"{name}.xla").write_bytes(serialize(compiled)[0])
    return {**report.analyse(compiled, chip, tokens, cost, scale), "compile_s": compile_s}


def compile_all(cfg: Any, topology: str, num_slices: int = 1, decode_batch: int | None = 64,
                save: str | None = None, cache_dir: str | Path | None = None,
                reuse: bool = True) -> dict[str, Any]:
    """``{"target": …, "train_step": report, "beam_search": report}`` for ``cfg`` (a
    :class:`jaxformer.run.config.TrainConfig`) on ``num_slices`` of ``topology`` (no beam
    search when ``decode_batch`` is ``None``), rows sized as training sizes them. Reports
    are read from ``cache_dir`` when ``reuse`` and nothing is ``save``d, and written there.

    Raises:
      ValueError: an unknown topology, a mesh that does not fit, too few rows for it; one
        message for an attention kernel of the other platform, a ``data`` axis that is no
        multiple of ``num_slices`` and a ``decode_batch`` the data axes do not divide.
      RuntimeError: no compile-only devices (libtpu or the CUDA plugin missing).
    """
    spec = slice_spec(topology)
    chip, on_gpu = CHIPS[spec.chip], spec.chip_config_name == "gpu"
    config = preset(cfg.model.preset, src_vocab_size=cfg.data.vocab_size, **cfg.model.overrides())
    devices = spec.chips * num_slices
    sizes = parse_mesh(cfg.run.mesh, devices)
    data, length = sizes["data"] * sizes["fsdp"], cfg.train.row_length(config.max_len)
    problems = []
    if cfg.model.attention_backend == ("pallas" if on_gpu else "cudnn"):   # each kernel is for one platform
        problems.append(f"--attention-backend {cfg.model.attention_backend} does not run on {topology}: " + (
            "pallas is the TPU splash kernel; on a GPU use cudnn or xla" if on_gpu else
            "cudnn is NVIDIA's fused attention; on TPU use pallas (splash attention) or xla"))
    if sizes["data"] % num_slices:
        problems.append(f"--mesh data={sizes['data']} must be a multiple of --num-slices {num_slices}: "
                        f"the data axis spans the slices")
    if decode_batch is not None and decode_batch % data:
        problems.append(f"--decode-batch {decode_batch} does not divide by the mesh's data × fsdp axes "
                        f"({data}); use a multiple of {data}, e.g. --decode-batch "
                        f"{-(-decode_batch // data) * data}")
    if problems:
        raise ValueError("; ".join(problems) + ".")
    if note := check_batch_rows(cfg.train.batch_tokens, length, data * cfg.train.grad_accum_steps):
        print(note, file=sys.stderr)
    rows = rows_per_batch(cfg.train.batch_tokens, length, data * cfg.train.grad_accum_steps)
    shapes = {"train_step": dict(rows=rows, length=length, label_smoothing=cfg.train.label_smoothing,
                                 grad_accum_steps=cfg.train.grad_accum_steps)}
    if decode_batch is not None:
        shapes["beam_search"] = dict(batch=decode_batch, src_len=length, beam_size=cfg.decode.beam_size,
                                     max_decode_len=min(config.max_len, length + 50))
    out: dict[str, Any] = {"target": {
        "topology": spec.name, "slice": spec.topology, "num_slices": num_slices, "devices": devices,
        "chip": chip.name, "mesh": cfg.run.mesh or f"data={devices}", "model": config.to_dict(),
        "batch": {"rows": rows, "length": length}}}
    mesh = None
    for name, shape in shapes.items():
        path = _cache_path(cache_dir or DEFAULT_CACHE, target=out["target"], program=name, shape=shape)
        with contextlib.suppress(OSError, ValueError):   # none yet, or damaged: compiled
            if reuse and not save:
                out[name] = {**json.loads(_read_verified(path)), "cached": True}
                continue
        if mesh is None:
            mesh = target_mesh(target_devices(spec, num_slices), cfg.run.mesh, num_slices)
        out[name] = _compile(name, config, mesh, shape, chip, on_gpu, save)
        _write_atomically(path, json.dumps(out[name], sort_keys=True).encode())
    return out
