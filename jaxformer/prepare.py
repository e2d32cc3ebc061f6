"""``python -m jaxformer.prepare``: the ``jaxformer-prepare`` command
(:mod:`jaxformer.cli.prepare`); how data is prepared: :mod:`jaxformer.data.prepare`."""

from jaxformer.cli.prepare import main

if __name__ == "__main__":
    main()
