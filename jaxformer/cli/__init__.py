"""The command-line programs, each a thin ``main`` over the wings: ``train``, ``prepare``,
``translate`` (its flags: ``translate_flags``; bulk mode: ``bulk``), ``convert``, ``compile``."""

import re
import sys
from pathlib import Path


def plain(doc: str) -> str:
    """A docstring as ``--help`` text: reST roles and double backquotes dropped."""
    return re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "")


def fail(prog: str, message: str, status: int = 2) -> None:
    """Ends a command with ``prog: error: message`` on stderr and exit ``status`` (2: bad input)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(status)



def unwritable(folder: str | Path) -> str | None:
    """Why no file can be made in ``folder`` (one still to be made: the nearest existing folder
    above it), probed with a uniquely named file; ``None`` if one can."""
    from jaxformer.run.directory import probe_writable

    path = Path(folder).absolute()
    if path.exists() and not path.is_dir():
        return "is a file; name a folder"
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:
        probe_writable(existing)
    except OSError as e:
        return f"cannot be written ({existing}: {e.strerror}); name a folder you can write to"
    return None


def warn_replaced(where: str, bad: list[int]) -> None:
    """Warns on stderr of the lines of ``where`` (numbers ``bad``) read with U+FFFD, if any."""
    if bad:
        from jaxformer.data.lines import line_numbers

        print(f"warning: {len(bad)} line(s) of {where} were not valid UTF-8 (line {line_numbers(bad)}); "
              f"their bad bytes were replaced with U+FFFD", file=sys.stderr)
