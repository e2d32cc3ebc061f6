"""The one reader of text lines (corpora, bulk-translation input, the translate tool's input).

gzip by its magic number; a line ends at ``\\n`` only (a bare ``\\r`` stays in it), one
``\\r`` before it and a UTF-8 byte-order mark at the start are dropped; the last line needs
no newline. UTF-16 and a truncated or corrupt gzip are a :class:`TextError`. A line not
UTF-8 is, by ``errors``: ``"strict"`` a :class:`NotUtf8`, ``"replace"`` (or another codec
handler) decoded with U+FFFD, ``"skip"`` ``None``; the latter two append its 1-based
number to ``bad``.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal, TypeVar

Errors = Literal["strict", "replace", "skip"] | str
T = TypeVar("T")


class TextError(ValueError):
    """A file that cannot be read as lines of UTF-8 text; the message names it and the fix."""


class NotUtf8(TextError):
    """Lines that are not UTF-8 (``numbers``, 1-based) where ``errors="strict"``."""

    def __init__(self, where: str, numbers: list[int]):
        self.numbers = list(numbers)
        super().__init__(f"{len(numbers)} line(s) of {where} are not valid UTF-8 (line "
                         f"{line_numbers(numbers)}); fix the file (e.g. iconv -f LATIN1 -t UTF-8) or "
                         f"pass --input-errors replace")


def line_numbers(numbers) -> str:
    """``"4, 9, 12"``: the first ten of ``numbers``, ``", ..."`` if there are more."""
    return ", ".join(map(str, list(numbers)[:10])) + (", ..." if len(numbers) > 10 else "")


def chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """``items`` as lists of ``size`` (the last one may be shorter)."""
    items = iter(items)
    while chunk := list(itertools.islice(items, size)):
        yield chunk


class LineSplitter:
    """Bytes in, in chunks of any size (:meth:`feed`, ``final=True`` at the end), lines out."""

    def __init__(self, where: str, errors: Errors = "strict", bad: list[int] | None = None):
        self.where, self.errors = where, errors
        self.bad = [] if bad is None else bad
        self.number = 0   # lines given so far
        self._pending = b""

    def feed(self, data: bytes, final: bool = False) -> Iterator[str | None]:
        """The lines ``data`` completes, decoded lazily (under ``"strict"`` the lines before
        a bad one come out before :class:`NotUtf8`)."""
        *complete, self._pending = (self._pending + data).split(b"\n")
        if final and self._pending:
            complete, self._pending = complete + [self._pending], b""
        return map(self._decode, complete)

    def _decode(self, raw: bytes) -> str | None:
        self.number += 1
        if self.number == 1:
            if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in raw:   # UTF-16: NULs in ASCII
                raise TextError(f"{self.where} is UTF-16 (a UTF-16 byte-order mark or NUL bytes); "
                                f"convert it to UTF-8, e.g. iconv -f UTF-16 -t UTF-8 (zcat it first if "
                                f"it is gzipped).")
            raw = raw.removeprefix(b"\xef\xbb\xbf")
        raw = raw.removesuffix(b"\r")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.bad.append(self.number)
            if self.errors == "strict":
                raise NotUtf8(self.where, [self.number]) from None
            return None if self.errors == "skip" else raw.decode("utf-8", errors=self.errors)


def read_lines(source: str | os.PathLike | BinaryIO, errors: Errors = "strict",
               bad: list[int] | None = None, where: str | None = None) -> Iterator[str | None]:
    """The lines of a path or a binary stream (e.g. ``sys.stdin.buffer``), read 1 MiB at a time.
    Raises OSError: from opening ``source``. TextError: UTF-16, or a truncated or corrupt gzip.
    NotUtf8: a line that is not UTF-8, with ``errors="strict"``."""
    is_path = isinstance(source, (str, os.PathLike))
    where = where or (repr(str(source)) if is_path else "stdin")
    splitter = LineSplitter(where, errors, bad)
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(open(source, "rb")) if is_path else source
        if not hasattr(stream, "peek"):
            stream = io.BufferedReader(stream)
        if stream.peek(2)[:2] == b"\x1f\x8b":
            stream = stack.enter_context(gzip.GzipFile(fileobj=stream))
        try:
            while block := stream.read(1 << 20):
                yield from splitter.feed(block)
            yield from splitter.feed(b"", final=True)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            name = Path(source).name if is_path else "-"
            raise TextError(f"{where} is a truncated or corrupt gzip file ({type(e).__name__}: {e}); "
                            f"re-create or re-download it (gzip -t {name} checks it).") from e
