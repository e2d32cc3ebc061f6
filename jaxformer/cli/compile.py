"""Compile a run's programs for a TPU slice from this machine: ``jaxformer-compile``.

``jaxformer-compile --topology v5e-16 --preset base --vocab-size 32000 --batch-tokens
32768 --max-train-len 128 --dtype bfloat16`` compiles the real train step (and beam
search, unless --no-decode) for the slice's compile-only devices (libtpu:
pip install 'jaxformer[tpu]'; no TPU needed) and prints, per device: argument, output,
alias, temp, code and peak bytes, whether that fits the chip's HBM, FLOPs, the
collectives in the compiled program, and a roofline estimate of step time, tokens/s
and the MFU ceiling. A program that does not fit is reported as such, with remedies.
Reports are cached (--cache-dir), so a second call with the same inputs compiles
nothing; --save DIR writes the serialized executables.

Exit status: 0 every program fits; 1 one does not; 2 bad flags or no libtpu.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import tyro
from annotated_types import Ge

from jaxformer.aot import report as report_lib
from jaxformer.aot.cache import ReportCache, default_directory
from jaxformer.aot.chips import CHIPS, slice_spec
from jaxformer.cli import fail
from jaxformer.run.config import DEFAULT_CPU_RUN, TrainConfig, check_fields

PROG = "jaxformer-compile"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileArgs:
    """The command line of ``jaxformer-compile``: a target, and the training flags; those
    that shape the programs (model, --vocab-size, --batch-tokens, --max-train-len, --mesh,
    --grad-accum-steps, --beam-size) count, the others are accepted and change nothing."""

    topology: str   # TPU slice or GPU node to compile for, e.g. v5e-16, v4-8, h100-8 (jaxformer.aot.chips)
    num_slices: Annotated[int, Ge(1)] = 1   # slices (GPU: hosts) joined over DCN; the data axis spans them
    decode_batch: Annotated[int, Ge(1)] = 64   # sentences per beam-search batch
    no_decode: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False   # compile the train step only
    save: str | None = None   # write the serialized executables to this folder
    cache_dir: str = str(default_directory())   # where compile reports are kept
    no_cache: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False   # compile even if a report is cached
    json: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False   # print the reports as one JSON object
    cfg: TrainConfig = TrainConfig.flat(**DEFAULT_CPU_RUN)


def _compile(name: str, lower, chip, tokens: int, save: str | None, devices: int,
             host_cost=None, loop_scale=None) -> dict[str, Any]:
    """Lowers and compiles one program; its report, or the does-not-fit verdict of an
    out-of-memory compile. ``host_cost``: the program's FLOPs on one host device, for a
    target whose compiler reports none (XLA:GPU). ``loop_scale``: by how much the
    compiled program's cost analysis undercounts (scanned layers; see :func:`compile_all`).
    ``compile_s`` is the lowering and compile alone."""
    start = time.perf_counter()
    lowered = lower()
    try:
        compiled = lowered.compile()
    except Exception as e:   # XLA:TPU reports an out-of-memory program at compile time
        needed = report_lib.out_of_memory(e)
        if needed is None:
            raise
        return {"fits": False, "needed": needed[0], "hbm": needed[1],
                "compile_s": time.perf_counter() - start, "verdict": report_lib.does_not_fit(*needed)}
    compile_s = time.perf_counter() - start
    result = report_lib.analyse(compiled, chip, tokens, host_cost() if host_cost else None, devices,
                                cost_scale=loop_scale() if loop_scale else None)
    result["compile_s"] = compile_s
    if save:
        from jax.experimental.serialize_executable import serialize

        Path(save).mkdir(parents=True, exist_ok=True)
        (Path(save) / f"{name}.xla").write_bytes(serialize(compiled)[0])
    return result


def _host_cost(lower, config, shape, scanned: bool) -> dict[str, float]:
    """Cost analysis of the program lowered (not compiled) for one host CPU device, with
    scanned or unrolled layers: seconds, whatever the target."""
    import jax

    from jaxformer.model.sharding import make_mesh

    host = make_mesh(None, jax.devices("cpu")[:1])
    return lower(config.replace(scan_layers=scanned), host, shape).cost_analysis()


def compile_all(args: CompileArgs, cfg: TrainConfig) -> dict[str, Any]:
    """Every program's report, from the cache where it holds one."""

    from jaxformer.aot.steps import DecodeShape, TrainShape, lower_beam_search, lower_train_step
    from jaxformer.aot.target import target_devices, target_mesh
    from jaxformer.data.batching import check_batch_rows, rows_per_batch
    from jaxformer.model.config import preset
    from jaxformer.model.sharding import parse_mesh

    spec = slice_spec(args.topology)
    chip = CHIPS[spec.chip]
    on_gpu = spec.chip_config_name == "gpu"
    if cfg.model.attention_backend == ("pallas" if on_gpu else "cudnn"):   # each kernel is for one platform
        raise ValueError(f"--attention-backend {cfg.model.attention_backend} does not run on "
                         f"{args.topology}: "
                         + ("cudnn is NVIDIA's fused attention; on TPU use pallas (splash attention) or xla"
                            if not on_gpu else "pallas is the TPU splash kernel; on a GPU use cudnn or xla"))
    config = preset(cfg.model.preset, src_vocab_size=cfg.data.vocab_size, **cfg.model.overrides())
    devices_count = spec.chips * args.num_slices
    sizes = parse_mesh(cfg.run.mesh, devices_count)
    data = sizes["data"] * sizes["fsdp"]
    length = cfg.train.row_length(config.max_len)
    # As training sizes its batches: too few rows is an error, rounded rows are reported;
    # a decoding batch that the data axes do not divide is named before any compile.
    note = check_batch_rows(cfg.train.batch_tokens, length, data * cfg.train.grad_accum_steps)
    if note:
        print(note, file=sys.stderr)
    if not args.no_decode and args.decode_batch % data:
        raise ValueError(f"--decode-batch {args.decode_batch} does not divide by the mesh's data × fsdp "
                         f"axes ({data}); use a multiple of {data}, e.g. --decode-batch "
                         f"{-(-args.decode_batch // data) * data}.")
    rows = rows_per_batch(cfg.train.batch_tokens, length, data * cfg.train.grad_accum_steps)
    shapes = {"train_step": TrainShape(rows=rows, length=length, label_smoothing=cfg.train.label_smoothing,
                                       grad_accum_steps=cfg.train.grad_accum_steps)}
    if not args.no_decode:
        shapes["beam_search"] = DecodeShape(batch=args.decode_batch, src_len=length,
                                            beam_size=cfg.decode.beam_size,
                                            max_decode_len=min(config.max_len, length + 50))
    cache = ReportCache(args.cache_dir)
    header = {"topology": spec.name, "slice": spec.topology, "num_slices": args.num_slices,
              "devices": devices_count, "chip": chip.name, "mesh": cfg.run.mesh or f"data={devices_count}",
              "model": config.to_dict(), "batch": {"rows": rows, "length": length}}
    out: dict[str, Any] = {"target": header}
    mesh = None
    for name, shape in shapes.items():
        key = cache.key(target=header, program=name, shape=repr(shape))
        cached = None if (args.no_cache or args.save) else cache.get(key)
        if cached is not None:
            out[name] = {**cached, "cached": True}
            continue
        if mesh is None:
            mesh = target_mesh(target_devices(spec, args.num_slices), cfg.run.mesh, args.num_slices)
        lower = {"train_step": lower_train_step, "beam_search": lower_beam_search}[name]
        # beam search: XLA counts its while body (one token per sentence) once
        tokens = rows * length if name == "train_step" else shape.batch
        # XLA:GPU has no cost analysis: the same program (unrolled) lowered for one host
        # device counts its FLOPs. XLA counts the loop body of scanned layers once: the
        # compiled program's cost is scaled by unrolled / scanned, both lowered for the host.
        host = functools.partial(_host_cost, lower, config, shape)
        host_cost = (lambda host=host: host(scanned=False)) if spec.chip_config_name == "gpu" else None
        loop_scale = None
        if host_cost is None and name == "train_step" and config.scan_layers:
            def loop_scale(host=host):
                unrolled, scanned = host(scanned=False), host(scanned=True)
                return {k: unrolled.get(k, 0.0) / scanned[k] if scanned.get(k) else 1.0
                        for k in ("flops", "bytes accessed")}
        out[name] = _compile(name, functools.partial(lower, config, mesh, shape), chip, tokens, args.save,
                             mesh.size, host_cost, loop_scale)
        cache.put(key, out[name])
    return out


def _print(out: dict[str, Any]) -> None:
    t = out["target"]
    print(f"{t['topology']} ({t['slice']} × {t['num_slices']} slice(s), {t['devices']} × {t['chip']}), "
          f"mesh "
          f"{t['mesh']}; d_model {t['model']['d_model']}, {t['model']['num_encoder_layers']}+"
          f"{t['model']['num_decoder_layers']} layers, {t['model']['dtype']}; train batch "
          f"{t['batch']['rows']} × {t['batch']['length']}")
    for name, result in out.items():
        if name == "target":
            continue
        how = "cached" if result.get("cached") else f"compiled in {result['compile_s']:.1f} s"
        if "verdict" in result:
            print(f"{name} ({how}): {result['verdict']}")
        else:
            print(report_lib.format_report(f"{name} ({how})", result))


def _check_folders(args: CompileArgs) -> None:
    """``--cache-dir`` and ``--save`` checked before anything compiles: a name that is a
    file, or a folder no file can be made in (the nearest existing one, for a folder still
    to be made; probed with a uniquely named file), fails now, not after minutes. Nothing
    is created here."""
    from jaxformer.run.directory import probe_writable

    for flag, folder in (("--cache-dir", args.cache_dir), ("--save", args.save)):
        if folder is None:
            continue
        path = Path(folder).absolute()
        if path.exists() and not path.is_dir():
            fail(PROG, f"{flag} {folder!r} is a file; name a folder")
        existing = next(p for p in (path, *path.parents) if p.exists())
        try:
            probe_writable(existing)
        except OSError as e:
            fail(PROG, f"{flag} {folder!r} cannot be written ({existing}: {e.strerror}); name a folder "
                       f"you can write to")


def main(argv: list[str] | None = None) -> None:
    """Parses the command line, compiles, prints; exits with the status documented above."""
    import jax

    # This tool compiles for devices it does not have; the host's CPU stays JAX's platform
    # (and the CUDA plugin registers its compile-only devices without a driver).
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    args = tyro.cli(CompileArgs, args=argv, prog=PROG, description=__doc__,
                    config=(tyro.conf.OmitArgPrefixes,))
    cfg = args.cfg
    try:
        slice_spec(args.topology)
        check_fields(args)
    except ValueError as e:
        fail(PROG, str(e).rstrip("."))
    _check_folders(args)
    # JAX's persistent cache would store executables that a compile-only client cannot
    # load back (a warning on every later read); the reports are cached instead.
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        out = compile_all(args, cfg)
    except (ValueError, RuntimeError) as e:   # a mesh that does not fit, no libtpu
        fail(PROG, str(e))
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True, default=float))
    else:
        _print(out)
    sys.exit(0 if all(r.get("fits", True) for k, r in out.items() if k != "target") else 1)


if __name__ == "__main__":
    main()
