"""OPUS-MT/Marian models in, jaxformer models out: ``jaxformer-convert``.

``--from-hf DIR --workdir RUN`` reads a local Hugging Face Marian folder into a run
directory (for ``jaxformer-translate`` and ``train.py --init-from``); ``--to-hf RUN --out
DIR`` writes a post-norm run as a ``MarianMTModel`` folder. Neither needs torch; the
mapping: :mod:`jaxformer.interop.marian`.
"""

from __future__ import annotations

import argparse

from jaxformer.interop.marian import export_marian, import_marian
from jaxformer.run.platform import skip_absent_tpu


def main(argv=None) -> None:
    description = __doc__.replace("``", "").replace(":mod:", "").replace("`", "")
    parser = argparse.ArgumentParser(prog="jaxformer-convert", allow_abbrev=False, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR", help="local Hugging Face Marian model folder")
    direction.add_argument("--to-hf", metavar="RUN", help="jaxformer run directory to export")
    parser.add_argument("--workdir", help="run directory to write (with --from-hf)")
    parser.add_argument("--out", help="Hugging Face model folder to write (with --to-hf)")
    args = parser.parse_args(argv)
    skip_absent_tpu()   # libtpu installed on a CPU host: never start the TPU backend
    if args.from_hf and not args.workdir:
        parser.error("--from-hf needs --workdir RUN")
    if args.to_hf and not args.out:
        parser.error("--to-hf needs --out DIR")
    try:
        if args.from_hf:
            config = import_marian(args.from_hf, args.workdir)
            print(f"wrote {args.workdir}: {config.num_encoder_layers}+{config.num_decoder_layers} layers, "
                  f"d_model {config.d_model}, vocab {config.src_vocab_size}/{config.tgt_vocab_size}")
        else:
            export_marian(args.to_hf, args.out)
            print(f"wrote {args.out}")
    except (ValueError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
