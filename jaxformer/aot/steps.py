"""The programs a run executes, lowered for a target mesh without any array: the jitted
train step (:func:`jaxformer.train.step.jit_train_step`) on a packed batch and beam
search (:func:`jaxformer.decode.decoding.beam_translate`). Every input is a
``jax.ShapeDtypeStruct`` with its sharding, so a model too large for this host lowers
all the same.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxformer.decode.decoding import beam_translate, jit_decoder
from jaxformer.model.config import TransformerConfig
from jaxformer.model.transformer import Transformer
from jaxformer.train.optimizer import make_optimizer, transformer_schedule
from jaxformer.train.step import abstract_train_state, jit_train_step

BATCH_KEYS = ("src", "tgt_in", "tgt_out", "src_segments", "tgt_segments")   # a packed batch


@dataclasses.dataclass(frozen=True)
class TrainShape:
    """One train step: ``rows`` × ``length`` packed rows (segment ids included)."""

    rows: int
    length: int
    label_smoothing: float = 0.1
    grad_accum_steps: int = 1
    warmup_steps: int = 4000


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """Beam search on ``batch`` sources of ``src_len`` ids, ``max_decode_len`` tokens out."""

    batch: int
    src_len: int
    beam_size: int = 4
    max_decode_len: int = 64
    bos_id: int = 1
    eos_id: int = 2


def lower_train_step(config: TransformerConfig, mesh: Mesh, shape: TrainShape) -> jax.stages.Lowered:
    """The train step of ``config`` on ``mesh``, lowered for ``shape``'s batch, whose rows
    divide by the data × fsdp axes × accumulation steps (``jaxformer-compile`` sizes them so).

    Raises:
      ValueError: a sharded parameter dimension does not divide by its mesh axes.
    """
    model = Transformer(config)
    tx = make_optimizer(transformer_schedule(config.d_model, shape.warmup_steps))
    state, layout = abstract_train_state(model, tx, mesh)
    step = jit_train_step(model, shape.label_smoothing, layout=layout,
                          grad_accum_steps=shape.grad_accum_steps)
    batch = {name: jax.ShapeDtypeStruct((shape.rows, shape.length), jnp.int32, sharding=layout.batch)
             for name in BATCH_KEYS}
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=layout.replicated)
    return step.lower(state, batch, key)


def lower_beam_search(config: TransformerConfig, mesh: Mesh, shape: DecodeShape) -> jax.stages.Lowered:
    """Beam search of ``config``'s model on ``mesh`` (parameters laid out as in training,
    sentences over ``data``), lowered for ``shape``, whose batch divides by the data ×
    fsdp axes (``jaxformer-compile`` checks it)."""
    model = Transformer(config)
    tx = make_optimizer(transformer_schedule(config.d_model, 1))
    state, layout = abstract_train_state(model, tx, mesh)
    decoder = jit_decoder(beam_translate, model, layout, beam_size=shape.beam_size,
                          max_decode_len=shape.max_decode_len, bos_id=shape.bos_id, eos_id=shape.eos_id)
    src = jax.ShapeDtypeStruct((shape.batch, shape.src_len), jnp.int32, sharding=layout.batch)
    return decoder.lower(state.params, src)
