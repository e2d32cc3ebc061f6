"""The in-memory data path, kept as a reference for the tests (and the benchmarks' "old
path"): read the whole corpus, split it by the source hash, train sentencepiece on the
train split, tokenize every pair, and batch it with a grain pipeline.

The package trains from prepared data (:mod:`jaxformer.data.prepare`,
:mod:`jaxformer.data.streaming`); the tests check that it gives the same splits, ids and
batches as this simple twin.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grain
import jax

from jaxformer.data import batching, corpus
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.data.corpus import Pair
from jaxformer.run.logs import log

if TYPE_CHECKING:
    from jaxformer.run.config import TrainConfig


def split_pairs(pairs: Sequence[Pair], dev_size: int = 1000, test_size: int = 1000
                ) -> dict[str, list[Pair]]:
    """Deterministic train/dev/test split by hashing the source sentence (its
    :class:`jaxformer.data.corpus.Splitter`).

    A source sentence always lands in the same split, so a duplicated source can
    never sit in both train and test. The expected dev and test sizes are
    ``dev_size`` and ``test_size`` (exact counts vary slightly with the hash).

    Raises:
      ValueError: a split would be empty (too small a corpus).
    """
    splitter = corpus.Splitter.for_size(len(pairs), dev_size, test_size)
    splits: dict[str, list[Pair]] = {"train": [], "dev": [], "test": []}
    for pair in pairs:
        splits[splitter(pair[0])].append(pair)
    corpus.check_splits_nonempty({k: len(v) for k, v in splits.items()}, len(pairs))
    return splits


def load_splits(cfg: TrainConfig) -> tuple[dict[str, list[Pair]], str]:
    """Reads the corpus named by ``cfg`` and splits it; prints the data report.

    Args:
      cfg: the run settings (``train_file``, ``src_file``/``tgt_file``, ``dev_file``,
        ``test_file``, ``pair``).

    Returns:
      ``(splits, target_language)``: ``{"train", "dev", "test"}`` → pairs, and the
      target language code (``"xx"`` for a user's own corpus).

    Raises:
      ValueError: conflicting corpus flags, an unusable corpus or an empty split.
      FileNotFoundError / PermissionError: a missing or unreadable file.
    """
    if cfg.data.train_file and (cfg.data.src_file or cfg.data.tgt_file):
        raise ValueError("Give either --train-file or --src-file/--tgt-file, not both.")
    if bool(cfg.data.src_file) != bool(cfg.data.tgt_file):
        raise ValueError("--src-file and --tgt-file go together.")
    if cfg.data.train_file:
        pairs, report = corpus.read_tsv(cfg.data.train_file)
        name = cfg.data.train_file
    elif cfg.data.src_file:
        pairs, report = corpus.read_aligned(cfg.data.src_file, cfg.data.tgt_file)
        name = f"{cfg.data.src_file} + {cfg.data.tgt_file}"
    else:
        path = corpus.builtin_corpus_path(cfg.data.pair)
        pairs, report = corpus.read_tsv(path)
        name = f"shipped {cfg.data.pair} corpus (LibreOffice help, MPL-2.0)"
    log(report.summary(name))
    explicit = {}
    for split, path in (("dev", cfg.data.dev_file), ("test", cfg.data.test_file)):
        if path:
            explicit[split], rep = corpus.read_tsv(path)
            log(rep.summary(f"{split} file {path}"))
    splits = _split_with_explicit(pairs, explicit) if explicit else split_pairs(pairs)
    log("split: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))
    return splits, corpus.target_language_of(cfg)


def _split_with_explicit(pairs, explicit):
    """Explicit dev/test files replace the hashed split's; the rest goes to train, in corpus order."""
    splitter = corpus.Splitter.for_size(len(pairs), merged_into_train=tuple(explicit))
    splits: dict[str, list[Pair]] = {"train": [], "dev": [], "test": []}
    for pair in pairs:
        splits[splitter(pair[0])].append(pair)
    splits.update(explicit)
    corpus.check_splits_nonempty({k: len(v) for k, v in splits.items()}, len(pairs))
    return splits


def load_or_train_tokenizer(workdir: Path, train_pairs: Sequence[Pair],
                            vocab_size: int) -> tokenizer_lib.Tokenizer:
    """The run's tokenizer: loaded from ``workdir/tokenizer/spm.model`` or trained on the
    train split. In a multi-process run process 0 trains it and the others wait for the file.

    Raises:
      ValueError: the saved model is unreadable.
    """
    model_file = workdir / "tokenizer" / "spm.model"
    if jax.process_count() > 1:   # process 0 trains it; the others wait and load the same file
        from jax.experimental import multihost_utils

        if jax.process_index() == 0 and not model_file.exists():
            _train_tokenizer(model_file, train_pairs, vocab_size)
        multihost_utils.sync_global_devices("tokenizer")
    if model_file.exists():
        return tokenizer_lib.Tokenizer(model_file)
    return _train_tokenizer(model_file, train_pairs, vocab_size)


def _train_tokenizer(model_file: Path, train_pairs: Sequence[Pair],
                     vocab_size: int) -> tokenizer_lib.Tokenizer:
    start = time.perf_counter()
    sentences = [s for pair in train_pairs for s in pair]
    tokenizer = tokenizer_lib.Tokenizer.train(sentences, model_file.parent, vocab_size=vocab_size)
    log(f"trained sentencepiece ({tokenizer.vocab_size} pieces) in {time.perf_counter() - start:.1f}s")
    return tokenizer


def train_dataset(examples: batching.Examples, *, batch_tokens: int, boundaries: Sequence[int], seed: int,
                  pad_id: int, bos_id: int, eos_id: int, row_multiple: int = 1,
                  process_index: int = 0, process_count: int = 1, pack: bool = False
                  ) -> grain.IterDataset:
    """An endless, deterministic, checkpointable grain pipeline of padded batches.

    Batches are formed once, by :func:`jaxformer.data.batching.bucket_batches` or, with ``pack``, by
    :func:`jaxformer.data.batching.pack_batches` into rows of the last boundary (one shape, a few per cent of
    padding; the batches then carry segment ids). Grain shuffles their order anew
    every epoch. ``iter(dataset)`` has ``get_state``/``set_state`` for checkpointing
    (see :mod:`jaxformer.run.checkpoints`).

    Multi-process runs: every process plans the same global batches (same seed,
    same order, so all processes step through the same shapes in lockstep) but
    collates only its own contiguous block of rows, ``rows / process_count`` of them;
    :func:`jaxformer.model.sharding.shard_batch` assembles the global batch.

    Raises:
      ValueError: ``row_multiple`` is not a multiple of ``process_count``.
    """
    if not 0 <= process_index < process_count or row_multiple % process_count:
        raise ValueError(f"process {process_index} of {process_count}: row_multiple={row_multiple} "
                         f"must be a multiple of the process count.")
    if pack:
        batches = batching.pack_batches(examples, batch_tokens, boundaries[-1], seed, row_multiple)
    else:
        batches = batching.bucket_batches(examples, batch_tokens, boundaries, seed, row_multiple)
    build_batch = batching.collate_packed if pack else batching.collate

    def build(item):
        length, indices = item
        share = len(indices) // process_count
        indices = indices[process_index * share:(process_index + 1) * share]
        return build_batch(examples, length, indices, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)

    return (grain.MapDataset.source(batches).seed(seed).shuffle().repeat(None).map(build)
            .to_iter_dataset())
