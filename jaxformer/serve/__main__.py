"""``python -m jaxformer.serve``: the ``jaxformer-serve`` command (:mod:`jaxformer.cli.serve`)."""

from jaxformer.cli.serve import main

if __name__ == "__main__":
    main()
