"""A run's model, optimizer and jitted programs, built from its settings and kept for
the next run in the same process.

:func:`jaxformer.train.trainer.train` gets its model, learning-rate schedule,
optimizer, state layout and jitted programs (initialisation, a fine-tune's start,
train step, dev-loss step, dev/test decoders) from :func:`run_programs`. They depend on the run's settings
only, not on its data, seed or directory, so a second ``train()`` in one process with
the same settings (a resume in the same session, runs over other data or seeds, a
notebook, the test suite) reuses the same jitted functions: for every input shape met
before, JAX finds the program in its in-memory cache and neither traces, lowers nor
reads its persistent cache again (new shapes, e.g. other data's dev lengths, still
compile). On 2 CPU cores that was ~8 s of a 14 s tiny-preset run. The programs of the
:data:`KEPT` most recently used settings are kept, with their compiled code (on an
accelerator, device memory for programs); :func:`clear` drops them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import optax

from jaxformer.model.config import TransformerConfig
from jaxformer.model.sharding import Layout
from jaxformer.model.transformer import Transformer
from jaxformer.run.config import TrainConfig
from jaxformer.train.optimizer import make_optimizer, make_schedule
from jaxformer.train.step import (
    TrainState,
    jit_eval_step,
    jit_sharded_init,
    jit_state_from_params,
    jit_train_step,
)

KEPT = 4   # settings whose programs a process keeps


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
        optimizer state around given parameters, donated (a fine-tune's start; it
        computes no initial parameters beside the loaded ones).
      abstract_state: the train state's ``jax.ShapeDtypeStruct`` tree with shardings: a
        resumed run restores into it without computing an initial state (whose arrays
        would sit beside the restored ones: twice the state's memory at the peak).
      train_step: jitted ``(state, batch, rng) -> (state, metrics)``, the state donated
        (:func:`jaxformer.train.step.jit_train_step`).
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


def run_programs(cfg: TrainConfig, model_config: TransformerConfig, mesh: jax.sharding.Mesh) -> RunPrograms:
    """The programs for ``model_config`` on ``mesh`` with ``cfg``'s optimizer and step
    settings: the same object for the same settings while it is kept (see the module).

    Only the settings the programs depend on choose them: the model, the mesh, the
    schedule's (``--max-steps`` and ``--decay-fraction`` only for ``wsd``, whose decay
    ends on the step budget), ``--grad-clip``, ``--label-smoothing`` and
    ``--grad-accum-steps``.

    Raises:
      ValueError: an unknown schedule, or a mesh that does not divide the model's
        dimensions (as :func:`jaxformer.train.step.create_sharded_train_state`).
    """
    budget = (cfg.train.max_steps, cfg.train.decay_fraction) if cfg.train.lr_schedule == "wsd" else (None, None)
    return _built(model_config, mesh, (cfg.train.lr_schedule, cfg.train.warmup_steps, cfg.train.lr_scale, *budget),
                  cfg.train.grad_clip, cfg.train.label_smoothing, cfg.train.grad_accum_steps)


@functools.lru_cache(maxsize=KEPT)
def _built(model_config: TransformerConfig, mesh: jax.sharding.Mesh, schedule_settings: tuple,
           grad_clip: float | None, label_smoothing: float, grad_accum_steps: int) -> RunPrograms:
    name, warmup_steps, scale, total_steps, decay_fraction = schedule_settings
    model = Transformer(model_config)
    schedule = make_schedule(name, d_model=model_config.d_model, warmup_steps=warmup_steps,
                             total_steps=total_steps, decay_fraction=decay_fraction, scale=scale)
    tx = make_optimizer(schedule, grad_clip)
    init, layout, abstract_state = jit_sharded_init(model, tx, mesh)
    return RunPrograms(model=model, schedule=schedule, tx=tx, layout=layout, init=init,
                       start_from=jit_state_from_params(model, tx, layout),
                       abstract_state=abstract_state,
                       train_step=jit_train_step(model, label_smoothing, layout=layout,
                                                 grad_accum_steps=grad_accum_steps),
                       eval_step=jit_eval_step(model, label_smoothing, layout=layout), decoders={})


def clear() -> None:
    """Drops the kept programs; their compiled code is freed once no run holds them."""
    _built.cache_clear()
