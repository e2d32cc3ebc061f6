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



def warn_replaced(where: str, bad: list[int]) -> None:
    """Warns on stderr of the lines of ``where`` (numbers ``bad``) read with U+FFFD, if any."""
    if bad:
        from jaxformer.data.lines import line_numbers

        print(f"warning: {len(bad)} line(s) of {where} were not valid UTF-8 (line {line_numbers(bad)}); "
              f"their bad bytes were replaced with U+FFFD", file=sys.stderr)
