"""Prepare once: stream a corpus into token ids on disk (``jaxformer-prepare``; how:
:mod:`jaxformer.data.prepare`)."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from typing import Annotated

import tyro

from jaxformer.cli import fail, plain
from jaxformer.data.distillation import write_training_sources
from jaxformer.data.prepare import FirstPass
from jaxformer.data.run_data import corpus_shape, prepare_run_data
from jaxformer.run import recipe as recipe_lib
from jaxformer.run.config import DataConfig, DecodeConfig, RunConfig, TrainConfig, shown
from jaxformer.run.directory import RunDir, topmost_missing
from jaxformer.run.logs import console_logging, log
from jaxformer.run.platform import skip_absent_tpu
from jaxformer.run.train_flags import given_names

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
        tokenizer, first = None, None
        has_checkpoints = run_dir.checkpoints.exists() and any(run_dir.checkpoints.iterdir())
        if args.init_from:   # its tokenizer copied in (set to the languages), as train.py does
            from jaxformer.interop.pretrained import fine_tune_tokenizer, read_run

            tokenizer = fine_tune_tokenizer(args.init_from, read_run(args.init_from), run_dir, args.src_lang,
                                            args.tgt_lang)[0]
        else:
            given = given_names(sys.argv[1:] if argv is None else argv)
            cfg, first = _vocabulary(cfg, run_dir, given, has_checkpoints)
        prepare_run_data(cfg, run_dir, has_checkpoints=has_checkpoints, tokenizer=tokenizer, first=first)
    except (ValueError, OSError) as e:
        if created is not None:   # what this call made holds nothing worth keeping
            shutil.rmtree(created, ignore_errors=True)
        fail(PROG, str(e))


def _vocabulary(cfg: TrainConfig, run_dir: RunDir, given: set[str], has_checkpoints: bool
                ) -> tuple[TrainConfig, FirstPass | None]:
    """``cfg`` with train.py's vocabulary size for its data, and the corpus's first pass if read
    for it: a run with checkpoints keeps its record's (as its resume does); else, under
    ``--recipe auto``, the rule's (:func:`jaxformer.run.recipe.recipe_for`), unless ``given``."""
    record = (run_dir.read_config() or {}).get("train", {}) if has_checkpoints else {}
    if record:
        kept = recipe_lib.resumed(record, given)
        return cfg.replace(**{k: v for k, v in kept.items() if k in ("vocab_size", "recipe")}), None
    if cfg.data.recipe != "auto":
        return cfg, None
    shape, first = corpus_shape(cfg, run_dir.prepared)
    recipe = recipe_lib.recipe_for(shape)
    cfg = cfg.replace(**{k: v for k, v in recipe_lib.choose(recipe, given, cfg.settings()).items()
                         if k == "vocab_size"})
    log(recipe_lib.describe(shape, recipe, {"vocab_size": cfg.data.vocab_size}, given))
    return cfg, first


if __name__ == "__main__":
    main()
