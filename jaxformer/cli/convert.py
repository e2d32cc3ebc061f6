"""OPUS-MT/Marian, M2M100 and NLLB-200 models in, jaxformer models out: ``jaxformer-convert``.

``--from-hf DIR --workdir RUN`` reads a local Hugging Face Marian or M2M100/NLLB folder (by
its model_type) into a run directory (for ``jaxformer-translate`` and ``train.py
--init-from``); ``--to-hf RUN --out DIR`` writes a run back as the model it came from (an
M2M100/NLLB run as ``M2M100ForConditionalGeneration``, any other post-norm run as a
``MarianMTModel``); ``--to-ct2 RUN --out DIR
[--quantization Q]`` writes any run as a CTranslate2 model directory. None needs torch;
the mappings: :mod:`jaxformer.interop.marian`, :mod:`jaxformer.interop.m2m100`,
:mod:`jaxformer.interop.ct2`.
"""

from __future__ import annotations

import argparse

from jaxformer.decode.served_run import ServedRun
from jaxformer.interop.ct2 import export_ct2
from jaxformer.interop.hf import export_hf, import_hf
from jaxformer.run.platform import skip_absent_tpu


def main(argv=None) -> None:
    description = __doc__.replace("``", "").replace(":mod:", "").replace("`", "")
    parser = argparse.ArgumentParser(prog="jaxformer-convert", allow_abbrev=False, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR",
                           help="local Hugging Face Marian, M2M100 or NLLB model folder")
    direction.add_argument("--to-hf", metavar="RUN", help="jaxformer run directory to export")
    direction.add_argument("--to-ct2", metavar="RUN", help="jaxformer run directory to export to CTranslate2")
    parser.add_argument("--workdir", help="run directory to write (with --from-hf)")
    parser.add_argument("--out", help="model folder to write (with --to-hf, --to-ct2)")
    parser.add_argument("--quantization", help="CTranslate2 weight type (with --to-ct2): float32 "
                        "(default), int8, int8_float32, int16, float16, int8_float16")
    parser.add_argument("--checkpoint", help="which checkpoint (with --to-ct2): auto (default), best, "
                        "latest or a step")
    args = parser.parse_args(argv)
    skip_absent_tpu()   # libtpu installed on a CPU host: never start the TPU backend
    if args.from_hf and not args.workdir:
        parser.error("--from-hf needs --workdir RUN")
    if (args.to_hf or args.to_ct2) and not args.out:
        parser.error(f"{'--to-hf' if args.to_hf else '--to-ct2'} needs --out DIR")
    if not args.to_ct2 and (args.quantization or args.checkpoint):
        parser.error("--quantization and --checkpoint go with --to-ct2")
    try:
        if args.from_hf:
            config = import_hf(args.from_hf, args.workdir)
            print(f"wrote {args.workdir}: {config.num_encoder_layers}+{config.num_decoder_layers} layers, "
                  f"d_model {config.d_model}, vocab {config.src_vocab_size}/{config.tgt_vocab_size}")
            return
        run = ServedRun.load(args.to_ct2 or args.to_hf, checkpoint=args.checkpoint or "auto")   # read once
        if args.to_ct2:
            quantization = args.quantization or "float32"
            export_ct2(run, args.out, quantization=quantization)
            print(f"wrote {args.out} ({quantization}): ctranslate2.Translator({args.out!r}) serves it; its "
                  f"README.md shows how")
        else:
            export_hf(run, args.out)
            print(f"wrote {args.out}")
    except (ValueError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
