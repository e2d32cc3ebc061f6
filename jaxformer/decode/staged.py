"""Beam search in stages, for bulk decoding: closed sentences leave the batch (as in fairseq and
CTranslate2) and the cache grows with the output, where one ``while_loop`` pays for all B·k rows
and M positions until the last sentence closes (en-de, beam 4, batch 32: 51% of the rows' steps).
A stage runs :func:`~jaxformer.decode.beam_search.beam_step` over R sentences and length L until
at most R/2 are open, or step L; the host then gathers the open ones into R/2 rows (R/4 while at
most that many are open) and, past L, pads to M: at most 2 × (log2 B + 1) compiled loops per
bucket. The output is ``decode``'s up to float rounding (a near-tie can flip), and a pure
function of the batch, so a resumed bulk run repeats it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decode.beam_search import Beam, beam_output, beam_step, init_beam_state
from jaxformer.decode.decoding import _model_callback, decode_step_callback, source_limits
from jaxformer.model.transformer import DecodeCache, Transformer


class StagedBeamSearch:
    """``beam``'s search of ``model`` in stages (settings as ``decode``'s; ``first_length``: the
    first stage's L ≥ 1); ``stages``: the last call's ``(rows, length, step at its end)``."""

    def __init__(self, model: Transformer, beam: Beam, *, bos_id: int, eos_id: int, len_a: float = 1.0,
                 extra_len: int | None = 50, first_length: int = 32, banned_ids: tuple | None = None):
        self.model, self.beam, self.beam_size, self.first_length = model, beam, beam.beam_size, first_length
        self.pad_id = model.config.pad_id
        self._step = functools.partial(beam_step, strategy=beam, bos_id=bos_id, eos_id=eos_id,
                                       pad_id=self.pad_id, banned_ids=banned_ids)
        self._init = functools.partial(init_beam_state, beam=beam, bos_id=bos_id, pad_id=self.pad_id)
        self._len_a, self._extra_len = len_a, extra_len
        self.stages: list[tuple[int, int, int]] = []
        self._start = jax.jit(self._start_stage, static_argnames=("length", "max_decode_len"))
        self._advance = jax.jit(self._run_stage, static_argnames=("stop_at",), donate_argnums=(1,))
        self._restage = jax.jit(self._next_stage, static_argnames=("rows", "length"))

    def _start_stage(self, params, src_BS, *, length: int, max_decode_len: int) -> dict[str, Any]:
        """Encodes ``src [B, S]`` and builds the first stage's state (cache length ``length``)."""
        _, cache = _model_callback(self.model, params, src_BS, length, self.beam_size)
        limits = source_limits(src_BS, pad_id=self.pad_id, len_a=self._len_a, extra_len=self._extra_len)
        state = self._init(cache, batch_size=src_BS.shape[0], length=length, max_decode_len=max_decode_len,
                           max_lengths=limits)
        return dict(state, origin=jnp.arange(src_BS.shape[0], dtype=jnp.int32))

    def _run_stage(self, params, state, *, stop_at: int):
        """Steps until at most ``stop_at`` sentences are open or the arrays are full.
        Returns ``(state, (seqs [R, k, L], scores [R, k], origin [R], open count, step))``."""
        tokens_to_logits = decode_step_callback(self.model, params)
        length = state["live_seqs"].shape[2]
        state = jax.lax.while_loop(lambda s: (s["step"] < length) & (jnp.sum(s["open"]) > stop_at),
                                   lambda s: self._step(s, tokens_to_logits), state)
        seqs, scores = beam_output(state, self.beam, pad_id=self.pad_id)
        return state, (seqs, scores, state["origin"], jnp.sum(state["open"]), state["step"])

    def _next_stage(self, state, *, rows: int, length: int) -> dict[str, Any]:
        """The open sentences first (in their order), cut to ``rows``; arrays padded to ``length``."""
        order_R = jnp.argsort(~state["open"], stable=True)[:rows]
        beam_rows = (order_R[:, None] * self.beam_size + jnp.arange(self.beam_size)[None, :]).reshape(-1)
        cache: DecodeCache = state["cache"].select_rows(beam_rows).with_length(length)
        new = {key: value[order_R] for key, value in state.items() if key not in ("step", "cache")}
        for key in ("live_seqs", "finished_seqs"):
            grow = length - new[key].shape[2]
            new[key] = jnp.pad(new[key], [(0, 0), (0, 0), (0, grow)], constant_values=self.pad_id)
        return dict(new, step=state["step"], cache=cache)

    def __call__(self, params: Any, src_BS: np.ndarray, max_decode_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Beam search of ``src [B, S]`` (int32 ids, one device): numpy ``(sequences [B, k, M]
        int32, scores [B, k] float32)``, best first, as :func:`~jaxformer.decode.decoding.decode`'s."""
        batch, k = src_BS.shape[0], self.beam_size
        rows, length = batch, min(self.first_length, max_decode_len)
        seqs_BNM = np.full((batch, k, max_decode_len), self.pad_id, np.int32)
        scores_BN = np.zeros((batch, k), np.float32)
        state = self._start(params, src_BS, length=length, max_decode_len=max_decode_len)
        self.stages = []
        while True:
            state, result = self._advance(params, state, stop_at=rows // 2 if rows > 1 else 0)
            seqs, scores, origin, still_open, step = jax.device_get(result)
            seqs_BNM[origin, :, :length], scores_BN[origin] = seqs, scores
            self.stages.append((rows, length, int(step)))
            if still_open == 0 or step >= max_decode_len:
                return seqs_BNM, scores_BN
            # Halve the rows as often as the open sentences allow, one level per restaging
            # (one small program per (rows, length) pair), and grow the arrays once.
            grown = max_decode_len if step >= length else length
            while still_open <= rows // 2 or grown > length:
                rows = rows // 2 if still_open <= rows // 2 else rows
                length = grown
                state = self._restage(state, rows=rows, length=length)
