"""What the data of a run is (:class:`DataSpec`): its corpus files and every setting that
changes the ids, read from the run's flags, and its fingerprint."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jaxformer.data import corpus
from jaxformer.data.corpus import DataReport, PairFiles, describe_file
from jaxformer.data.back_translation import BackTranslationMix
from jaxformer.data.prepared import FORMAT_VERSION

if TYPE_CHECKING:
    from jaxformer.run.config import TrainConfig


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

        Raises:
          ValueError: conflicting corpus flags.
        """
        if (cfg.train_file and (cfg.src_file or cfg.tgt_file)) or bool(cfg.src_file) != bool(cfg.tgt_file):
            raise ValueError("Give either --train-file or --src-file with --tgt-file, not both; "
                             "--src-file and --tgt-file go together.")
        common = dict(dev_file=cfg.dev_file, test_file=cfg.test_file, vocab_size=cfg.vocab_size,
                      max_length_ratio=cfg.max_length_ratio, bt_file=cfg.bt_file, bt_ratio=cfg.bt_ratio)
        if cfg.train_file:
            return cls((cfg.train_file,), name=cfg.train_file, **common)
        if cfg.src_file:
            return cls((cfg.src_file, cfg.tgt_file), aligned=True,
                       name=f"{cfg.src_file} + {cfg.tgt_file}", **common)
        return cls((str(corpus.builtin_corpus_path(cfg.pair)),),
                   name=f"shipped {cfg.pair} corpus (LibreOffice help, MPL-2.0)", **common)

    def source(self, report: DataReport | None = None) -> PairFiles:
        """The corpus as a data source (its pairs counted in ``report``)."""
        return PairFiles(self.corpus_files, report or DataReport())

    def explicit_splits(self) -> dict[str, str]:
        """The held-out splits given as files (``--dev-file``, ``--test-file``)."""
        return {name: path for name, path in (("dev", self.dev_file), ("test", self.test_file)) if path}

    def fingerprint(self) -> dict[str, Any]:
        """Every input file's :func:`jaxformer.data.corpus.describe_file` and the settings that
        change the ids: what ``prepared/manifest.json`` and the run record keep (its keys and
        values never change, so old runs still resume).

        Raises:
          FileNotFoundError: an input file is missing; ValueError: one is a folder, pipe or device.
        """
        def describe(path: str | None) -> dict[str, Any] | None:
            return None if path is None else describe_file(path)

        fingerprint = {"format_version": FORMAT_VERSION, "corpus": self.source().fingerprint(),
                       "aligned": self.aligned, "dev_file": describe(self.dev_file),
                       "test_file": describe(self.test_file), "vocab_size": self.vocab_size,
                       "max_tokens": self.max_tokens, "max_length_ratio": self.max_length_ratio}
        if self.bt_file:   # only then: runs without synthetic data keep their fingerprints
            fingerprint["back_translation"] = BackTranslationMix(self.bt_file, self.bt_ratio, 0).fingerprint()
        return fingerprint
