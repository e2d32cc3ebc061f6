"""The command-line programs, each a thin ``main`` over the wings: ``train``
(``jaxformer-train``, ``train.py``), ``prepare`` (``jaxformer-prepare``), ``translate``
(``jaxformer-translate``; its flag checks in ``translate_flags``), ``convert``
(``jaxformer-convert``) and ``compile``
(``jaxformer-compile``). ``python -m jaxformer.translate``, ``.prepare`` and ``.compile``
run the same."""

import sys


def fail(prog: str, message: str, status: int = 2) -> None:
    """Ends a command with ``prog: error: message`` on stderr and exit ``status`` (2: bad input)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(status)

