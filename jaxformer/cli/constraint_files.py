"""The files of ``jaxformer-translate --constraints / --terminology / --prefix``, read beside the
input: line i of a constraints file (target phrases separated by tabs; empty: none) or a prefix
file (one target prefix; empty: none) belongs to input line i, whichever way the input comes
(arguments, a file, streamed stdin, bulk chunks in any order); a terminology file (a TSV of
source term → target term) adds the target term to the constraints of each line whose source
holds the source term as whole words, after the tokenizer's normalisation, case as written.
"""

from __future__ import annotations

import functools
import os
import re
import unicodedata
from collections.abc import Callable
from pathlib import Path

from jaxformer.data.prepared import file_digest

# The flags, each with the field of TranslateArgs that names its file.
FLAGS = {"constraints": "--constraints", "terminology": "--terminology", "prefix": "--prefix"}
_EVERY = 1024   # a file offset is kept for every 1,024th line


class SideFileError(ValueError):
    """A constraint, terminology or prefix file that cannot be read as the flag wants."""


class SideFile:
    """A text file of one line per input line: ``lines(first, count)`` reads lines ``first`` …
    ``first + count - 1`` (0-based), seeking from offsets kept every 1,024 lines (a file of any
    size in little memory); a pipe only forward. Raises :class:`SideFileError` for a
    line that is not UTF-8 or a file with fewer lines than asked for."""

    def __init__(self, path: str, flag: str):
        self.path, self.flag = path, flag
        self.file = open(path, "rb")   # noqa: SIM115 (kept open while the input is read)
        self.seekable = self.file.seekable()
        self.offsets, self.next_line, self.count = [0], 0, None
        if self.seekable:
            count = 0
            for count, _ in enumerate(iter(self.file.readline, b""), 1):
                if count % _EVERY == 0:
                    self.offsets.append(self.file.tell())
            self.count = count
            self.file.seek(0)

    def lines(self, first: int, count: int) -> list[str]:
        if self.seekable and first != self.next_line:
            self.file.seek(self.offsets[first // _EVERY])
            for _ in range(first % _EVERY):
                self.file.readline()
        assert self.seekable or first == self.next_line, "a pipe is read forward only (bulk mode needs files)"
        raw = [self.file.readline() for _ in range(count)]
        self.next_line = first + count
        texts = [_text(line, first + i) if line else None for i, line in enumerate(raw)]
        if None in texts:
            raise SideFileError(f"{self.flag} {self.path!r} line {first + texts.index(None) + 1} is missing "
                                f"or not UTF-8: give one line of UTF-8 text per input line (empty for none)")
        return texts


def _text(raw: bytes, index: int) -> str | None:
    """A line's text without its line end (and, on line 1, a byte-order mark); ``None``: not UTF-8."""
    try:
        text = raw.decode("utf-8-sig" if index == 0 else "utf-8")
    except UnicodeDecodeError:
        return None
    return text.rstrip("\r\n")


def normaliser(tokenizer) -> Callable[[str], str]:
    """The tokenizer's normalisation of a source text (its sentencepiece model's, spaces as
    spaces), else Unicode NFKC."""
    model = getattr(tokenizer, "sp", None) or getattr(tokenizer, "source_spm", None)
    if hasattr(model, "normalize"):
        return lambda text: model.normalize(text).replace("\u2581", " ").strip()
    return lambda text: unicodedata.normalize("NFKC", text).strip()


class Terminology:
    """A TSV of ``source term<TAB>target term`` (blank lines skipped): :meth:`targets` gives the
    target terms whose source term a sentence holds. Raises :class:`SideFileError` for lines
    without exactly one tab, with an empty side or not UTF-8 (their numbers named)."""

    def __init__(self, path: str, normalise: Callable[[str], str]):
        rows = Path(path).read_text(encoding="utf-8-sig", errors="replace").splitlines()
        pairs = [(n, row.split("\t")) for n, row in enumerate(rows, 1) if row.strip()]
        bad = [n for n, cells in pairs
               if len(cells) != 2 or not all(c.strip() for c in cells) or "\ufffd" in "".join(cells)]
        if bad:
            raise SideFileError(f"--terminology {path!r} lines {bad[:5]} are not 'source term<TAB>target "
                                f"term' in UTF-8")
        self.normalise = normalise
        self.terms = [(re.compile(rf"(?<!\w){re.escape(normalise(src))}(?!\w)"), tgt.strip())
                      for _, (src, tgt) in pairs]

    def targets(self, sentence: str) -> list[str]:
        text = self.normalise(sentence)
        return [target for pattern, target in self.terms if pattern.search(text)]


@functools.lru_cache(maxsize=4)
def _sources(constraints: str | None, terminology: str | None, prefix: str | None, tokenizer, stamps: tuple):
    """The open files of one command (kept for all its batches; ``stamps``: the files' sizes and
    times, so a file changed since is opened again)."""
    return (constraints and SideFile(constraints, "--constraints"),
            terminology and Terminology(terminology, normaliser(tokenizer)),
            prefix and SideFile(prefix, "--prefix"))


def for_lines(args, tokenizer, lines: list[str],
              first: int) -> tuple[list[list[str]] | None, list[str] | None]:
    """Input lines ``first`` … of ``args``' files: ``(constraints, prefixes)``, each ``None``
    without its flag. Raises :class:`SideFileError` (see :class:`SideFile`, :class:`Terminology`)."""
    paths = (args.constraints, args.terminology, args.prefix)
    stamps = tuple((os.stat(p).st_size, os.stat(p).st_mtime_ns) if p and Path(p).is_file() else None
                   for p in paths)
    side, terms, prefix = _sources(*paths, tokenizer, stamps)
    constraints = None
    if side or terms:
        given = side.lines(first, len(lines)) if side else [""] * len(lines)
        constraints = [[p for p in row.split("\t") if p.strip()] + (terms.targets(line) if terms else [])
                       for row, line in zip(given, lines)]
    return constraints, prefix.lines(first, len(lines)) if prefix else None


def count_problem(args, input_lines: int) -> str | None:
    """Why a constraints or prefix file does not hold one line per input line, or ``None``."""
    for name in ("constraints", "prefix"):
        path = getattr(args, name)
        if path:
            side = SideFile(path, FLAGS[name])
            count = side.count
            side.file.close()
            if count is not None and count != input_lines:
                return (f"{FLAGS[name]} {path!r} has {count} lines but the input {input_lines}: give one "
                        f"line per input line (an empty line for none)")
    return None


def digests(args) -> dict[str, str]:
    """The given files' SHA-256, for a bulk job's record (a resume with other files is refused)."""
    return {f"{name}_sha256": file_digest(getattr(args, name)) for name in FLAGS if getattr(args, name)}
