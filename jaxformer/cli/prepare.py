"""Prepare once: stream a corpus into token ids on disk (``jaxformer-prepare``).

``python -m jaxformer.prepare`` is the same command. How the data is prepared:
:mod:`jaxformer.data.prepare`.
"""

from __future__ import annotations

import argparse
import shutil

from jaxformer.data.distillation import write_training_sources
from jaxformer.data.run_data import prepare_run_data
from jaxformer.run.config import PAIRS, TrainConfig
from jaxformer.run.directory import RunDir, topmost_missing
from jaxformer.run.logs import console_logging
from jaxformer.run.platform import skip_absent_tpu


def main(argv: list[str] | None = None) -> None:
    """``jaxformer-prepare``: prepares a run directory's data ahead of ``train.py``."""
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(
        prog="jaxformer-prepare", description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Give train.py the same data flags (and --workdir) to train on the prepared data.")
    for name, help_text in (("workdir", "run directory (default: derived from the data, as train.py)"),
                            ("pair", f"shipped corpus (default {defaults.pair})"),
                            ("train-file", "source<TAB>target lines, plain or .gz"),
                            ("src-file", "or line-aligned source file"), ("tgt-file", "and target file"),
                            ("dev-file", "explicit dev TSV"), ("test-file", "explicit test TSV"),
                            ("bt-file", "back-translated pairs (TSV), added to training with tagged "
                                        "sources")):
        parser.add_argument(f"--{name}", help=help_text, **({"choices": PAIRS} if name == "pair" else {}))
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--max-length-ratio", type=float, default=defaults.max_length_ratio,
                        help="drop pairs whose source/target id counts differ by more (Moses clean-corpus-n)")
    parser.add_argument("--bt-ratio", type=float,
                        help="synthetic pairs per real training pair (default: each --bt-file pair once)")
    parser.add_argument("--write-train-sources", metavar="FILE",
                        help="instead of preparing: write the sources of --workdir's training split, one "
                             "per line (a teacher's input for distillation; README, 'Distillation')")
    args = parser.parse_args(argv)
    skip_absent_tpu()   # libtpu installed on a CPU host: never start the TPU backend
    console_logging()   # the data report (read, kept, skipped by reason) and the timings, as train.py
    if args.write_train_sources:
        if not args.workdir:
            parser.error("--write-train-sources needs the --workdir of a prepared run")
        given = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
                 if name not in ("workdir", "write_train_sources") and value != parser.get_default(name)]
        if given:   # the run's own data and settings are what it writes
            parser.error(f"--write-train-sources writes the training sources of --workdir's run, from its "
                         f"own data flags: drop {', '.join(given)}")
        try:
            lines = write_training_sources(args.workdir, args.write_train_sources)
        except (ValueError, OSError) as e:
            parser.exit(2, f"jaxformer-prepare: error: {e}\n")
        print(f"wrote {lines} training sources of {args.workdir} to {args.write_train_sources}")
        return
    del args.write_train_sources
    fields = {k: v for k, v in vars(args).items() if v is not None}
    created = None
    try:
        cfg = TrainConfig.flat(**fields)
        run_dir = RunDir(cfg.workdir)
        # the topmost folder this call makes: removed again if preparing fails
        created = topmost_missing(run_dir.root)
        run_dir.create()   # a --workdir that is a file or cannot be written is named
        has_checkpoints = run_dir.checkpoints.exists() and any(run_dir.checkpoints.iterdir())
        prepare_run_data(cfg, run_dir, has_checkpoints=has_checkpoints)
    except (ValueError, OSError) as e:
        if created is not None:   # what this call made holds nothing worth keeping
            shutil.rmtree(created, ignore_errors=True)
        parser.exit(2, f"jaxformer-prepare: error: {e}\n")


if __name__ == "__main__":
    main()
