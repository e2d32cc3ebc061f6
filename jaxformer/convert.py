"""``python -m jaxformer.convert``: the ``jaxformer-convert`` command
(:mod:`jaxformer.cli.convert`); the OPUS-MT/Marian conversion itself:
:mod:`jaxformer.interop.marian`."""

from jaxformer.cli.convert import main

if __name__ == "__main__":
    main()
