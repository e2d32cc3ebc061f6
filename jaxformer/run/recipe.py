"""The training recipe a corpus gets (issue 53): vocabulary size, dropout, attention dropout,
label smoothing and model shape, from statistics read before sentencepiece is trained.

No JAX here: ``jaxformer-prepare`` and the flag parser read it too.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

CHARACTER_COVERAGE = 0.9995   # sentencepiece's, as jaxformer.data.tokenizer trains it


@dataclasses.dataclass(frozen=True)
class CorpusShape:
    """What the rule reads of a training corpus: ``pairs``; ``characters`` on both sides;
    ``alphabet``, the distinct characters that cover :data:`CHARACTER_COVERAGE` of them
    (sentencepiece's required characters, each a piece of the vocabulary)."""

    pairs: int
    characters: int
    alphabet: int

    @property
    def mean_characters(self) -> float:
        """Characters per sentence, source and target alike."""
        return self.characters / max(2 * self.pairs, 1)

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str]]) -> CorpusShape:
        """The shape of ``(source, target)`` pairs, read once."""
        counts: collections.Counter[str] = collections.Counter()
        n = 0
        for src, tgt in pairs:
            counts.update(src)
            counts.update(tgt)
            n += 1
        total = sum(counts.values())
        covered = alphabet = 0
        for _, count in counts.most_common():
            if covered >= CHARACTER_COVERAGE * total:
                break
            covered += count
            alphabet += 1
        return cls(pairs=n, characters=total, alphabet=alphabet)

    def __str__(self) -> str:
        return (f"{self.pairs:,} pairs, {self.characters:,} characters ({self.mean_characters:.0f} per "
                f"sentence), alphabet {self.alphabet:,}")
