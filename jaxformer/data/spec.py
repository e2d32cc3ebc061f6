"""What the data of a run is: its corpus files and every setting that changes the ids
(:class:`DataSpec`), read from the run's flags, with its fingerprint. What is done with
it: :mod:`jaxformer.data.prepare` (writes it as ids) and :mod:`jaxformer.data.run_data`
(reuses, prepares or refuses).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from jaxformer.data import corpus
from jaxformer.data.corpus import DataReport, Pair, PairFiles, describe_file
from jaxformer.data.prepared import FORMAT_VERSION
from jaxformer.data.tokenizer import BT_TAG

if TYPE_CHECKING:
    from jaxformer.run.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What the data of a run is: the corpus files and every setting that changes the ids.

    ``corpus_files`` is one TSV file, or a source and a target file (``aligned``);
    ``bt_file`` a TSV file of synthetic pairs added to training with tagged sources, at
    ``bt_ratio`` synthetic pairs per real one (:mod:`jaxformer.data.back_translation`).
    """

    corpus_files: tuple[str, ...]
    aligned: bool = False
    dev_file: str | None = None
    test_file: str | None = None
    vocab_size: int = 4000
    max_tokens: int = 1024
    max_length_ratio: float = 9.0
    name: str = ""
    bt_file: str | None = None          # synthetic pairs, tagged (jaxformer.data.back_translation)
    bt_ratio: float | None = None       # synthetic pairs per real training pair; None = each once

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> DataSpec:
        """The data named by a run's flags (``--train-file``, ``--src-file``/``--tgt-file`` or
        ``--pair``).

        Raises:
          ValueError: conflicting corpus flags.
        """
        if (cfg.data.train_file and (cfg.data.src_file or cfg.data.tgt_file)) or bool(cfg.data.src_file) != bool(cfg.data.tgt_file):
            raise ValueError("Give either --train-file or --src-file with --tgt-file, not both; "
                             "--src-file and --tgt-file go together.")
        common = dict(dev_file=cfg.data.dev_file, test_file=cfg.data.test_file, vocab_size=cfg.data.vocab_size,
                      max_length_ratio=cfg.data.max_length_ratio, bt_file=cfg.data.bt_file, bt_ratio=cfg.data.bt_ratio)
        if cfg.data.train_file:
            return cls((cfg.data.train_file,), name=cfg.data.train_file, **common)
        if cfg.data.src_file:
            return cls((cfg.data.src_file, cfg.data.tgt_file), aligned=True,
                       name=f"{cfg.data.src_file} + {cfg.data.tgt_file}", **common)
        return cls((str(corpus.builtin_corpus_path(cfg.data.pair)),),
                   name=f"shipped {cfg.data.pair} corpus (LibreOffice help, MPL-2.0)", **common)

    def source(self, report: DataReport | None = None) -> PairFiles:
        """The corpus as a data source (its pairs counted in ``report``)."""
        return PairFiles(self.corpus_files, report or DataReport())

    def read(self, report: DataReport) -> Iterator[Pair]:
        """Streams the corpus's usable pairs (counted in ``report``)."""
        return self.source(report).records()

    def fingerprint(self) -> dict[str, Any]:
        """Every input file's path, size and SHA-256 (:func:`jaxformer.data.corpus.describe_file`),
        and the settings that change the ids: the value ``prepared/manifest.json`` and the run
        record keep, so its keys and values stay as they are.

        Raises:
          FileNotFoundError: an input file is missing; ValueError: one is a folder, pipe or device.
        """
        def describe(path: str | None) -> dict[str, Any] | None:
            return None if path is None else describe_file(path)

        fingerprint = {"format_version": FORMAT_VERSION, "corpus": self.source().fingerprint(),
                       "aligned": self.aligned, "dev_file": describe(self.dev_file),
                       "test_file": describe(self.test_file), "vocab_size": self.vocab_size,
                       "max_tokens": self.max_tokens, "max_length_ratio": self.max_length_ratio}
        if self.bt_file:   # only then: the fingerprints of runs without synthetic data are unchanged
            fingerprint["back_translation"] = {"file": describe(self.bt_file), "ratio": self.bt_ratio,
                                               "tag": BT_TAG}
        return fingerprint
