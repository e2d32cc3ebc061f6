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


def _corrupt(path: Path, problem: str) -> PreparedDataError:
    return PreparedDataError(
        f"Prepared data file {str(path)!r} {problem}. Delete {str(path.parent)!r} and run "
        f"jaxformer-prepare (or train.py, which prepares it) again with the same data flags.")


def verify_files(directory: Path, manifest: dict[str, Any], check_hashes: bool = True) -> None:
    """Checks every file the manifest lists: present, of the recorded size and (with
    ``check_hashes``) of the recorded SHA-256.

    Raises:
      PreparedDataError: naming the first bad file and the fix (re-run prepare).
    """
    for name, record in manifest["files"].items():
        path = Path(directory) / name
        if not path.exists():
            raise _corrupt(path, "is missing")
        size = path.stat().st_size
        if size != record["size"]:
            raise _corrupt(path, f"has {size} bytes, the manifest says {record['size']} (truncated "
                                 f"or overwritten)")
        if check_hashes and file_digest(path) != record["sha256"]:
            raise _corrupt(path, "does not match its SHA-256 in manifest.json (corrupt)")


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
          PreparedDataError: no manifest, another format version, or a bad file.
        """
        directory = Path(directory)
        manifest = read_manifest(directory)
        if manifest is None:
            raise _corrupt(directory / "manifest.json", "is missing or unreadable")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise _corrupt(directory / "manifest.json",
                           f"has format version {manifest.get('format_version')!r}, this jaxformer "
                           f"reads version {FORMAT_VERSION}")
        verify_files(directory, manifest, check_hashes)
        try:
            lengths = np.load(directory / "train-lengths.npy", allow_pickle=False).astype(np.int64)
        except ValueError as e:
            raise _corrupt(directory / "train-lengths.npy", f"is unreadable ({e})") from e
        dtype = np.dtype(manifest["dtype"])
        src_ids = np.memmap(directory / "train-src.bin", dtype=dtype, mode="r")
        tgt_ids = np.memmap(directory / "train-tgt.bin", dtype=dtype, mode="r")
        offsets = [np.concatenate([[0], np.cumsum(lengths[:, side])]) for side in (0, 1)]
        for path, ids, offset in ((directory / "train-src.bin", src_ids, offsets[0]),
                                  (directory / "train-tgt.bin", tgt_ids, offsets[1])):
            if lengths.ndim != 2 or offset[-1] != ids.size:
                raise _corrupt(path, f"holds {ids.size} ids but train-lengths.npy adds up to "
                                     f"{offset[-1]}")
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
