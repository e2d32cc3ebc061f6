"""``python -m jaxformer.compile``: the ``jaxformer-compile`` command
(:mod:`jaxformer.cli.compile`); what it compiles and reports: :mod:`jaxformer.aot`."""

from jaxformer.cli.compile import main

if __name__ == "__main__":
    main()
