"""Tagged back-translation (Sennrich et al. 2016; Caswell et al. 2019): ``--bt-file`` pairs of
a machine-translated source and a real target (e.g. ``paste`` of bulk translation's output and
input) join training, each source starting with the id of :data:`BT_TAG` (a control piece no
text encodes to), through the real pairs' length filters; ``--bt-ratio R`` takes R per real
pair (whole copies, then a seeded sample without replacement), no ratio each once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxformer.data.corpus import DataReport, Pair, PairFiles, describe_file
from jaxformer.data.lines import chunks
from jaxformer.data.tokenizer import BT_TAG, TextTokenizer, Tokenizer
from jaxformer.run.logs import log

Encoder = Callable[[TextTokenizer, list[Pair]], tuple[list[list[int]], list[list[int]]]]

CHUNK_PAIRS = 20_000
MAX_REPEATS = 100   # copies of one synthetic pair --bt-ratio may ask for


def tag_id(tokenizer: TextTokenizer) -> int:
    """The id of :data:`BT_TAG`, a control piece of ``tokenizer``. Raises ValueError: the tokenizer
    has none (trained without ``--bt-file``, or Marian's)."""
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
    """uint32 ``[available]`` uses of each pair, summing to ``wanted``: ``wanted // available``
    each, plus one for a seeded sample of ``wanted % available`` without replacement."""
    rng = np.random.default_rng(seed)
    counts = np.full(available, wanted // available, np.uint32)
    counts[rng.choice(available, wanted % available, replace=False)] += 1
    return counts


@dataclasses.dataclass
class BackTranslationMix:
    """The synthetic pairs of ``path`` chosen for ``real_pairs`` real ones at ``ratio``, in file
    order, as a data source (:class:`jaxformer.data.sources.DataSource`; the position counts
    the pairs given).

    Raises (from :meth:`records`, before the first pair):
      ValueError: no usable pair, or a ratio that chooses none or over ``MAX_REPEATS`` copies.
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
        """The file, the ratio and the tag (the data fingerprint's ``back_translation``)."""
        return {"file": describe_file(self.path), "ratio": self.ratio, "tag": BT_TAG}

    def get_state(self) -> dict[str, int]:
        return {"pairs": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        self.position = int(state["pairs"])


def append(path: str, ratio: float | None, tokenizer: TextTokenizer, writer: Any, real_pairs: int, seed: int,
           encode: Encoder) -> dict[str, Any]:
    """Appends ``path``'s :class:`BackTranslationMix`, encoded, sources tagged, through
    ``writer`` (a :class:`jaxformer.data.prepare.IdWriter`) a chunk at a time; returns the
    manifest's counts (``read``, ``chosen``, ``kept``, ``ratio``, ``tag_id``). Raises
    ValueError: see :func:`tag_id` and :class:`BackTranslationMix`."""
    tag = tag_id(tokenizer)
    mix = BackTranslationMix(path, ratio, real_pairs, seed)
    kept = 0
    for chunk in chunks(mix.records(), CHUNK_PAIRS):
        src, tgt = encode(tokenizer, chunk)
        kept += writer.write([[tag, *ids] for ids in src], tgt)
    log(f"prepare: back-translation: {mix.report.summary(path)}; {mix.chosen} synthetic pairs "
        f"chosen for {real_pairs} real ones (ratio {mix.chosen / max(real_pairs, 1):.2f}), {kept} kept "
        f"after the length filters, sources tagged {BT_TAG} (id {tag})")
    return {"read": mix.report.kept, "chosen": mix.chosen, "kept": kept, "ratio": ratio,
            "tag_id": tag}
