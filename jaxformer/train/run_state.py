"""What a training run holds between its phases (:mod:`jaxformer.train.trainer` builds it,
:mod:`jaxformer.train.run_eval` evaluates with it): the run's parts (:class:`Run`), its
data (:class:`TrainData`) and the host loop's state (:class:`LoopState`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

from jaxformer.data.batching import Examples
from jaxformer.data.corpus import Pair
from jaxformer.data.streaming import BatchStream
from jaxformer.data.tokenizer import Tokenizer
from jaxformer.decode.evaluation import Evaluator
from jaxformer.model import sharding as sharding_lib
from jaxformer.model.transformer import Transformer
from jaxformer.run.checkpoints import RunCheckpoints
from jaxformer.run.config import TrainConfig
from jaxformer.run.directory import RunDir
from jaxformer.run.metrics import MetricsLog
from jaxformer.train.early_stopping import EarlyStopping
from jaxformer.train.programs import RunPrograms
from jaxformer.train.step import TrainState


class TrainingDiverged(RuntimeError):
    """Every update of a logging window had a non-finite loss or gradient norm."""


@dataclasses.dataclass
class TrainData:
    """The data of a run: the dev/test pairs (text), the training pipeline and the dev examples."""

    splits: dict[str, list[Pair]]   # "dev", "test"
    target_language: str
    iterator: BatchStream   # get_state / set_state: the position, saved with each checkpoint
    dev_examples: Examples


@dataclasses.dataclass
class Run:
    """Everything :func:`setup` builds and the later phases use."""

    cfg: TrainConfig
    run_dir: RunDir
    data: TrainData
    tokenizer: Tokenizer
    programs: RunPrograms   # model, schedule, layout and jitted programs (kept across runs)
    state: TrainState
    checkpoints: RunCheckpoints
    evaluator: Evaluator
    metrics_log: MetricsLog
    dropout_key: jax.Array
    num_params: int
    best_bleu: float   # -1 before the first evaluation
    t_start: float
    matmul_flop_rate: float = 0.0   # FLOP/s of a float32 2048³ matmul at the start (README's speed)
    closed: bool = False
    early_stopping: EarlyStopping | None = None   # set from --patience in train_loop

    @property
    def model(self) -> Transformer:
        return self.programs.model

    @property
    def schedule(self) -> optax.Schedule:
        return self.programs.schedule

    @property
    def layout(self) -> sharding_lib.Layout:
        return self.programs.layout

    @property
    def eval_step(self) -> Callable:
        """The jitted teacher-forced dev-loss step (sums)."""
        return self.programs.eval_step

    def close(self) -> None:
        """Waits for pending checkpoint saves and closes the writers (idempotent)."""
        if not self.closed:
            self.closed = True
            self.checkpoints.wait()
            self.checkpoints.close()
            self.metrics_log.close()
            self.data.iterator.close()   # stops the data worker processes, if any


@dataclasses.dataclass
class LoopState:
    """The host loop's state between steps."""

    step: int
    totals: dict[str, Any] | None = None   # device sums since the last logged step
    last_log_time: float = 0.0
    recent_skips: float = 0.0   # updates skipped as non-finite in the last logged window
    stopped_by: str = "max_steps"

    def skips_pending(self) -> float:
        """Updates skipped as non-finite since the last clean logging window: their
        parameters may be ruined, so they are neither checkpointed nor kept as the best.
        A host sync (reads the device sums): called only before a save or an evaluation."""
        pending = 0.0 if self.totals is None else float(jax.device_get(self.totals["skipped"]))
        return self.recent_skips + pending
