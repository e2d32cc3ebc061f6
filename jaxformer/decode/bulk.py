"""Bulk translation of a file of any size: streamed, resumable, one line out per line in.

:func:`translate_file` decodes the input (read by :mod:`jaxformer.data.lines`) in chunks
of ``chunk_lines`` lines, each written whole to ``OUTPUT.parts/<chunk>.txt``, then joins
them into ``OUTPUT`` by rename. Started again after a kill, it decodes only the missing
chunks, so the output is the same byte for byte; ``OUTPUT.parts/manifest.json`` records
what it depends on (input hash and size, model, settings), and a resume with others is
refused, naming them.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jaxformer.data import lines as lines_lib
from jaxformer.data.prepared import file_digest

BulkInputError = lines_lib.TextError   # the input cannot be read as lines of UTF-8 text


class BulkResumeError(ValueError):
    """``OUTPUT.parts`` belongs to another input or other settings."""


@dataclasses.dataclass(frozen=True)
class InputInfo:
    """The input's SHA-256 (of the bytes on disk), size in bytes, line count, and the 1-based
    numbers of the lines that are not UTF-8."""

    sha256: str
    size: int
    lines: int
    bad_lines: tuple[int, ...]


def scan_input(path: str | Path) -> InputInfo:
    """The input's :class:`InputInfo`, streamed. Raises BulkInputError: UTF-16, or a truncated or
    corrupt gzip file."""
    bad: list[int] = []
    count = sum(1 for _ in lines_lib.read_lines(path, errors="skip", bad=bad))
    return InputInfo(file_digest(path), Path(path).stat().st_size, count, tuple(bad))


def read_chunks(path: str | Path, chunk_lines: int, errors: str = "strict") -> Iterator[list[str]]:
    """The input's lines as text, ``chunk_lines`` at a time (the last chunk may be shorter)."""
    return lines_lib.chunks(lines_lib.read_lines(Path(path), errors=errors), chunk_lines)


class BulkJob:
    """``<output>.parts/``: the manifest (``record``, all the output depends on) and the finished
    chunks. Raises BulkResumeError: the folder holds another input's or other settings' chunks."""

    def __init__(self, output: str | Path, record: dict[str, Any]):
        self.output = Path(output)
        self.parts = self.output.with_name(self.output.name + ".parts")
        self.record = record
        manifest = self.parts / "manifest.json"
        if manifest.exists():
            saved = {"engine": "jax", **json.loads(manifest.read_text())}   # older manifests: JAX's
            differing = sorted(k for k in set(saved) | set(record) if saved.get(k) != record.get(k))
            if differing:
                changes = "; ".join(f"{k}: then {saved.get(k)!r}, now {record.get(k)!r}" for k in differing)
                unknown = [k for k in differing if k not in saved]   # recorded only by later versions
                fix = (f"It was started by an older jaxformer, whose manifest has no {', '.join(unknown)}: "
                       f"finish it with that version" if unknown else
                       "Run the command that started it to finish it")
                raise BulkResumeError(
                    f"{self.parts} holds the chunks of an unfinished translation with other inputs or "
                    f"settings ({changes}). {fix}, or delete {self.parts} to start over.")
        else:
            self.parts.mkdir(parents=True, exist_ok=True)
            _write_atomically(manifest, json.dumps(record, indent=1, sort_keys=True))

    def chunk_path(self, index: int) -> Path:
        return self.parts / f"{index:08d}.txt"

    def done(self, index: int) -> bool:
        return self.chunk_path(index).exists()

    def write(self, index: int, text: str, counts: dict[str, int]) -> None:
        """Writes chunk ``index`` whole (temporary name, fsync, rename), its counts first."""
        _write_atomically(self.chunk_path(index).with_suffix(".json"), json.dumps(counts))
        _write_atomically(self.chunk_path(index), text)

    def counts(self, index: int) -> dict[str, int]:
        """The counts written with chunk ``index``."""
        return json.loads(self.chunk_path(index).with_suffix(".json").read_text())

    def finish(self, chunks: int) -> None:
        """Joins chunks ``0 … chunks-1`` into the output (by rename) and removes the parts."""
        tmp = self.output.with_name(self.output.name + ".tmp")
        with open(tmp, "wb") as out:
            for index in range(chunks):
                with open(self.chunk_path(index), "rb") as part:
                    shutil.copyfileobj(part, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.output)
        shutil.rmtree(self.parts)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")   # processes may write the same file
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclasses.dataclass
class BulkReport:
    """Counts and rates of one :func:`translate_file` call: the whole cluster's in process 0,
    its own share in another. ``decoded`` counts the lines of the chunks this call decoded
    and, of those, ``empty``, ``long`` (over max_len), ``replaced`` (not UTF-8) and their
    source ``tokens``."""

    lines: int = 0
    chunks: int = 0
    resumed_chunks: int = 0     # found finished, not decoded again
    decoded: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    seconds: float = 0.0
    processes: int = 1

    def add(self, lines: int, counts: dict[str, int]) -> None:
        """Counts one decoded chunk of ``lines`` lines."""
        self.decoded.update(counts, lines=lines)

    def summary(self) -> str:
        d, per_s = self.decoded, 1 / self.seconds if self.seconds else 0.0
        by = f" by {self.processes} processes" if self.processes > 1 else ""
        return (f"{self.lines:,} lines in {self.chunks} chunk(s), {self.resumed_chunks} found finished; "
                f"decoded {d['lines']:,} lines ({d['empty']:,} empty, {d['long']:,} longer than max_len, "
                f"{d['replaced']:,} with bytes not UTF-8 replaced){by} in {self.seconds:.1f} s: "
                f"{d['lines'] * per_s:,.1f} sentences/s, {d['tokens'] * per_s:,.0f} source tokens/s")


ChunkTranslator = Callable[[list[str], int, int], tuple[str, dict[str, int]]]


def translate_file(translate_chunk: ChunkTranslator, input_path: str | Path, output: str | Path, *,
                   record: dict[str, Any], chunk_lines: int = 10_000, errors: str = "strict",
                   progress: bool | None = None, info: InputInfo | None = None,
                   process_index: int = 0, process_count: int = 1,
                   barrier: Callable[[str], None] | None = None) -> BulkReport:
    """Translates ``input_path`` (text or gzip, a sentence a line) into ``output``, chunk by
    chunk, resuming a killed run. Each process of a cluster decodes the chunks whose index
    is ``process_index`` modulo ``process_count`` into the shared parts folder; process 0
    joins them once ``barrier`` (:func:`jaxformer.model.sharding.process_barrier`) says all
    are done. Any process count gives the same file.

    Args:
      translate_chunk: ``(lines, first_line_index, chunk_index) -> (text, counts)``: a
        chunk's output lines and counts (``empty``, ``long``, ``tokens``), a function of its
        arguments only.
      record: what the output depends on, for the manifest (input hash and size,
        ``chunk_lines`` and ``errors`` are added).
      errors: ``"strict"`` (lines that are not UTF-8 refuse the input) or ``"replace"``.
      progress: a tqdm bar; ``None`` = when stderr is a terminal.
      info: the input's :func:`scan_input`, if already made.

    Raises:
      BulkInputError: ``chunk_lines < 1``, lines not UTF-8 under ``"strict"`` (named), or
        an unreadable input (:mod:`jaxformer.data.lines`).
      BulkResumeError: the parts folder belongs to other inputs or settings.
    """
    if chunk_lines < 1:   # the library's entry (the tool's flag is checked by its schema)
        raise BulkInputError(f"chunk_lines must be at least 1, got {chunk_lines}.")
    info = info or scan_input(input_path)
    if info.bad_lines and errors == "strict":
        raise lines_lib.NotUtf8(str(input_path), info.bad_lines)
    job = BulkJob(output, {**record, "input_sha256": info.sha256, "input_bytes": info.size,
                           "chunk_lines": chunk_lines, "input_errors": errors})
    chunks = -(-info.lines // chunk_lines)
    finished = {i for i in range(chunks) if job.done(i)}
    if barrier is not None:   # nobody writes a chunk before every process has listed them
        barrier("bulk: listed")
    report = BulkReport(lines=info.lines, chunks=chunks, resumed_chunks=len(finished),
                        processes=process_count)
    start = time.perf_counter()
    _decode_share(translate_chunk, input_path, job, report, info, finished, chunk_lines=chunk_lines,
                  errors=errors, progress=progress, process_index=process_index, process_count=process_count)
    if barrier is not None:
        barrier("bulk: decoded")
        if process_index == 0:   # the whole cluster's counts, from the chunks' records
            report = BulkReport(lines=info.lines, chunks=chunks, resumed_chunks=len(finished),
                                processes=process_count)
            for index in sorted(set(range(chunks)) - finished):
                report.add(min(chunk_lines, info.lines - index * chunk_lines), job.counts(index))
    report.seconds = time.perf_counter() - start
    if process_index == 0:
        job.finish(chunks)
    if barrier is not None:   # nobody returns (and may start over) before the file is whole
        barrier("bulk: joined")
    return report


def _decode_share(translate_chunk: ChunkTranslator, input_path: str | Path, job: BulkJob,
                  report: BulkReport, info: InputInfo, finished: set[int], *, chunk_lines: int,
                  errors: str, progress: bool | None, process_index: int, process_count: int) -> None:
    """Decodes this process's unfinished chunks into ``job``, counted in ``report``."""
    from tqdm import tqdm

    mine = range(process_index, report.chunks, process_count)
    bar = tqdm(total=sum(min(chunk_lines, info.lines - i * chunk_lines) for i in mine), unit="lines",
               dynamic_ncols=True, smoothing=0.1, leave=False,
               disable=None if progress is None else not progress)
    bad = set(info.bad_lines)
    try:
        for index, lines in enumerate(read_chunks(input_path, chunk_lines, errors)):
            if index % process_count != process_index:
                continue
            if index not in finished:
                first = index * chunk_lines
                text, counts = translate_chunk(lines, first, index)
                counts = {**counts, "replaced": sum(first < n <= first + len(lines) for n in bad)}
                job.write(index, text, counts)
                report.add(len(lines), counts)
            bar.update(len(lines))
    finally:
        bar.close()
