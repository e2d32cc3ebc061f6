"""Prepared training data (written by :mod:`jaxformer.data.prepare`): token ids on disk,
memory-mapped, checked before use. A prepared directory holds ``manifest.json`` (inputs'
fingerprint, tokenizer, filters, counts, length histogram, each file's size and SHA-256),
``train-src.bin`` / ``train-tgt.bin`` (every kept training pair's ids, no bos/eos,
concatenated, dtype in the manifest), ``train-lengths.npy`` (int32 ``[N, 2]`` ids per pair;
offsets are their cumsum) and ``dev.tsv`` / ``test.tsv`` (held-out text). Flat files, not
ArrayRecord: a record is a few dozen integers read whole, which a memory map reads with no
per-record framing, the page cache holding the data (benchmarks/README.md, "data at scale").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1


class PreparedDataError(ValueError):
    """A prepared file is missing, truncated or corrupt; the message names it and the fix."""


def file_digest(path: str | Path) -> str:
    """SHA-256 (hex) of a file, streamed."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tokenizer_digest(path: str | Path) -> str:
    """SHA-256 of a tokenizer model file, or of a tokenizer folder (Marian's) as its files'
    relative names and digests."""
    path = Path(path)
    if path.is_file():
        return file_digest(path)
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{f.relative_to(path)}\0{file_digest(f)}\n".encode())
    return digest.hexdigest()


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    """A prepared directory's ``manifest.json``, or ``None`` if missing or not JSON."""
    try:
        return json.loads((Path(directory) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _problem(directory: Path, manifest: dict[str, Any] | None, check_hashes: bool) -> tuple[str, str] | None:
    """The first bad file and what is wrong with it, or ``None``: no manifest or another format
    version, a listed file missing, of another size or (``check_hashes``) another SHA-256."""
    if manifest is None or manifest.get("format_version") != FORMAT_VERSION:
        return "manifest.json", ("is missing or unreadable" if manifest is None else
                                 f"has format version {manifest.get('format_version')!r}, this jaxformer "
                                 f"reads version {FORMAT_VERSION}")
    for name, record in manifest["files"].items():
        path = directory / name
        if not path.exists():
            return name, "is missing"
        if path.stat().st_size != record["size"]:
            return name, (f"has {path.stat().st_size} bytes, the manifest says {record['size']} "
                          f"(truncated or overwritten)")
        if check_hashes and file_digest(path) != record["sha256"]:
            return name, "does not match its SHA-256 in manifest.json (corrupt)"
    return None


@dataclasses.dataclass
class PreparedCorpus:
    """The training pairs of a prepared directory, read on demand: ``src_lengths`` /
    ``tgt_lengths`` int64 ``[N]`` (ids per pair, no bos/eos); ``src[i]`` / ``tgt[i]`` the ids
    of pair ``i`` (int32, sliced from the memory maps); ``manifest`` the parsed manifest."""

    directory: Path
    manifest: dict[str, Any]
    src_lengths: np.ndarray
    tgt_lengths: np.ndarray
    src: _Side
    tgt: _Side

    @classmethod
    def open(cls, directory: str | Path, check_hashes: bool = True) -> PreparedCorpus:
        """Opens a prepared directory, checking sizes, the lengths against the ids, and (with
        ``check_hashes``) every SHA-256. Raises PreparedDataError: naming the first bad file and the
        fix."""
        directory = Path(directory)
        manifest = read_manifest(directory)
        problem = _problem(directory, manifest, check_hashes)
        if problem is None:   # the files are whole: the lengths must add up to the ids
            lengths = np.load(directory / "train-lengths.npy", allow_pickle=False).astype(np.int64)
            dtype = np.dtype(manifest["dtype"])
            sides = [_Side(np.memmap(directory / f"train-{side}.bin", dtype=dtype, mode="r"),
                           np.concatenate([[0], np.cumsum(lengths[:, column])]))
                     for column, side in enumerate(("src", "tgt"))]
            problem = next(((f"train-{name}.bin", f"holds {s.ids.size} ids but train-lengths.npy adds up to "
                             f"{s.offsets[-1]}") for name, s in zip(("src", "tgt"), sides)
                            if s.offsets[-1] != s.ids.size), None)
        if problem is not None:
            raise PreparedDataError(
                f"Prepared data file {str(directory / problem[0])!r} {problem[1]}. Delete {str(directory)!r} "
                f"and run jaxformer-prepare (or train.py, which prepares it) again with the same data flags.")
        return cls(directory, manifest, lengths[:, 0].copy(), lengths[:, 1].copy(), *sides)

    def __reduce__(self):
        # For a grain worker: it maps the files itself (pickled maps would copy every id).
        return PreparedCorpus.open, (self.directory, False)

    def __len__(self) -> int:
        return len(self.src_lengths)

    def held_out(self, name: str) -> list[tuple[str, str]]:
        """The ``"dev"`` or ``"test"`` pairs as text."""
        lines = (self.directory / f"{name}.tsv").read_text(encoding="utf-8").splitlines()
        return [tuple(line.split("\t")) for line in lines if line]


@dataclasses.dataclass(frozen=True)
class _Side:
    """One side's ids by pair: ``side[i]`` → int32 ``[len_i]``."""

    ids: np.ndarray
    offsets: np.ndarray

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.ids[self.offsets[i]:self.offsets[i + 1]], np.int32)

    def __len__(self) -> int:
        return len(self.offsets) - 1
