"""Prepare once: stream a corpus into token ids on disk (``jaxformer-prepare``; how:
:mod:`jaxformer.data.prepare`)."""

from __future__ import annotations

import dataclasses
import shutil
from typing import Annotated

import tyro

from jaxformer.cli import fail, plain
from jaxformer.data.distillation import write_training_sources
from jaxformer.data.run_data import prepare_run_data
from jaxformer.run.config import DataConfig, DecodeConfig, RunConfig, TrainConfig, shown
from jaxformer.run.directory import RunDir, topmost_missing
from jaxformer.run.logs import console_logging
from jaxformer.run.platform import skip_absent_tpu

PROG = "jaxformer-prepare"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareArgs:
    """Give train.py the same data flags (and --workdir) to train on the prepared data."""

    data: DataConfig = DataConfig()
    workdir: Annotated[str | None, shown("derived from the data, as train.py")] = None   # run directory
    # prepare a fine-tune's data (train.py --init-from RUN): encoded with RUN's tokenizer
    init_from: str | None = None
    # an --init-from multilingual model's (M2M100, NLLB) language codes: each pair gets their tokens
    src_lang: str | None = None
    tgt_lang: str | None = None
    # instead of preparing: write the sources of --workdir's training split, one per line
    # (a teacher's input for distillation; docs, "Distillation")
    write_train_sources: str | None = None


def main(argv: list[str] | None = None) -> None:
    """``jaxformer-prepare``: prepares a run directory's data ahead of ``train.py``."""
    args = tyro.cli(PrepareArgs, args=argv, prog=PROG, description=plain(__doc__.split("\n\n")[0]),
                    config=(tyro.conf.OmitArgPrefixes,))
    skip_absent_tpu()   # libtpu installed on a CPU host: never start the TPU backend
    console_logging()   # the data report (read, kept, skipped by reason) and the timings, as train.py
    if args.write_train_sources:
        if not args.workdir:
            fail(PROG, "--write-train-sources needs the --workdir of a prepared run")
        given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(DataConfig)
                 if getattr(args.data, f.name) != f.default]
        if given:   # the run's own data and settings are what it writes
            fail(PROG, f"--write-train-sources writes the training sources of --workdir's run, from its "
                       f"own data flags: drop {', '.join(given)}")
        try:
            lines = write_training_sources(args.workdir, args.write_train_sources)
        except (ValueError, OSError) as e:
            fail(PROG, str(e))
        print(f"wrote {lines} training sources of {args.workdir} to {args.write_train_sources}")
        return
    if (args.src_lang or args.tgt_lang) and not args.init_from:
        fail(PROG, "--src-lang/--tgt-lang choose the languages of a multilingual model to fine-tune: give "
                   "its run as --init-from RUN")
    created = None   # the topmost folder this call makes: removed again if preparing fails
    try:
        cfg = TrainConfig(data=args.data, run=RunConfig(workdir=args.workdir, init_from=args.init_from),
                          decode=DecodeConfig(src_lang=args.src_lang, tgt_lang=args.tgt_lang))
        run_dir = RunDir(cfg.workdir)
        created = topmost_missing(run_dir.root)
        run_dir.create()   # a --workdir that is a file or cannot be written is named
        tokenizer = None
        if args.init_from:   # its tokenizer copied in (set to the languages), as train.py does
            from jaxformer.interop.pretrained import fine_tune_tokenizer, read_run

            tokenizer = fine_tune_tokenizer(args.init_from, read_run(args.init_from), run_dir, args.src_lang,
                                            args.tgt_lang)[0]
        prepare_run_data(cfg, run_dir, has_checkpoints=run_dir.checkpoints.exists()
                         and any(run_dir.checkpoints.iterdir()), tokenizer=tokenizer)
    except (ValueError, OSError) as e:
        if created is not None:   # what this call made holds nothing worth keeping
            shutil.rmtree(created, ignore_errors=True)
        fail(PROG, str(e))


if __name__ == "__main__":
    main()
