"""Early stopping on dev BLEU (``--patience N``), as fairseq's ``--patience`` and
OpenNMT's ``-early_stopping``: stop after N evaluations in a row without a better score.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class EarlyStopping:
    """Counts evaluations since the best dev score.

    Attributes:
      patience: evaluations without improvement that stop the run (at least 1:
        ``--patience`` checks it); ``None`` = never stop.
      best: the best score seen (``-inf`` before the first).
      since_best: evaluations since ``best`` was set.

    A resumed run starts counting again from the best score recorded with the best
    checkpoint (``best``), so a restart never stops a run early by itself.
    """

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
