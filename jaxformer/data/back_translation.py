"""Tagged back-translation: synthetic pairs beside the real ones (``--bt-file``).

Back-translation (Sennrich et al. 2016, "Improving Neural Machine Translation Models
with Monolingual Data") trains on pairs whose source is a machine translation of real
target-language text; tagged back-translation (Caswell et al. 2019) marks those
sources with a tag so the model tells them from real ones. Here the synthetic pairs
come as a TSV file (synthetic source, real target), e.g. made by bulk translation::

    jaxformer-translate --workdir runs/de-en --input mono.de --output mono.bt.en
    paste mono.bt.en mono.de > bt.tsv
    python train.py --train-file real.tsv --bt-file bt.tsv --bt-ratio 1

Each synthetic source gets the tag :data:`BT_TAG` as its first id: a reserved piece
(a sentencepiece control symbol) of the run's tokenizer, so no real text ever
encodes to it and decoding drops it. Synthetic pairs go to training only (never to
dev or test), through the same length filters as the real ones, appended to the
prepared id files; the per-epoch shuffle of :mod:`jaxformer.data.streaming` mixes them.

``--bt-ratio R`` sets how many synthetic pairs there are per real training pair: the
synthetic pairs are sampled without replacement when there are more than ``R`` × the
real count, and repeated (whole copies, then a sample for the rest) when fewer; no
ratio takes each once. The choice is seeded and the file, ratio and tag are in the
data's fingerprint, so a run never continues on other synthetic data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxformer.data import corpus
from jaxformer.data.corpus import DataReport, Pair
from jaxformer.data.tokenizer import BT_TAG, TextTokenizer, Tokenizer
from jaxformer.run.logs import log

if TYPE_CHECKING:
    from jaxformer.data.spec import DataSpec

Encoder = Callable[[TextTokenizer, list[Pair]], tuple[list[list[int]], list[list[int]]]]

CHUNK_PAIRS = 20_000
MAX_REPEATS = 100   # copies of one synthetic pair --bt-ratio may ask for


def tag_id(tokenizer: TextTokenizer) -> int:
    """The id of :data:`BT_TAG` in ``tokenizer``.

    Raises:
      ValueError: the tokenizer has no reserved tag: one trained without ``--bt-file``,
        or an imported (Marian) vocabulary, which has none.
    """
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"--bt-file needs the tag {BT_TAG!r} as a reserved piece of the tokenizer, and "
                         f"the --init-from model's {type(tokenizer).__name__} vocabulary has none; "
                         f"fine-tune it on the synthetic pairs without a tag (add them to --train-file) "
                         f"or train a new run with --bt-file.")
    return tokenizer.reserved_id(BT_TAG)


def multiplicities(available: int, wanted: int, seed: int) -> np.ndarray:
    """How many times each of ``available`` synthetic pairs is used so that ``wanted``
    are used in all: ``wanted // available`` whole copies of each, plus one more for a
    sample of ``wanted % available`` of them without replacement (numpy's seeded
    generator). Returns uint32 ``[available]`` summing to ``wanted``."""
    rng = np.random.default_rng(seed)
    counts = np.full(available, wanted // available, np.uint32)
    counts[rng.choice(available, wanted % available, replace=False)] += 1
    return counts


def append(spec: DataSpec, tokenizer: TextTokenizer, writer: Any, real_pairs: int, seed: int,
           encode: Encoder) -> dict[str, Any]:
    """Encodes ``spec.bt_file``'s pairs with ``encode`` (:func:`jaxformer.data.prepare.encode_pairs`),
    tags their sources, repeats or samples them to ``spec.bt_ratio`` × ``real_pairs`` and
    appends them through ``writer`` (a :class:`jaxformer.data.prepare.IdWriter`, which
    applies the length filters). Reads the file twice as a stream (count, then write).

    Returns:
      counts for the manifest: ``read`` (usable pairs in the file), ``chosen`` (after
      the ratio), ``kept`` (after the length filters), ``ratio``, ``tag_id``.

    Raises:
      ValueError: the tokenizer has no tag (:func:`tag_id`), the file has no usable pair,
        or the ratio would repeat each synthetic pair more than ``MAX_REPEATS`` times.
    """
    tag = tag_id(tokenizer)
    report = DataReport()
    available = sum(1 for _ in corpus.iter_tsv(spec.bt_file, report))
    if not available:
        raise ValueError(f"--bt-file {spec.bt_file} has no usable pair ({report.summary('bt file')}); "
                         f"it must hold synthetic-source<TAB>real-target lines.")
    report.kept = available
    wanted = available if spec.bt_ratio is None else round(spec.bt_ratio * real_pairs)
    if not wanted:
        raise ValueError(f"--bt-ratio {spec.bt_ratio:g} chooses no synthetic pair for {real_pairs} real "
                         f"training pairs; raise it (e.g. 1 = as many synthetic pairs as real ones) or "
                         f"leave it out to use each of the {available} pairs once.")
    if wanted > MAX_REPEATS * available:   # e.g. --bt-ratio 1e9: a disk-filling file, not a mix
        raise ValueError(f"--bt-ratio {spec.bt_ratio:g} asks for {wanted:,} synthetic pairs from the "
                         f"{available:,} of --bt-file {spec.bt_file}: each repeated "
                         f"{wanted / available:,.1f} times on average (at most {MAX_REPEATS}). Lower "
                         f"--bt-ratio or give more synthetic pairs.")
    counts = multiplicities(available, wanted, seed) if wanted != available else None
    kept, index, chunk = 0, 0, []

    def flush() -> int:
        src, tgt = encode(tokenizer, chunk)
        return writer.write([[tag, *ids] for ids in src], tgt)

    for pair in corpus.iter_tsv(spec.bt_file, DataReport()):
        for _ in range(1 if counts is None else int(counts[index])):   # memory: one chunk at most
            chunk.append(pair)
            if len(chunk) >= CHUNK_PAIRS:
                kept, chunk = kept + flush(), []
        index += 1
    if chunk:
        kept += flush()
    log(f"prepare: back-translation: {report.summary(spec.bt_file)}; {wanted} synthetic pairs "
        f"chosen for {real_pairs} real ones (ratio {wanted / max(real_pairs, 1):.2f}), {kept} kept after "
        f"the length filters, sources tagged {BT_TAG} (id {tag})")
    return {"read": available, "chosen": wanted, "kept": kept, "ratio": spec.bt_ratio, "tag_id": tag}
