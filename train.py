"""Train an English→German Transformer on the shipped corpus (``python train.py``).

Intentionally short: the logic lives in :mod:`jaxformer.trainer`. ``--help`` lists
every flag; the defaults are a CPU run of a few minutes.
"""

from jaxformer.run_config import DEFAULT_CPU_RUN, build_parser, from_args
from jaxformer.trainer import train


def main(argv=None):
    parser = build_parser(DEFAULT_CPU_RUN, description=__doc__)
    args = parser.parse_args(argv)
    try:
        train(from_args(args), fresh=args.fresh)
    except (ValueError, OSError) as e:   # bad data, paths or checkpoints: a message, not a traceback
        parser.exit(2, f"train.py: error: {e}\n")


if __name__ == "__main__":
    main()
