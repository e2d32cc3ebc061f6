"""``python -m jaxformer.translate``: the ``jaxformer-translate`` command
(:mod:`jaxformer.cli.translate`); the translator itself: :mod:`jaxformer.decode.translator`."""

from jaxformer.cli.translate import cli

if __name__ == "__main__":
    cli()
