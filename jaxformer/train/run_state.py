"""What a training run holds between its phases: the :class:`Run` setup opened on its plan
(closed once, by its exit stack) and the host loop's :class:`LoopState`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax

from jaxformer.data.batching import Examples
from jaxformer.data.corpus import Pair
from jaxformer.data.streaming import BatchStream
from jaxformer.data.tokenizer import Tokenizer
from jaxformer.decode.evaluation import Evaluator
from jaxformer.run.checkpoints import RunCheckpoints
from jaxformer.run.config import TrainConfig
from jaxformer.run.directory import RunDir
from jaxformer.run.metrics import MetricsLog
from jaxformer.train.plan import RunPlan
from jaxformer.train.programs import RunPrograms
from jaxformer.train.step import TrainState


class TrainingDiverged(RuntimeError):
    """Every update of a logging window had a non-finite loss or gradient norm."""


@dataclasses.dataclass
class TrainData:
    """The data of a run: the dev/test pairs (text), the training pipeline and the dev examples."""

    splits: dict[str, list[Pair]]   # "dev", "test"
    iterator: BatchStream   # a DataSource (jaxformer.data.sources): records, fingerprint, position
    dev_examples: Examples


@dataclasses.dataclass(frozen=True)
class Run:
    """What :func:`jaxformer.train.run_setup.setup` opened for a plan."""

    plan: RunPlan
    programs: RunPrograms
    data: TrainData
    tokenizer: Tokenizer
    checkpoints: RunCheckpoints
    evaluator: Evaluator
    metrics_log: MetricsLog
    dropout_key: jax.Array   # the run's root key; step s drops out with fold_in(key, s)
    closer: contextlib.ExitStack

    @property
    def cfg(self) -> TrainConfig:
        return self.plan.cfg

    @property
    def run_dir(self) -> RunDir:
        return self.plan.run_dir

    def close(self) -> None:
        """Waits for pending checkpoint saves and closes everything opened (idempotent)."""
        self.closer.close()


@dataclasses.dataclass
class EarlyStopping:
    """Early stopping on dev BLEU (``--patience``, as fairseq's): counts evaluations since
    the best score ``best`` (a resume starts from its best checkpoint's); ``patience`` of
    them in a row stop the run (``None``: never)."""

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


@dataclasses.dataclass
class OverfitWatch:
    """The dev NLL's rises in a row (``--stop-on-overfit``): ``rises`` evaluations since ``base``,
    the last ``(step, nll)`` that did not rise above the one before it; ``last``: the latest."""

    rises: int = 0
    base: tuple[int, float] | None = None
    last: tuple[int, float] | None = None

    def update(self, step: int, nll: float) -> int:
        """Records one evaluation's dev NLL; returns the rises in a row that end with it."""
        if self.last is not None and nll > self.last[1]:
            self.rises += 1
        else:
            self.rises, self.base = 0, (step, nll)
        self.last = (step, nll)
        return self.rises


@dataclasses.dataclass
class LoopState:
    """The host loop's state between steps: the train state and what the loop counts."""

    step: int
    state: TrainState
    best_bleu: float = -1.0   # dev BLEU of the best checkpoint; -1 before the first evaluation
    totals: dict[str, Any] | None = None   # device sums since the last logged step
    last_log_time: float = 0.0
    recent_skips: float = 0.0   # updates skipped as non-finite in the last logged window
    stopped_by: str = "max_steps"
    early_stopping: EarlyStopping = dataclasses.field(default_factory=lambda: EarlyStopping(None))
    overfit: OverfitWatch = dataclasses.field(default_factory=OverfitWatch)   # dev NLL's rises

    def skips_pending(self) -> float:
        """Updates skipped as non-finite since the last clean window (their parameters are neither
        checkpointed nor kept as the best); a host sync."""
        pending = 0.0 if self.totals is None else float(jax.device_get(self.totals["skipped"]))
        return self.recent_skips + pending
