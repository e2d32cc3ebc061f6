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

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxformer.data.corpus import DataReport, Pair, PairFiles, describe_file
from jaxformer.data.tokenizer import BT_TAG, TextTokenizer, Tokenizer
from jaxformer.run.logs import log

if TYPE_CHECKING:
    from jaxformer.data.spec import DataSpec

Encoder = Callable[[TextTokenizer, list[Pair]], tuple[list[list[int]], list[list[int]]]]

CHUNK_PAIRS = 20_000
MAX_REPEATS = 100   # copies of one synthetic pair --bt-ratio may ask for


def tag_id(tokenizer: TextTokenizer) -> int:
    """The id of :data:`BT_TAG` in ``tokenizer``: a reserved piece (a sentencepiece control
    symbol), never produced by encoding text, dropped when decoding.

    Raises:
      ValueError: the tokenizer has no reserved tag: one trained without ``--bt-file``,
        or an imported (Marian) vocabulary, which has none.
    """
    sp = tokenizer.sp if isinstance(tokenizer, Tokenizer) else None
    piece_id = sp.piece_to_id(BT_TAG) if sp is not None else None
    if sp is None or piece_id == tokenizer.unk_id or not sp.is_control(piece_id):
        raise ValueError(f"{getattr(tokenizer, 'model_file', type(tokenizer).__name__)} has no reserved "
                         f"{BT_TAG!r} piece: it was trained without back-translation data, or is an "
                         f"imported (Marian) vocabulary. Start the run with --bt-file from the beginning "
                         f"(another --workdir, or --fresh), so its tokenizer reserves the tag; or "
                         f"fine-tune on the synthetic pairs without a tag (add them to --train-file).")
    return piece_id


def multiplicities(available: int, wanted: int, seed: int) -> np.ndarray:
    """How many times each of ``available`` synthetic pairs is used so that ``wanted``
    are used in all: ``wanted // available`` whole copies of each, plus one more for a
    sample of ``wanted % available`` of them without replacement (numpy's seeded
    generator). Returns uint32 ``[available]`` summing to ``wanted``."""
    rng = np.random.default_rng(seed)
    counts = np.full(available, wanted // available, np.uint32)
    counts[rng.choice(available, wanted % available, replace=False)] += 1
    return counts


@dataclasses.dataclass
class BackTranslationMix:
    """A data source (:class:`jaxformer.data.sources.DataSource`) of the synthetic pairs
    of ``path`` chosen for ``real_pairs`` real ones at ``ratio`` (see the module
    docstring), in file order; the position counts the pairs given.

    Raises (from :meth:`records`, before the first pair):
      ValueError: the file has no usable pair, or the ratio chooses none or more than
        ``MAX_REPEATS`` copies of each.
    """

    path: str
    ratio: float | None
    real_pairs: int
    seed: int = 0
    report: DataReport = dataclasses.field(default_factory=DataReport)
    position: int = 0
    chosen: int = 0   # pairs the ratio chooses (known once records() started)

    def records(self) -> Iterator[Pair]:
        available = sum(1 for _ in PairFiles((self.path,), self.report).records())   # a streamed count
        wanted = available if self.ratio is None else round(self.ratio * self.real_pairs)
        if not 1 <= wanted <= MAX_REPEATS * available:   # none, or a disk-filling file, not a mix
            raise ValueError(
                f"--bt-ratio {self.ratio:g} chooses no synthetic pair for {self.real_pairs} real training "
                f"pairs; raise it (e.g. 1 = as many synthetic pairs as real ones) or leave it out to use "
                f"each of the {available} pairs once." if not wanted else
                f"--bt-ratio {self.ratio:g} asks for {wanted:,} synthetic pairs from the {available:,} of "
                f"--bt-file {self.path}: each repeated {wanted / available:,.1f} times on average (at "
                f"most {MAX_REPEATS}). Lower --bt-ratio or give more synthetic pairs.")
        self.chosen = wanted
        counts = multiplicities(available, wanted, self.seed) if wanted != available else None
        given = 0
        for index, pair in enumerate(PairFiles((self.path,)).records()):
            for _ in range(1 if counts is None else int(counts[index])):
                given += 1
                if given > self.position:
                    self.position = given
                    yield pair

    def fingerprint(self) -> dict[str, Any]:
        """The file, the ratio and the tag: the ``back_translation`` entry of the data's fingerprint."""
        return {"file": describe_file(self.path), "ratio": self.ratio, "tag": BT_TAG}

    def get_state(self) -> dict[str, int]:
        return {"pairs": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        self.position = int(state["pairs"])


def append(spec: DataSpec, tokenizer: TextTokenizer, writer: Any, real_pairs: int, seed: int,
           encode: Encoder) -> dict[str, Any]:
    """Encodes the :class:`BackTranslationMix` of ``spec.bt_file`` with ``encode``
    (:func:`jaxformer.data.prepare.encode_pairs`), tags their sources and appends them
    through ``writer`` (a :class:`jaxformer.data.prepare.IdWriter`, which applies the
    length filters), a chunk at a time.

    Returns:
      counts for the manifest: ``read`` (usable pairs in the file), ``chosen`` (after
      the ratio), ``kept`` (after the length filters), ``ratio``, ``tag_id``.

    Raises:
      ValueError: the tokenizer has no tag (:func:`tag_id`), or see :class:`BackTranslationMix`.
    """
    tag = tag_id(tokenizer)
    mix = BackTranslationMix(spec.bt_file, spec.bt_ratio, real_pairs, seed)
    kept, chunk = 0, []

    def flush() -> int:
        src, tgt = encode(tokenizer, chunk)
        return writer.write([[tag, *ids] for ids in src], tgt)

    for pair in mix.records():   # memory: one chunk at most
        chunk.append(pair)
        if len(chunk) >= CHUNK_PAIRS:
            kept, chunk = kept + flush(), []
    if chunk:
        kept += flush()
    available, wanted = mix.report.kept, mix.chosen
    log(f"prepare: back-translation: {mix.report.summary(spec.bt_file)}; {wanted} synthetic pairs "
        f"chosen for {real_pairs} real ones (ratio {wanted / max(real_pairs, 1):.2f}), {kept} kept after "
        f"the length filters, sources tagged {BT_TAG} (id {tag})")
    return {"read": available, "chosen": wanted, "kept": kept, "ratio": spec.bt_ratio, "tag_id": tag}
