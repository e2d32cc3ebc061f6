"""Train an English→German Transformer on the shipped corpus: ``python train.py``.

A thin wrapper kept so a checkout's command keeps working; the entry point is
:func:`jaxformer.cli.train.main`, installed as the ``jaxformer-train`` command.
"""

from jaxformer.cli.train import main

if __name__ == "__main__":
    main(prog="train.py")
