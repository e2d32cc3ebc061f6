"""Compile a run's programs for a TPU slice or GPU node from this machine: ``jaxformer-compile``.

``jaxformer-compile --topology v5e-16 --preset base --vocab-size 32000`` compiles the train
step (and beam search, unless --no-decode) for the target's compile-only devices (TPU: pip
install 'jaxformer[tpu]') and prints per device the memory, fit, FLOPs, collectives and a
roofline estimate of step time, tokens/s and MFU. Reports are cached (--cache-dir); --save
DIR writes the serialized executables.

Exit status: 0 every program fits; 1 one does not; 2 bad flags or no libtpu.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated, Any

import jax
import tyro
from annotated_types import Ge

from jaxformer.aot.programs import DEFAULT_CACHE, compile_all
from jaxformer.aot.report import format_report
from jaxformer.cli import fail, plain, unwritable
from jaxformer.run.config import DEFAULT_CPU_RUN, TrainConfig, check_fields

PROG = "jaxformer-compile"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileArgs:
    """A target, and the training flags (those that do not shape a program change nothing)."""

    topology: str   # TPU slice or GPU node to compile for, e.g. v5e-16, v4-8, h100-8 (jaxformer.aot.chips)
    num_slices: Annotated[int, Ge(1)] = 1   # slices (GPU: hosts) joined over DCN; the data axis spans them
    decode_batch: Annotated[int, Ge(1)] = 64   # sentences per beam-search batch
    no_decode: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False   # compile the train step only
    save: str | None = None   # write the serialized executables to this folder
    cache_dir: str = str(DEFAULT_CACHE)   # where compile reports are kept
    no_cache: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False   # compile even if a report is cached
    json: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False   # print the reports as one JSON object
    cfg: TrainConfig = TrainConfig.flat(**DEFAULT_CPU_RUN)


def _print(out: dict[str, Any]) -> None:
    t = out["target"]
    print(f"{t['topology']} ({t['slice']} × {t['num_slices']} slice(s), {t['devices']} × {t['chip']}), "
          f"mesh {t['mesh']}; d_model {t['model']['d_model']}, {t['model']['num_encoder_layers']}+"
          f"{t['model']['num_decoder_layers']} layers, {t['model']['dtype']}; train batch "
          f"{t['batch']['rows']} × {t['batch']['length']}")
    for name, result in ((k, r) for k, r in out.items() if k != "target"):
        how = "cached" if result.get("cached") else f"compiled in {result['compile_s']:.1f} s"
        print(f"{name} ({how}): {result['verdict']}" if "verdict" in result
              else format_report(f"{name} ({how})", result))


def main(argv: list[str] | None = None) -> None:
    """Parses the command line, compiles, prints; exits with the status documented above."""
    # This tool compiles for devices it does not have; the host's CPU stays JAX's platform
    # (and the CUDA plugin registers its compile-only devices without a driver).
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    args = tyro.cli(CompileArgs, args=argv, prog=PROG, description=plain(__doc__),
                    config=(tyro.conf.OmitArgPrefixes,))
    # JAX's persistent cache would store executables that a compile-only client cannot
    # load back (a warning on every later read); the reports are cached instead.
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        check_fields(args)
        for flag, folder in (("--cache-dir", args.cache_dir), ("--save", args.save)):
            if folder and (problem := unwritable(folder)):   # before minutes of compiling
                fail(PROG, f"{flag} {folder!r} {problem}")
        out = compile_all(args.cfg, args.topology, args.num_slices,
                          None if args.no_decode else args.decode_batch, args.save, args.cache_dir,
                          reuse=not args.no_cache)
    except (ValueError, RuntimeError) as e:   # a mesh that does not fit, no libtpu
        fail(PROG, str(e))
    print(json.dumps(out, indent=2, sort_keys=True, default=float)) if args.json else _print(out)
    sys.exit(0 if all(r.get("fits", True) for k, r in out.items() if k != "target") else 1)


if __name__ == "__main__":
    main()
