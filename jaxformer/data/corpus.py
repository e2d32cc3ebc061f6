"""Parallel corpora: reading (TSV or aligned files, plain or ``.gz``) and the
deterministic train/dev/test split.

Malformed lines never stop a run: they are skipped and counted in a
:class:`DataReport` printed at start. The split hashes the source sentence, so a
sentence lands in the same split on every run and every host.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gzip
import hashlib
import importlib.resources
import itertools
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from jaxformer.run.config import PAIRS

if TYPE_CHECKING:
    from jaxformer.run.config import TrainConfig

Pair = tuple[str, str]


@dataclasses.dataclass
class DataReport:
    """Counts of what was read, skipped (by reason) and kept; printed at start."""

    read: int = 0
    kept: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    def summary(self, name: str) -> str:
        parts = ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items())) or "none"
        return f"{name}: read {self.read} lines, kept {self.kept} pairs, skipped: {parts}"


def _open_bytes(path: Path):
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Corpus file {str(path)!r} does not exist; check the path.")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"Corpus file {str(path)!r} is not readable; check its permissions.")
    raw = path.open("rb")
    # gzip by name, or by gzip's magic number whatever the name (a .gz that is not gzip stays
    # an error naming the file, from _raw_lines)
    gzipped = path.suffix == ".gz" or raw.peek(2)[:2] == b"\x1f\x8b"
    return gzip.open(raw) if gzipped else raw


_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")   # little- and big-endian (UTF-32 LE starts like UTF-16 LE)


@contextlib.contextmanager
def _raw_lines(path: Path) -> Iterator[Iterator[bytes]]:
    """The lines of a plain or gzipped file as bytes, with a UTF-8 byte-order mark (which
    Windows editors write) dropped from the first line. A damaged gzip stream is a
    ``ValueError`` naming the file, not an ``EOFError`` or ``zlib.error`` traceback, and
    so is a UTF-16 file (by its byte-order mark: what Windows tools write as "Unicode").
    Lines end at ``\\n`` only: a stray ``\\r`` stays inside its line."""
    def lines(f) -> Iterator[bytes]:
        try:
            first = next(f, None)
            if first is None:
                return
            if first.startswith(_UTF16_BOMS):   # its ASCII lines would pass as UTF-8, NUL-interleaved
                reader = "zcat" if path.suffix == ".gz" else "cat"
                raise ValueError(f"Corpus file {str(path)!r} is UTF-16 (it starts with a UTF-16 byte-order "
                                 f"mark); convert it to UTF-8, e.g. {reader} {path} | iconv -f UTF-16 "
                                 f"-t UTF-8 > {path.name.split('.')[0]}.utf8.tsv")
            yield first[len(_UTF8_BOM):] if first.startswith(_UTF8_BOM) else first
            yield from f
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise ValueError(f"Corpus file {str(path)!r} is truncated or corrupt ({type(e).__name__}: "
                             f"{e}); re-create or re-download it (gzip -t {path} checks a .gz).") from e

    with _open_bytes(path) as f:
        yield lines(f)


def _decode_line(raw: bytes, report: DataReport) -> str | None:
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        report.skip("invalid UTF-8")
        return None


def _clean(text: str) -> str:
    return " ".join(text.split())


def _cleaned_pair(src: str, tgt: str, report: DataReport) -> Pair | None:
    """The whitespace-normalised pair, or ``None`` (counted) if a side is empty."""
    src, tgt = _clean(src), _clean(tgt)
    if not src or not tgt:
        report.skip("empty side")
        return None
    return src, tgt


def _finish(pairs: list[Pair], report: DataReport, name: str, expected: str) -> tuple[list[Pair], DataReport]:
    report.kept = len(pairs)
    if not pairs:
        raise ValueError(f"No usable sentence pair in {name} ({report.summary('it')}). "
                         f"Expected {expected}.")
    return pairs, report


def iter_tsv(path: str | os.PathLike, report: DataReport) -> Iterator[Pair]:
    """Streams the usable pairs of ``source<TAB>target`` lines (plain or ``.gz``), one
    line in memory at a time.

    Malformed lines are skipped and counted in ``report``, never fatal: no tab, an
    empty side, invalid UTF-8, more than one tab, a carriage return inside the line
    (a file with ``\\r`` line endings). ``report.read`` counts every line.

    Raises:
      FileNotFoundError / PermissionError: the path is missing or unreadable.
      ValueError: a truncated or corrupt ``.gz`` (the message names the file).
    """
    with _raw_lines(Path(path)) as f:
        for raw in f:
            report.read += 1
            line = _decode_line(raw, report)
            if line is None:
                continue
            if not line.strip():
                report.skip("blank line")
                continue
            if "\r" in line and line.count("\t") > 1:   # \r line endings: lines read as one
                report.skip("carriage return inside the line (\\r line endings? convert them to \\n)")
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                report.skip("no tab" if len(fields) == 1 else "more than one tab")
                continue
            pair = _cleaned_pair(fields[0], fields[1], report)
            if pair is not None:
                yield pair


def read_tsv(path: str | os.PathLike, report: DataReport | None = None) -> tuple[list[Pair], DataReport]:
    """All usable pairs of a TSV file (see :func:`iter_tsv`), in memory.

    Returns:
      ``(pairs, report)``.

    Raises:
      FileNotFoundError / PermissionError: the path is missing or unreadable.
      ValueError: no usable pair at all.
    """
    report = report or DataReport()
    pairs = list(iter_tsv(path, report))
    return _finish(pairs, report, repr(str(path)), "UTF-8 lines 'source<TAB>target'")


def iter_aligned(src_path: str | os.PathLike, tgt_path: str | os.PathLike,
                 report: DataReport) -> Iterator[Pair]:
    """Streams the usable pairs of two line-aligned text files (plain or ``.gz``).

    Raises:
      ValueError: the files have different line counts (found when the shorter ends), or
        one is a truncated or corrupt ``.gz``.
      FileNotFoundError / PermissionError: a path is missing or unreadable.
    """
    with _raw_lines(Path(src_path)) as fs, _raw_lines(Path(tgt_path)) as ft:
        for raw_src, raw_tgt in itertools.zip_longest(fs, ft):
            if raw_src is None or raw_tgt is None:
                longer = src_path if raw_tgt is None else tgt_path
                raise ValueError(f"{src_path} and {tgt_path} have different numbers of lines ({longer} has "
                                 f"more); aligned files need one sentence per line each.")
            report.read += 1
            src, tgt = _decode_line(raw_src, report), _decode_line(raw_tgt, report)
            if src is not None and tgt is not None:
                pair = _cleaned_pair(src, tgt, report)
                if pair is not None:
                    yield pair


def read_aligned(src_path: str | os.PathLike, tgt_path: str | os.PathLike) -> tuple[list[Pair], DataReport]:
    """Reads two line-aligned text files (source and target), one sentence per line.

    Raises:
      ValueError: the files have different line counts, or no usable pair.
    """
    report = DataReport()
    pairs = list(iter_aligned(src_path, tgt_path, report))
    return _finish(pairs, report, f"{src_path} / {tgt_path}", "one UTF-8 sentence per line in each file")


def builtin_corpus_path(pair: str) -> Path:
    """Path of a corpus shipped with the package (``en-de``, ``en-fr``, ``en-zh``)."""
    if pair not in PAIRS:
        raise ValueError(f"Unknown language pair {pair!r}; shipped pairs: {', '.join(PAIRS)}.")
    return Path(str(importlib.resources.files("jaxformer") / "corpora" / f"{pair}.tsv.gz"))


def _unit_hash(text: str) -> float:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclasses.dataclass(frozen=True)
class Splitter:
    """Where a pair goes: ``"train"``, ``"dev"`` or ``"test"``, by the hash of its source.

    ``dev_frac``/``test_frac`` are the shares of the unit interval given to dev and
    test; a split named in ``merged_into_train`` (one replaced by an explicit file)
    goes to train. The same source always lands in the same split, on every run and
    every host, whether the corpus is read whole (:func:`split_pairs`) or streamed
    (:mod:`jaxformer.data.prepare`).
    """

    dev_frac: float
    test_frac: float
    merged_into_train: tuple[str, ...] = ()

    @classmethod
    def for_size(cls, n: int, dev_size: int = 1000, test_size: int = 1000,
                 merged_into_train: tuple[str, ...] = ()) -> Splitter:
        """The split of an ``n``-pair corpus with expected dev/test sizes (each at most 25%).

        Raises:
          ValueError: fewer than 3 pairs.
        """
        if n < 3:
            raise ValueError(f"A corpus of {n} pairs cannot be split into train/dev/test.")
        return cls(min(dev_size / n, 0.25), min(test_size / n, 0.25), merged_into_train)

    def __call__(self, source: str) -> str:
        u = _unit_hash(source)
        name = "dev" if u < self.dev_frac else "test" if u < self.dev_frac + self.test_frac else "train"
        return "train" if name in self.merged_into_train else name


def check_splits_nonempty(sizes: dict[str, int], n: int) -> None:
    """Raises ``ValueError`` naming the first empty split of an ``n``-pair corpus."""
    for name, size in sizes.items():
        if not size:
            raise ValueError(f"The {name} split is empty ({n} pairs in all; a pair's split is chosen by "
                             f"the hash of its source, so repeated sources share one); give a larger "
                             f"corpus or explicit --dev-file/--test-file.")


def target_language_of(cfg: TrainConfig) -> str:
    """The target language code of a run's data (``"xx"`` for a user's own corpus)."""
    return cfg.data.pair.split("-")[1] if not (cfg.data.train_file or cfg.data.src_file) else "xx"
