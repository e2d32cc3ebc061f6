"""Prepare once: the data of a run (:class:`DataSpec`: its corpus and every setting that
changes the ids) streamed into token ids on disk (``jaxformer-prepare``, or ``train.py``
when the run has none), the corpus read twice, never whole: (1) count the usable pairs
and keep a reservoir sample (:func:`first_pass`, whose :class:`~jaxformer.run.recipe.CorpusShape`
the recipe rule reads first), on which sentencepiece is trained (unless the run has a
tokenizer); (2) split by the hash of the source (:class:`jaxformer.data.corpus.Splitter`),
encode the training pairs in chunks on all cores, filter them
(:func:`jaxformer.data.batching.length_filter` with ``max_tokens`` and
``max_length_ratio``) and append their ids (:mod:`jaxformer.data.prepared`), then the
back-translated pairs. Everything, a new tokenizer included, is written beside the run's
files and renamed into place when complete, so a failed or killed prepare leaves the run
as it was.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxformer.data import back_translation, corpus
from jaxformer.data.batching import length_filter
from jaxformer.data.corpus import DataReport, Pair, PairFiles, Splitter, describe_file
from jaxformer.data.lines import chunks
from jaxformer.data.prepared import FORMAT_VERSION, file_digest, tokenizer_digest
from jaxformer.data.tokenizer import BT_TAG, TextTokenizer, Tokenizer
from jaxformer.run.logs import log
from jaxformer.run.recipe import CorpusShape

if TYPE_CHECKING:
    from jaxformer.run.config import TrainConfig

SAMPLE_PAIRS = 100_000      # tokenizer sample: 200k sentences, sentencepiece's input_sentence_size
CHUNK_PAIRS = 20_000        # pairs encoded per sentencepiece call
PENDING_TOKENIZER = "spm.model.new"   # a new tokenizer, in prepared/ until it is moved in


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The corpus (``corpus_files``: one TSV file, or source and target files when
    ``aligned``) and the settings that change the ids; ``bt_file``: synthetic pairs added
    to training, tagged, ``bt_ratio`` per real one (:mod:`jaxformer.data.back_translation`)."""

    corpus_files: tuple[str, ...]
    aligned: bool = False
    dev_file: str | None = None
    test_file: str | None = None
    vocab_size: int = 4000
    max_tokens: int = 1024
    max_length_ratio: float = 9.0
    name: str = ""
    bt_file: str | None = None
    bt_ratio: float | None = None       # None = each synthetic pair once

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> DataSpec:
        """The data a run's flags name (``--train-file``, ``--src-file``/``--tgt-file`` or ``--pair``).
        Raises ValueError: conflicting corpus flags."""
        d = cfg.data
        if (d.train_file and (d.src_file or d.tgt_file)) or bool(d.src_file) != bool(d.tgt_file):
            raise ValueError("Give either --train-file or --src-file with --tgt-file, not both; "
                             "--src-file and --tgt-file go together.")
        common = dict(dev_file=d.dev_file, test_file=d.test_file, vocab_size=d.vocab_size,
                      max_length_ratio=d.max_length_ratio, bt_file=d.bt_file, bt_ratio=d.bt_ratio)
        if d.train_file:
            return cls((d.train_file,), name=d.train_file, **common)
        if d.src_file:
            return cls((d.src_file, d.tgt_file), aligned=True, name=f"{d.src_file} + {d.tgt_file}", **common)
        return cls((str(corpus.builtin_corpus_path(d.pair)),),
                   name=f"shipped {d.pair} corpus (LibreOffice help, MPL-2.0)", **common)

    def source(self, report: DataReport | None = None) -> PairFiles:
        """The corpus as a data source (its pairs counted in ``report``)."""
        return PairFiles(self.corpus_files, report or DataReport())

    def explicit_splits(self) -> dict[str, str]:
        """The held-out splits given as files (``--dev-file``, ``--test-file``)."""
        return {name: path for name, path in (("dev", self.dev_file), ("test", self.test_file)) if path}

    def fingerprint(self) -> dict[str, Any]:
        """Every input file's :func:`jaxformer.data.corpus.describe_file` and the settings that change
        the ids: what ``prepared/manifest.json`` and the run record keep (its keys and values never
        change, so old runs still resume). Raises FileNotFoundError: an input file is missing;
        ValueError: one is a folder, pipe or device."""
        def describe(path: str | None) -> dict[str, Any] | None:
            return None if path is None else describe_file(path)

        fingerprint = {"format_version": FORMAT_VERSION, "corpus": self.source().fingerprint(),
                       "aligned": self.aligned, "dev_file": describe(self.dev_file),
                       "test_file": describe(self.test_file), "vocab_size": self.vocab_size,
                       "max_tokens": self.max_tokens, "max_length_ratio": self.max_length_ratio}
        if self.bt_file:   # only then: runs without synthetic data keep their fingerprints
            mix = back_translation.BackTranslationMix(self.bt_file, self.bt_ratio, 0)
            fingerprint["back_translation"] = mix.fingerprint()
        return fingerprint


@dataclasses.dataclass(frozen=True)
class FirstPass:
    """Prepare's first read of a corpus (:func:`first_pass`): ``n`` usable pairs, the
    ``splitter`` their number gives, ``train_sample`` (the training pairs of a uniform sample
    of :data:`SAMPLE_PAIRS`: sentencepiece's input) and ``shape``, the training pairs'
    :class:`CorpusShape` (exact up to :data:`SAMPLE_PAIRS` pairs; above, the sample's counts
    scaled to the corpus, its alphabet the one sentencepiece sees)."""

    n: int
    splitter: Splitter
    train_sample: list[Pair]
    shape: CorpusShape
    seconds: float


def first_pass(spec: DataSpec, seed: int = 0) -> FirstPass:
    """Reads ``spec``'s corpus once, streamed: its :class:`FirstPass` (``seed``: the sample's).
    Raises OSError: an unreadable input."""
    start = time.perf_counter()
    n, sample = _count_and_sample(spec.source().records(), SAMPLE_PAIRS, seed)
    splitter = Splitter.for_size(n, merged_into_train=tuple(spec.explicit_splits()))
    train = [pair for pair in sample if splitter(pair[0]) == "train"]
    shape = CorpusShape.of(train)
    if n > len(sample):   # a sample of a larger corpus: its counts scaled to the whole
        scale = n / len(sample)
        shape = dataclasses.replace(shape, pairs=round(shape.pairs * scale),
                                    characters=round(shape.characters * scale))
    return FirstPass(n, splitter, train, shape, time.perf_counter() - start)


def prepare(spec: DataSpec, directory: str | os.PathLike, tokenizer_file: str | os.PathLike,
            *, retrain_tokenizer: bool = False, seed: int = 0,
            tokenizer: TextTokenizer | None = None, first: FirstPass | None = None) -> dict[str, Any]:
    """Prepares ``spec``'s corpus into ``directory`` and returns the manifest written there.
    ``tokenizer_file``: the sentencepiece model, trained on the sample if missing or
    ``retrain_tokenizer``; ``tokenizer``: encode with this one instead (e.g. an ``--init-from``
    run's, in ``tokenizer_file``); ``seed``: the sample's and the mix's; ``first``: the corpus's
    :func:`first_pass` with this ``seed``, if read already (the recipe rule's). Raises
    ValueError: no usable pair, or an empty split. OSError: an unreadable input."""
    start = time.perf_counter()
    directory, tokenizer_file = Path(directory), Path(tokenizer_file)
    fingerprint = spec.fingerprint()
    first = first or first_pass(spec, seed)
    n, splitter, shape = first.n, first.splitter, first.shape
    log(f"prepare: read {spec.name}: {n} pairs in {first.seconds:.0f}s")
    for stale in directory.parent.glob(f"{directory.name}.partial-*"):   # left by a killed prepare
        shutil.rmtree(stale, ignore_errors=True)
    tmp = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
    new_tokenizer = directory.with_name(f"{directory.name}.partial-{os.getpid()}-tokenizer")
    try:
        trained = None
        if tokenizer is None and (retrain_tokenizer or not tokenizer_file.exists()):
            tokenizer = trained = _train_tokenizer(spec, first.train_sample, n, new_tokenizer)
        elif tokenizer is None:
            tokenizer = Tokenizer(tokenizer_file)
        if spec.bt_file:
            back_translation.tag_id(tokenizer)   # refused before anything is written
        del first
        tmp.mkdir(parents=True)
        sha256 = tokenizer_digest(tokenizer_file if trained is None else new_tokenizer / "spm.model")
        manifest = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint, "name": spec.name,
                    "corpus_shape": dataclasses.asdict(shape),   # the recipe rule's, read again
                    **_write_splits(spec, splitter, tokenizer, tmp, n, seed, sha256),
                    "seconds": round(time.perf_counter() - start, 1)}
        if trained is not None:   # travels with the data: the rename below commits both
            shutil.move(new_tokenizer / "spm.model", tmp / PENDING_TOKENIZER)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    finally:
        for partial in (tmp, new_tokenizer):
            shutil.rmtree(partial, ignore_errors=True)
    finish_tokenizer_move(directory, tokenizer_file)
    log(f"prepare: {spec.name} → {directory}: {json.dumps(manifest['counts'])} in "
        f"{manifest['seconds']:.0f}s")
    return manifest


def finish_tokenizer_move(directory: Path, tokenizer_file: Path) -> None:
    """Moves the tokenizer a completed prepare left in ``directory`` to ``tokenizer_file`` (at
    the end of :func:`prepare`, or at the next start after a kill between the two)."""
    pending = Path(directory) / PENDING_TOKENIZER
    if pending.exists():
        Path(tokenizer_file).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(pending, tokenizer_file)   # a rename on one filesystem


def _train_tokenizer(spec: DataSpec, train_sample: list[Pair], n: int, model_dir: Path) -> Tokenizer:
    """A sentencepiece model trained on the sample's training pairs, into ``model_dir``."""
    t0 = time.perf_counter()
    sentences = [s for pair in train_sample for s in pair]
    if not sentences:   # sentencepiece would fail with an internal error instead
        corpus.check_splits_nonempty({"train": 0}, n)
    tokenizer = Tokenizer.train(sentences, model_dir, vocab_size=spec.vocab_size,
                                reserved=(BT_TAG,) if spec.bt_file else ())
    log(f"prepare: trained sentencepiece ({tokenizer.vocab_size} pieces) on {len(sentences)} "
        f"sampled sentences in {time.perf_counter() - t0:.0f}s")
    return tokenizer


def _count_and_sample(pairs: Iterator[Pair], size: int, seed: int) -> tuple[int, list[Pair]]:
    """The number of pairs and a uniform sample of ``size`` of them (reservoir sampling,
    Vitter's algorithm R); all of them, in order, when there are at most ``size``."""
    rng = random.Random(seed)
    sample: list[Pair] = []
    n = 0
    for n, pair in enumerate(pairs, start=1):
        if n <= size:
            sample.append(pair)
        elif (j := rng.randrange(n)) < size:
            sample[j] = pair
    return n, sample


def encode_pairs(tokenizer: TextTokenizer, pairs: list[Pair]) -> tuple[list[list[int]], list[list[int]]]:
    """Source and target ids of ``pairs`` (no bos/eos): sentencepiece on all cores (it releases
    the GIL), another tokenizer by its own source/target rules (Marian)."""
    if not isinstance(tokenizer, Tokenizer):
        return tokenizer.encode_source([p[0] for p in pairs]), tokenizer.encode_target([p[1] for p in pairs])
    threads = os.cpu_count() or 1
    return (tokenizer.sp.encode([p[0] for p in pairs], num_threads=threads),
            tokenizer.sp.encode([p[1] for p in pairs], num_threads=threads))


class IdWriter:
    """Appends encoded training pairs to ``train-src.bin``/``train-tgt.bin`` after the length
    filters, keeping their lengths and the counts dropped."""

    def __init__(self, out: Path, spec: DataSpec, dtype: np.dtype):
        self.spec, self.dtype = spec, dtype
        self.files = ((out / "train-src.bin").open("wb"), (out / "train-tgt.bin").open("wb"))
        self.dropped: collections.Counter = collections.Counter()   # by reason
        self.lengths: list[np.ndarray] = []

    def write(self, src: list[list[int]], tgt: list[list[int]]) -> int:
        """Filters and appends one chunk; returns how many pairs were kept."""
        src_len = np.fromiter(map(len, src), np.int64, len(src))
        tgt_len = np.fromiter(map(len, tgt), np.int64, len(tgt))
        keep, reasons = length_filter(src_len, tgt_len, self.spec.max_tokens, self.spec.max_tokens,
                                      self.spec.max_length_ratio)
        self.dropped.update(reasons)
        kept = np.flatnonzero(keep)
        for f, ids, side_len in zip(self.files, (src, tgt), (src_len, tgt_len)):
            rows = ids if len(kept) == len(ids) else [ids[i] for i in kept]
            f.write(np.fromiter(itertools.chain.from_iterable(rows), self.dtype,
                                int(side_len[kept].sum())).tobytes())
        self.lengths.append(np.stack([src_len[kept], tgt_len[kept]], axis=1))
        return len(kept)

    def close(self) -> np.ndarray:
        """Closes the files; returns the kept pairs' lengths ``[N, 2]`` (source, target)."""
        for f in self.files:
            f.close()
        return np.concatenate(self.lengths) if self.lengths else np.zeros((0, 2), np.int64)


def _write_splits(spec: DataSpec, splitter: Splitter, tokenizer: TextTokenizer, out: Path, n: int,
                  seed: int, tokenizer_sha256: str) -> dict[str, Any]:
    """The second pass into ``out``: dev/test pairs to TSV, training pairs encoded, filtered and
    appended, then the back-translated ones. Returns the manifest's entries about them."""
    vocab = max(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    dtype = "uint16" if vocab <= 1 << 16 else "int32"
    held: dict[str, list[Pair]] = {"dev": [], "test": []}
    report, writer = DataReport(), IdWriter(out, spec, np.dtype(dtype))
    try:   # chunk k is encoded in a thread while this one reads and splits chunk k + 1
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending, real = None, 0
            for chunk in chunks(spec.source(report).records(), CHUNK_PAIRS):
                train = []
                for pair in chunk:
                    name = splitter(pair[0])
                    (train if name == "train" else held[name]).append(pair)
                if train:
                    if pending is not None:
                        real += writer.write(*pending.result())
                    pending = pool.submit(encode_pairs, tokenizer, train)
            if pending is not None:
                real += writer.write(*pending.result())
        synthetic = (back_translation.append(spec.bt_file, spec.bt_ratio, tokenizer, writer, real, seed,
                                             encode_pairs) if spec.bt_file else None)
    finally:
        lengths = writer.close()
    np.save(out / "train-lengths.npy", lengths.astype(np.int32))
    report.kept = n
    log(report.summary(spec.name))
    for name, path in spec.explicit_splits().items():
        held[name], explicit = corpus.read_tsv(path)
        log(explicit.summary(f"{name} file {path}"))
    for name, pairs in held.items():
        _write_tsv(out / f"{name}.tsv", pairs)
    counts = {"train": len(lengths), "dev": len(held["dev"]), "test": len(held["test"]),
              "train_dropped": writer.dropped}
    if synthetic is not None:
        counts["back_translation"] = synthetic
    corpus.check_splits_nonempty({k: counts[k] for k in ("train", "dev", "test")}, n, dict(writer.dropped))
    bins = np.arange(0, spec.max_tokens + 8, 8)
    return {"tokenizer": {"sha256": tokenizer_sha256, "vocab_size": vocab}, "dtype": dtype,
            "read": dict(report.skipped, lines=report.read), "counts": counts,
            "length_histogram": {"bin_edges": bins.tolist(),
                                 **{side: np.histogram(lengths[:, i], bins)[0].tolist()
                                    for i, side in enumerate(("src", "tgt"))}},
            "files": {f.name: {"size": f.stat().st_size, "sha256": file_digest(f)}
                      for f in sorted(out.iterdir())}}


def _write_tsv(path: Path, pairs: list[Pair]) -> None:
    path.write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
