"""A run's model, optimizer and jitted programs: each ``train()`` builds its own (JAX's
persistent cache, ``RUN/jax_cache``, spares a resume its compiles)."""

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
from jaxformer.train.step import (
    TrainState,
    jit_eval_step,
    jit_sharded_init,
    jit_state_from_params,
    jit_train_step,
)


@dataclasses.dataclass(frozen=True)
class RunPrograms:
    """What a run builds from its settings before it reads a checkpoint; nothing is compiled
    before its first call."""

    model: Transformer
    schedule: optax.Schedule   # the learning rate by update count
    layout: Layout   # the mesh and the train state's shardings
    init: Callable[[jax.Array], TrainState]   # each array created in its shard
    start_from: Callable[[Any], TrainState]   # a fine-tune's start around donated params
    abstract_state: Any   # ShapeDtypeStructs with shardings: the restore target
    train_step: Callable[..., Any]   # (state, batch, rng) -> (state, metrics), state donated
    eval_step: Callable[..., Any]   # (params, batch) -> loss sums
    decoders: dict[Any, Any]   # the dev/test decoders jitted so far (the Evaluator fills it)

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree_util.tree_leaves(self.abstract_state.params))


def run_programs(cfg: TrainConfig, model_config: TransformerConfig, mesh: jax.sharding.Mesh) -> RunPrograms:
    """The programs of ``model_config`` on ``mesh`` with ``cfg.train``'s optimisation settings."""
    model = Transformer(model_config)
    opt = cfg.train
    schedule = make_schedule(opt.lr_schedule, d_model=model_config.d_model, warmup_steps=opt.warmup_steps,
                             total_steps=opt.max_steps, decay_fraction=opt.decay_fraction, scale=opt.lr_scale)
    tx = make_optimizer(schedule, cfg.train.grad_clip)
    init, layout, abstract_state = jit_sharded_init(model, tx, mesh)
    return RunPrograms(model=model, schedule=schedule, layout=layout, init=init,
                       start_from=jit_state_from_params(model, tx, layout), abstract_state=abstract_state,
                       train_step=jit_train_step(model, cfg.train.label_smoothing, layout=layout,
                                                 grad_accum_steps=cfg.train.grad_accum_steps),
                       eval_step=jit_eval_step(model, cfg.train.label_smoothing, layout=layout), decoders={})
