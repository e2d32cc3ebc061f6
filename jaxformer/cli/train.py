"""The ``jaxformer-train`` command (``train.py`` in a checkout calls the same :func:`main`);
its exit statuses are in :data:`DESCRIPTION`, its ``--help``."""

from __future__ import annotations

import sys

DESCRIPTION = """\
Train an encoder-decoder Transformer translator (Vaswani et al. 2017).

Without corpus flags it trains English to German on the shipped corpus, a CPU run of
1000 steps (--max-minutes caps the time). The run directory (--workdir) keeps
checkpoints, config.json, train.log, metrics, plots and results.json; the same command
again resumes the run. --config FILE reads settings from JSON or YAML (a run's
config.json replays that run); flags given here override it.

Exit status: 0 done, 2 bad input, 1 training diverged, 128 + signal number when
stopped by a signal (or Ctrl-C while starting or evaluating: 130) after checkpointing
(run again to resume)."""


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Parses the command line, trains, and exits with the status documented above."""
    from jaxformer.cli import fail
    from jaxformer.run.config import DEFAULT_CPU_RUN
    from jaxformer.run.logs import console_logging
    from jaxformer.run.platform import skip_absent_tpu
    from jaxformer.run.train_flags import parse_train_args

    prog = prog or "jaxformer-train"
    args = parse_train_args(argv, DEFAULT_CPU_RUN, DESCRIPTION, prog=prog)
    cfg = args.cfg
    from jaxformer.run.directory import RunDir, keep_compilation_cache
    from jaxformer.train.trainer import Preempted, TrainingDiverged, train

    console_logging()
    skip_absent_tpu()   # libtpu installed on a CPU host: never start the TPU backend
    keep_compilation_cache(RunDir(cfg.workdir))   # a resume compiles nothing it compiled before
    try:
        train(cfg, fresh=args.fresh, chosen=args.chosen)
    except (ValueError, OSError) as e:   # bad data, paths or checkpoints: a message, not a traceback
        fail(prog, str(e))
    except TrainingDiverged as e:
        fail(prog, str(e), status=1)
    except Preempted as e:               # the message with the resume hint is already printed
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:            # Ctrl-C outside the steps (the steps stop as Preempted)
        fail(prog, "interrupted; run the same command again to continue from the run's last checkpoint "
                   "(or to start it, if it has none yet).", status=130)


if __name__ == "__main__":
    main()
