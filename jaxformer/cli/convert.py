"""OPUS-MT/Marian, M2M100 and NLLB-200 models in, jaxformer models out: ``jaxformer-convert``.

``--from-hf DIR --workdir RUN`` reads a local Hugging Face Marian or M2M100/NLLB folder (by
its model_type) into a run directory (for ``jaxformer-translate`` and ``train.py
--init-from``); ``--to-hf RUN --out DIR`` writes a run back as the model it came from (an
M2M100/NLLB run as ``M2M100ForConditionalGeneration``, any other post-norm run as a
``MarianMTModel``); ``--to-ct2 RUN --out DIR
[--quantization Q]`` writes any run as a CTranslate2 model directory; ``--to-argos RUN --out
FILE.argosmodel [--from-code en --to-code de]`` as an Argos Translate package (argostranslate,
LibreTranslate). None needs torch; the mappings: :mod:`jaxformer.interop.marian`,
:mod:`jaxformer.interop.m2m100`, :mod:`jaxformer.interop.ct2`, :mod:`jaxformer.interop.argos`.
"""

from __future__ import annotations

import argparse

from jaxformer.decode.served_run import ServedRun
from jaxformer.interop.ct2 import export_ct2
from jaxformer.interop.hf import export_hf, import_hf
from jaxformer.run.platform import skip_absent_tpu

# The options each direction takes (any other given is refused by name), the first one required.
OPTIONS = {"from_hf": ("workdir",), "to_hf": ("out",), "to_ct2": ("out", "quantization", "checkpoint"),
           "to_argos": ("out", "quantization", "checkpoint", "from_code", "to_code")}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def main(argv=None) -> None:
    description = __doc__.replace("``", "").replace(":mod:", "").replace("`", "")
    parser = argparse.ArgumentParser(prog="jaxformer-convert", allow_abbrev=False, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR",
                           help="local Hugging Face Marian, M2M100 or NLLB model folder")
    direction.add_argument("--to-hf", metavar="RUN", help="jaxformer run directory to export")
    direction.add_argument("--to-ct2", metavar="RUN", help="jaxformer run directory to export to CTranslate2")
    direction.add_argument("--to-argos", metavar="RUN",
                           help="jaxformer run directory to export as an Argos Translate package")
    parser.add_argument("--workdir", help="run directory to write (with --from-hf)")
    parser.add_argument("--out", help="model folder to write (with --to-hf, --to-ct2), or package file "
                        "FILE.argosmodel (with --to-argos)")
    parser.add_argument("--quantization", help="CTranslate2 weight type (with --to-ct2, --to-argos): float32 "
                        "(default), int8, int8_float32, int16, float16, int8_float16")
    parser.add_argument("--checkpoint", help="which checkpoint (with --to-ct2, --to-argos): auto (default), "
                        "best, latest or a step")
    parser.add_argument("--from-code", help="source language code, e.g. en (with --to-argos; default: the "
                        "run's)")
    parser.add_argument("--to-code", help="target language code, e.g. de (with --to-argos; default: the "
                        "run's)")
    args = parser.parse_args(argv)
    chosen = next(name for name in OPTIONS if getattr(args, name))
    needed = OPTIONS[chosen][0]
    if not getattr(args, needed):
        what = "FILE.argosmodel" if chosen == "to_argos" else "RUN" if needed == "workdir" else "DIR"
        parser.error(f"{_flag(chosen)} needs {_flag(needed)} {what}")
    stray = [_flag(n) for n in ("workdir", "out", "quantization", "checkpoint", "from_code", "to_code")
             if getattr(args, n) and n not in OPTIONS[chosen]]
    if stray:
        parser.error(f"{', '.join(stray)} cannot go with {_flag(chosen)}")
    skip_absent_tpu()   # libtpu installed on a CPU host: never start the TPU backend
    try:
        _convert(args)
    except (ValueError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


def _convert(args: argparse.Namespace) -> None:
    """Runs the direction chosen and prints what it wrote."""
    quantization, checkpoint = args.quantization or "float32", args.checkpoint or "auto"
    if args.from_hf:
        config = import_hf(args.from_hf, args.workdir)
        print(f"wrote {args.workdir}: {config.num_encoder_layers}+{config.num_decoder_layers} layers, "
              f"d_model {config.d_model}, vocab {config.src_vocab_size}/{config.tgt_vocab_size}")
    elif args.to_argos:   # the run is loaded after what a package cannot hold is refused
        from jaxformer.interop.argos import export_argos

        export_argos(args.to_argos, args.out, quantization=quantization, checkpoint=checkpoint,
                     from_code=args.from_code, to_code=args.to_code)
        print(f"wrote {args.out} ({quantization}): argostranslate.package.install_from_path({args.out!r}) "
              f"installs it; translate offline with ARGOS_CHUNK_TYPE=SPACY (its README.md)")
    elif args.to_ct2:
        export_ct2(ServedRun.load(args.to_ct2, checkpoint=checkpoint), args.out, quantization=quantization)
        print(f"wrote {args.out} ({quantization}): ctranslate2.Translator({args.out!r}) serves it; its "
              f"README.md shows how")
    else:
        export_hf(ServedRun.load(args.to_hf, checkpoint=checkpoint), args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
