"""Early stopping on dev BLEU (``--patience N``, as fairseq's ``--patience``)."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class EarlyStopping:
    """Counts evaluations since the best score ``best`` (a resume starts from its best
    checkpoint's); ``patience`` of them in a row stop the run (``None``: never)."""

    patience: int | None
    best: float = -math.inf
    since_best: int = 0

    def update(self, score: float) -> bool:
        """Records one evaluation's score; returns ``True`` when the run should stop."""
        if score > self.best:
            self.best, self.since_best = score, 0
        else:
            self.since_best += 1
        return self.patience is not None and self.since_best >= self.patience
