"""Parallel corpora as a data source (one TSV file or two line-aligned files, plain or
gzip, read by :mod:`jaxformer.data.lines`) and the train/dev/test split by the hash of
the source. Malformed lines are skipped and counted in a :class:`DataReport`, never fatal.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.resources
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxformer.data.lines import read_lines
from jaxformer.data.prepared import file_digest
from jaxformer.run.config import PAIRS  # noqa: F401  (re-exported: the shipped pairs)

Pair = tuple[str, str]


@dataclasses.dataclass
class DataReport:
    """Lines read, pairs kept, and pairs skipped by reason; printed at start."""

    read: int = 0
    kept: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def summary(self, name: str) -> str:
        parts = ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items())) or "none"
        return f"{name}: read {self.read} lines, kept {self.kept} pairs, skipped: {parts}"


def describe_file(path: str | os.PathLike) -> dict[str, Any]:
    """A corpus file's fingerprint: resolved path, size and SHA-256. Raises FileNotFoundError:
    missing. ValueError: a folder, a pipe or a device (a corpus is read more than once)."""
    p = Path(path)
    if not p.is_file():
        problem = ("does not exist; check the path" if not p.exists() else
                   "is a folder: name the file in it (a TSV of source<TAB>target lines, or a text "
                   "file of one side; .gz or not)" if p.is_dir() else
                   "is not a regular file (a pipe or a device?): a corpus is read more than once "
                   "(its fingerprint, the tokenizer's sample, the splits); save it to a file first")
        raise (ValueError if p.exists() else FileNotFoundError)(f"Corpus file {str(path)!r} {problem}.")
    return {"path": str(p.resolve()), "size": p.stat().st_size, "sha256": file_digest(p)}


def _cleaned(src: str | None, tgt: str | None) -> Pair | str:
    """The whitespace-normalised pair, or why it is skipped."""
    if src is None or tgt is None:
        return "invalid UTF-8"
    src, tgt = " ".join(src.split()), " ".join(tgt.split())
    return (src, tgt) if src and tgt else "empty side"


def _tsv_pairs(path: str) -> Iterator[Pair | str]:
    for line in read_lines(path, errors="skip"):
        if line is None:
            yield "invalid UTF-8"
        elif not line.strip():
            yield "blank line"
        elif "\r" in line and line.count("\t") > 1:   # a file of \r line endings reads as one line
            yield "carriage return inside the line (\\r line endings? convert them to \\n)"
        elif line.count("\t") != 1:
            yield "no tab" if "\t" not in line else "more than one tab"
        else:
            yield _cleaned(*line.split("\t"))


def _aligned_pairs(src_path: str, tgt_path: str) -> Iterator[Pair | str]:
    end = object()
    for src, tgt in itertools.zip_longest(read_lines(src_path, "skip"), read_lines(tgt_path, "skip"),
                                          fillvalue=end):
        if src is end or tgt is end:
            raise ValueError(f"{src_path} and {tgt_path} have different numbers of lines "
                             f"({src_path if tgt is end else tgt_path} has more); aligned files need "
                             f"one sentence per line each.")
        yield _cleaned(src, tgt)


@dataclasses.dataclass
class PairFiles:
    """Sentence pairs as a data source (:class:`jaxformer.data.sources.DataSource`): one TSV
    file of ``source<TAB>target`` lines, or two line-aligned files (source, target).

    Skipped and counted in ``report`` (``report.read`` counts every line): no tab, more
    than one tab, an empty side, invalid UTF-8, a blank line, a ``\\r`` inside a line of
    several tabs. The position is the number of usable pairs given.
    """

    paths: tuple[str, ...]
    report: DataReport = dataclasses.field(default_factory=DataReport)
    position: int = 0

    def records(self) -> Iterator[Pair]:
        """The usable pairs from the position on, streamed. Raises OSError: a missing or unreadable
        path. ValueError: no usable pair; aligned files of different lengths.
        jaxformer.data.lines.TextError: UTF-16, a corrupt ``.gz``."""
        paths = [str(p) for p in self.paths]
        kept = 0
        for pair in _aligned_pairs(*paths) if len(paths) == 2 else _tsv_pairs(paths[0]):
            self.report.read += 1
            if isinstance(pair, str):
                self.report.skipped[pair] += 1
                continue
            kept = self.report.kept = kept + 1
            if kept > self.position:
                self.position = kept
                yield pair
        if not kept:
            expected = ("one UTF-8 sentence per line in each file" if len(paths) == 2 else
                        "UTF-8 lines 'source<TAB>target'")
            raise ValueError(f"No usable sentence pair in {' / '.join(map(repr, paths))} "
                             f"({self.report.summary('it')}). Expected {expected}.")

    def fingerprint(self) -> list[dict[str, Any]]:
        """Each file's :func:`describe_file`."""
        return [describe_file(p) for p in self.paths]

    def get_state(self) -> dict[str, int]:
        return {"pairs": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        self.position = int(state["pairs"])


def read_tsv(path: str | os.PathLike, report: DataReport | None = None) -> tuple[list[Pair], DataReport]:
    """All usable pairs of a TSV file (:class:`PairFiles`) in memory, and their report."""
    source = PairFiles((str(path),), report or DataReport())
    return list(source.records()), source.report


def builtin_corpus_path(pair: str) -> Path:
    """The corpus shipped for ``pair`` (``en-de``, ``en-fr``, ``en-zh``)."""
    return Path(str(importlib.resources.files("jaxformer") / "corpora" / f"{pair}.tsv.gz"))


@dataclasses.dataclass(frozen=True)
class Splitter:
    """A pair's split, ``"train"``, ``"dev"`` or ``"test"``, by the SHA-256 of its source: the
    same on every run and host. ``dev_frac``/``test_frac``: the shares of [0, 1) for dev
    and test; a split in ``merged_into_train`` (replaced by an explicit file) goes to train.
    """

    dev_frac: float
    test_frac: float
    merged_into_train: tuple[str, ...] = ()

    @classmethod
    def for_size(cls, n: int, dev_size: int = 1000, test_size: int = 1000,
                 merged_into_train: tuple[str, ...] = ()) -> Splitter:
        """The split of ``n`` ≥ 1 pairs with these expected dev/test sizes (each ≤ 25%)."""
        return cls(min(dev_size / n, 0.25), min(test_size / n, 0.25), merged_into_train)

    def __call__(self, source: str) -> str:
        u = int.from_bytes(hashlib.sha256(source.encode("utf-8")).digest()[:8], "big") / 2.0**64
        name = "dev" if u < self.dev_frac else "test" if u < self.dev_frac + self.test_frac else "train"
        return "train" if name in self.merged_into_train else name


def check_splits_nonempty(sizes: dict[str, int], n: int, dropped: dict[str, int] | None = None) -> None:
    """Raises ``ValueError`` naming the first empty split of an ``n``-pair corpus (``dropped``:
    the training pairs the length filters dropped, by reason)."""
    empty = [name for name, size in sizes.items() if not size]
    if empty:
        filters = (f", of which the length filters dropped {dropped} (raise --max-length-ratio or check "
                   f"the corpus)" if empty[0] == "train" and any((dropped or {}).values()) else "")
        raise ValueError(f"The {empty[0]} split is empty ({n} pairs in all{filters}; a pair's split is "
                         f"chosen by the hash of its source, so repeated sources share one); give a "
                         f"larger corpus or explicit --dev-file/--test-file.")
