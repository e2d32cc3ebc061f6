"""Train an English→German Transformer on the shipped corpus (``python train.py``).

Intentionally short: the logic lives in :mod:`jaxformer.trainer`. ``--help`` lists
every flag; the defaults are a CPU run of a few minutes.

Exit status: 0 done; 2 bad input (data, paths, flags, unreadable checkpoints);
1 training diverged (non-finite updates); 128 + signal number after SIGTERM (143)
or SIGINT (130), once the current step is checkpointed — run again to resume.
"""

from jaxformer.run_config import DEFAULT_CPU_RUN, build_parser, from_args
from jaxformer.trainer import Preempted, TrainingDiverged, train


def main(argv=None):
    parser = build_parser(DEFAULT_CPU_RUN, description=__doc__)
    args = parser.parse_args(argv)
    try:
        train(from_args(args), fresh=args.fresh)
    except (ValueError, OSError) as e:   # bad data, paths or checkpoints: a message, not a traceback
        parser.exit(2, f"train.py: error: {e}\n")
    except TrainingDiverged as e:
        parser.exit(1, f"train.py: error: {e}\n")
    except Preempted as e:               # the message with the resume hint is already printed
        parser.exit(128 + e.signum)


if __name__ == "__main__":
    main()
