"""A run's model, optimizer and jitted programs (:func:`run_programs`). They belong to the
run: each ``train()`` builds its own and drops them at its end; JAX's persistent cache
(``RUN/jax_cache``) spares a resume the compiles it made before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

from jaxformer.model.config import TransformerConfig
from jaxformer.model.sharding import Layout
from jaxformer.model.transformer import Transformer
from jaxformer.run.config import TrainConfig
from jaxformer.train.optimizer import make_optimizer, make_schedule
from jaxformer.train.step import (TrainState, jit_eval_step, jit_sharded_init, jit_state_from_params,
                                  jit_train_step)


@dataclasses.dataclass(frozen=True)
class RunPrograms:
    """What a run builds from its settings before it reads a checkpoint.

    Attributes:
      model: the :class:`Transformer`.
      schedule: the learning rate by update count (:mod:`jaxformer.train.optimizer`).
      tx: the optimizer (Adam on ``schedule``, clipped if asked).
      layout: the mesh and the train state's shardings.
      init: jitted ``init(rng) -> TrainState``, each array created in its shard.
      start_from: jitted ``start_from(params) -> TrainState``: step 0 and a fresh
        optimizer state around given parameters, donated (a fine-tune's start).
      abstract_state: the train state's ``jax.ShapeDtypeStruct`` tree with shardings: a
        resumed run restores into it without computing an initial state.
      train_step: jitted ``(state, batch, rng) -> (state, metrics)``, the state donated.
      eval_step: jitted ``(params, batch) -> metrics``, teacher-forced loss sums.
      decoders: the dev/test decoders jitted so far, by their settings; the run's
        :class:`jaxformer.decode.evaluation.Evaluator` fills it.
    """

    model: Transformer
    schedule: optax.Schedule
    tx: optax.GradientTransformation
    layout: Layout
    init: Callable[[jax.Array], TrainState]
    start_from: Callable[[Any], TrainState]
    abstract_state: Any
    train_step: Callable[..., Any]
    eval_step: Callable[..., Any]
    decoders: dict[Any, Any]

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree_util.tree_leaves(self.abstract_state.params))


def run_programs(cfg: TrainConfig, model_config: TransformerConfig, mesh: jax.sharding.Mesh) -> RunPrograms:
    """The programs of ``model_config`` on ``mesh`` with ``cfg``'s schedule (``--lr-schedule``,
    ``--warmup-steps``, ``--lr-scale``, ``--max-steps``, ``--decay-fraction``),
    ``--grad-clip``, ``--label-smoothing`` and ``--grad-accum-steps``. Nothing is compiled
    yet: each program compiles at its first call."""
    model = Transformer(model_config)
    schedule = make_schedule(cfg.train.lr_schedule, d_model=model_config.d_model, warmup_steps=cfg.train.warmup_steps,
                             total_steps=cfg.train.max_steps, decay_fraction=cfg.train.decay_fraction, scale=cfg.train.lr_scale)
    tx = make_optimizer(schedule, cfg.train.grad_clip)
    init, layout, abstract_state = jit_sharded_init(model, tx, mesh)
    return RunPrograms(model=model, schedule=schedule, tx=tx, layout=layout, init=init,
                       start_from=jit_state_from_params(model, tx, layout), abstract_state=abstract_state,
                       train_step=jit_train_step(model, cfg.train.label_smoothing, layout=layout,
                                                 grad_accum_steps=cfg.train.grad_accum_steps),
                       eval_step=jit_eval_step(model, cfg.train.label_smoothing, layout=layout), decoders={})
