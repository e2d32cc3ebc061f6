"""Reading prepared training data: token ids on disk, memory-mapped, checked before use.

Written by :mod:`jaxformer.data.prepare`. A prepared directory holds::

  manifest.json     inputs' fingerprint, tokenizer, filters, counts, length histogram,
                    and the size and SHA-256 of every file below
  train-src.bin     source token ids of every kept training pair, concatenated
  train-tgt.bin     target token ids (no bos/eos), concatenated
  train-lengths.npy [N, 2] ids per pair (source, target); offsets are their cumsum
  dev.tsv test.tsv  the held-out pairs as text (evaluation decodes and scores text)

Why flat ``.bin`` files and not ArrayRecord: a record here is a few dozen small
integers, read whole; a memory map gives random access with no per-record
decoding or per-record framing, and the page cache, not the process, holds the
data (measured in benchmarks/README.md, "data at scale"). Only the lengths and the
offsets (32 bytes a pair) live in process memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
FILES = ("train-src.bin", "train-tgt.bin", "train-lengths.npy", "dev.tsv", "test.tsv")


class PreparedDataError(ValueError):
    """A prepared file is missing, truncated or corrupt; the message names it and the fix."""


def file_digest(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """SHA-256 of a file, read in 4 MiB chunks (through the page cache, not into memory)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_digest(path: Path) -> str:
    """SHA-256 of a tokenizer: of its model file, or of a tokenizer folder (Marian's
    ``source.spm``, ``target.spm``, ``vocab.json``, …) as its files' names and digests."""
    path = Path(path)
    if path.is_file():
        return file_digest(path)
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{f.relative_to(path)}\0{file_digest(f)}\n".encode())
    return digest.hexdigest()


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """``manifest.json`` of a prepared directory, or ``None`` if there is none (or it is not JSON)."""
    path = Path(directory) / "manifest.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _problem(directory: Path, manifest: dict[str, Any] | None, check_hashes: bool) -> tuple[str, str] | None:
    """The first bad file of a prepared directory and what is wrong with it, or ``None``:
    the manifest missing or of another format version, a listed file missing, of another
    size than recorded or (with ``check_hashes``) of another SHA-256."""
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
    """The training pairs of a prepared directory as token-id arrays, read on demand.

    Attributes:
      src_lengths / tgt_lengths: ``[N]`` int64, ids per pair (no bos/eos).
      manifest: the parsed ``manifest.json``.

    ``corpus.src[i]`` / ``corpus.tgt[i]`` are the ids of pair ``i`` (``[len]`` int32),
    sliced from the memory maps; nothing else is read.
    """

    directory: Path
    manifest: dict[str, Any]
    src_lengths: np.ndarray
    tgt_lengths: np.ndarray
    _src_ids: np.ndarray
    _tgt_ids: np.ndarray
    _src_offsets: np.ndarray
    _tgt_offsets: np.ndarray

    @classmethod
    def open(cls, directory: str | Path, check_hashes: bool = True) -> PreparedCorpus:
        """Opens and checks a prepared directory (sizes always, SHA-256 with ``check_hashes``).

        Raises:
          PreparedDataError: no manifest, another format version, or a bad file (the first
            named, with the fix).
        """
        directory = Path(directory)
        manifest = read_manifest(directory)
        problem = _problem(directory, manifest, check_hashes)
        if problem is None:   # the files are whole: the lengths must add up to the ids
            lengths = np.load(directory / "train-lengths.npy", allow_pickle=False).astype(np.int64)
            dtype = np.dtype(manifest["dtype"])
            ids = [np.memmap(directory / f"train-{side}.bin", dtype=dtype, mode="r") for side in ("src", "tgt")]
            offsets = [np.concatenate([[0], np.cumsum(lengths[:, side])]) for side in (0, 1)]
            problem = next(((f"train-{side}.bin", f"holds {i.size} ids but train-lengths.npy adds up to {o[-1]}")
                            for side, i, o in zip(("src", "tgt"), ids, offsets) if o[-1] != i.size), None)
        if problem is not None:
            raise PreparedDataError(
                f"Prepared data file {str(directory / problem[0])!r} {problem[1]}. Delete {str(directory)!r} "
                f"and run jaxformer-prepare (or train.py, which prepares it) again with the same data flags.")
        src_ids, tgt_ids = ids
        return cls(directory, manifest, lengths[:, 0].copy(), lengths[:, 1].copy(), src_ids, tgt_ids,
                   offsets[0], offsets[1])

    def __reduce__(self):
        # Pickled for a grain worker process: it maps the files itself (sizes checked, the
        # hashes were checked here). Pickling the memory maps would copy every id.
        return PreparedCorpus.open, (self.directory, False)

    def __len__(self) -> int:
        return len(self.src_lengths)

    @property
    def src(self) -> _Side:
        return _Side(self._src_ids, self._src_offsets)

    @property
    def tgt(self) -> _Side:
        return _Side(self._tgt_ids, self._tgt_offsets)

    def held_out(self, name: str) -> list[tuple[str, str]]:
        """The ``"dev"`` or ``"test"`` pairs as text."""
        lines = (self.directory / f"{name}.tsv").read_text(encoding="utf-8").splitlines()
        return [tuple(line.split("\t")) for line in lines if line]


@dataclasses.dataclass(frozen=True)
class _Side:
    """One side's ids, indexable by pair: ``side[i]`` → ``[len_i]`` int32."""

    ids: np.ndarray
    offsets: np.ndarray

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.ids[self.offsets[i]:self.offsets[i + 1]], np.int32)

    def __len__(self) -> int:
        return len(self.offsets) - 1
