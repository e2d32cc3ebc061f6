"""Beam search as one ``lax.while_loop`` (:class:`Beam`): GNMT-normalised (paper §6.1) or as
Hugging Face ``generate`` (an imported OPUS-MT or NLLB model reproduces it token for token). B
batch, V vocabulary, M the longest output; the beam width is k (N in names; K is the head
width), W a step's candidates per sentence.

The loop (:func:`beam_loop`, :func:`beam_step`) is shared by the beam-like strategies, as
fairseq's generator shares its loop between the ``Search.step`` of each: a step calls the
model, then the strategy's candidate step (``candidates``: :class:`Beam`'s best 2k extensions;
:class:`~jaxformer.decode.constrained.Constrained`'s adds the tokens its phrases want, ranked
by bank) and then one selection keeps the live hypotheses, merges the finished ones and
re-checks each sentence's stopping rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decode.generation import banned_mask
from jaxformer.decode.penalties import apply_processors
from jaxformer.model.validation import check_count, check_real

# The model callback of every decoder: tokens_to_logits(ids [B, 1], cache) -> (logits [B, V], cache).
TokensToLogits = Callable[[jax.Array, Any], tuple[jax.Array, Any]]

NEG_INF = -1.0e9
# A finished hypothesis that misses a constraint (only at its length limit) ranks below every
# one that meets them all: its merge key is its score plus this.
_UNMET = NEG_INF / 4


def length_penalty(length, alpha: float, normalization: str = "gnmt"):
    """A finished hypothesis' log-probability divisor (|Y| counts eos): ``"gnmt"`` ((5 + |Y|) / 6)^α
    (Wu et al. 2016; paper §6.1, α = 0.6), ``"hf"`` |Y|^α (transformers' ``_update_finished_beams``)."""
    length = jnp.asarray(length, jnp.float32)
    return length ** alpha if normalization == "hf" else ((5.0 + length) / 6.0) ** alpha


class Candidates(NamedTuple):
    """A step's candidates (W per sentence, best first), each ``[B, W]``: the live hypothesis each
    extends (``parents``, int32 in [0, k)), its next token (int32) and log-probability (float32;
    ``NEG_INF / 2`` or less: none). ``order``: int32 keys, smaller first, that rank them for the
    live and finished picks (dynamic beam allocation's banks); ``None``: their position, as plain
    beam search. ``met``: bool, whether each meets its constraints (one that does not ranks below
    every finished one that does); ``None``: all do. ``carry``: per-candidate state ``[B, W, ...]``,
    kept under its names in the search state for the live hypotheses picked."""

    parents: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    order: jax.Array | None = None
    met: jax.Array | None = None
    carry: dict[str, jax.Array] | None = None


@dataclasses.dataclass(frozen=True)
class Beam:
    """Beam search (paper §6.1: k = 4, α = 0.6): the k best hypotheses per sentence,
    scored log-probability / :func:`length_penalty` (a strategy: :mod:`jaxformer.decode.strategies`).

    Each step keeps the best 2k extensions: the best k that did not end stay live, those of the
    top k that ended (eos, or the sentence's limit) join the k finished. The loop stops when every
    sentence is *closed* (or at M tokens):

    * ``length_normalization="gnmt"``: k finished, and the best live log-probability over
      the largest penalty it could get, lp(its limit), below the worst finished: exact.
    * ``"hf"``: ``generate``'s rule (``_check_early_stop_heuristic``: the *current*
      length^α): ``generate(num_beams=k, length_penalty=α)``'s sequences and ``sequences_scores``.
    * ``early_stopping=True`` (either): k finished, the rule of fairseq, CTranslate2 and
      ``generate(early_stopping=True)``; faster, not exact.

    ``forced_eos``: at a sentence's limit eos is the only token (with ``"hf"`` at log-probability
    0: transformers' ``ForcedEOSTokenLogitsProcessor``, a model's ``forced_eos_token_id``);
    ``False``: the best k extensions at the limit end there without eos, as ``generate`` cuts at
    ``max_length`` without ``forced_eos_token_id``. ``processors``
    (:mod:`jaxformer.decode.penalties`) apply to the log-probabilities before ranking, as in
    fairseq and ``generate``; with ``penalize_logits`` to the logits, then renormalized with pad
    and bos left out, as in CTranslate2's beam search. Raises ``ValueError`` for a ``beam_size``
    not an integer ≥ 1, an ``alpha`` not finite, another ``length_normalization``, an
    ``early_stopping`` or ``forced_eos`` not a bool.
    """

    beam_size: int = 4
    alpha: float = 0.6
    length_normalization: Literal["gnmt", "hf"] = "gnmt"
    early_stopping: bool = False
    processors: tuple = ()
    penalize_logits: bool = False
    forced_eos: bool = True
    stageable: ClassVar[bool] = True   # bulk decoding may run it in stages (jaxformer.decode.staged)

    def __post_init__(self):
        object.__setattr__(self, "beam_size", check_count("beam_size", self.beam_size))
        object.__setattr__(self, "alpha", check_real("alpha", self.alpha))
        norm, flags = self.length_normalization, {"early_stopping": self.early_stopping,
                                                  "forced_eos": self.forced_eos}
        wrong = [f"{name} must be True or False (got {value!r})" for name, value in flags.items()
                 if not isinstance(value, (bool, np.bool_))]
        if norm not in ("gnmt", "hf"):
            wrong.insert(0, f"length_normalization must be 'gnmt' or 'hf' (got {norm!r})")
        if wrong:
            raise ValueError("; ".join(wrong) + ".")
        for name, value in flags.items():
            object.__setattr__(self, name, bool(value))

    beams = property(lambda self: self.beam_size)

    def search(self, tokens_to_logits: TokensToLogits, cache: Any, *, batch_size: int, bos_id: int,
               eos_id: int, pad_id: int, max_decode_len: int, max_lengths: jax.Array | None = None,
               keys_B: jax.Array | None = None,
               banned_ids: tuple | None = None) -> tuple[jax.Array, jax.Array]:
        """``(sequences [B, k, M] int32, scores [B, k] float32)``, best first; ``cache`` has ``B*k`` rows;
        ``banned_ids``: never generated (default pad and ``bos_id``)."""
        return beam_loop(self, tokens_to_logits, cache, batch_size=batch_size, bos_id=bos_id, eos_id=eos_id,
                         pad_id=pad_id, max_decode_len=max_decode_len, max_lengths=max_lengths,
                         banned_ids=banned_ids)

    def candidates(self, state: dict[str, Any], logits_RV: jax.Array, *, at_limit_B: jax.Array, bos_id: int,
                   eos_id: int, pad_id: int, banned_ids: tuple | None = None) -> Candidates:
        """The step's candidates (:func:`beam_step`): the best 2k extensions of the live hypotheses
        by log-probability after the processors, the banned ids (default pad and ``bos_id``, the
        decoder start) never, with ``forced_eos`` eos alone at a sentence's limit ``at_limit_B``."""
        batch_size, k = state["live_logprobs"].shape
        step = state["step"]
        scores_RV, seqs_RM = logits_RV.astype(jnp.float32), flatten_beams(state["live_seqs"])
        never_1V = banned_mask(logits_RV.shape[-1], bos_id=bos_id, pad_id=pad_id, banned_ids=banned_ids)[None]
        processors = self.processors
        if self.penalize_logits:   # penalties and bans before the softmax renormalizes, as in CTranslate2
            scores_RV = jnp.where(never_1V, -jnp.inf, apply_processors(processors, scores_RV, seqs_RM, step))
        scores_RV = jax.nn.log_softmax(scores_RV, axis=-1)
        if processors and not self.penalize_logits:
            scores_RV = apply_processors(processors, scores_RV, seqs_RM, step)
        logp_BNV = unflatten_beams(jnp.maximum(scores_RV, NEG_INF), batch_size)   # a ban's -inf: NEG_INF
        vocab = logp_BNV.shape[-1]
        ids_11V, at_limit_B11 = jnp.arange(vocab)[None, None, :], at_limit_B[:, None, None]
        banned = never_1V[None]
        if self.forced_eos:
            banned = (at_limit_B11 & (ids_11V != eos_id)) | banned
        logp_BNV = jnp.where(banned, NEG_INF, logp_BNV)
        if self.forced_eos and self.length_normalization == "hf":
            logp_BNV = jnp.where(at_limit_B11 & (ids_11V == eos_id), 0.0, logp_BNV)
        candidates = (state["live_logprobs"][:, :, None] + logp_BNV).reshape(batch_size, k * vocab)
        logprobs, index = blocked_top_k(candidates, 2 * k)            # [B, 2k]
        return Candidates(index // vocab, (index % vocab).astype(jnp.int32), logprobs)


def flatten_beams(x: jax.Array) -> jax.Array:
    """``[B, k, ...]`` → ``[B*k, ...]``."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def unflatten_beams(x: jax.Array, batch_size: int) -> jax.Array:
    """``[B*k, ...]`` → ``[B, k, ...]``."""
    return x.reshape((batch_size, x.shape[0] // batch_size) + x.shape[1:])


def take_rows(x: jax.Array, index_BW: jax.Array) -> jax.Array:
    """Rows ``[B, W, ...]`` of ``x [B, k, ...]`` picked by ``index_BW`` (int, in [0, k))."""
    return jnp.take_along_axis(x, index_BW.reshape(index_BW.shape + (1,) * (x.ndim - 2)), axis=1)


def gather_beams(tree, beam_indices_BN, batch_size):
    """Picks beams ``[B, N]`` from each ``[B*k, ...]`` leaf (a ``DecodeCache``'s that differ by beam)."""
    if hasattr(tree, "map_beam_state"):
        return tree.map_beam_state(lambda x: gather_beams(x, beam_indices_BN, batch_size))

    def gather(x):
        if x.ndim == 0:
            return x
        return flatten_beams(take_rows(unflatten_beams(x, batch_size), beam_indices_BN))

    return jax.tree_util.tree_map(gather, tree)
def blocked_top_k(x: jax.Array, k: int, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` exactly (ties to the lower index): ``(values, int32 indices)``
    ``x.shape[:-1] + (k,)``. Only the k blocks with the largest maxima can hold the top k, so
    top-ks over block maxima and ``k · block`` candidates replace one over the whole axis
    (beam search's ``[32, 4 · 8000]``: 0.3 ms, not 1.5 ms, on a 2-core CPU)."""
    n = x.shape[-1]
    if n <= 4 * block or k > n // block:
        return jax.lax.top_k(x, k)
    padded = -(-n // block) * block
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - n)], constant_values=-jnp.inf)
    blocks = x.reshape(x.shape[:-1] + (padded // block, block))
    _, best_blocks = jax.lax.top_k(jnp.max(blocks, axis=-1), k)
    best_blocks = jnp.sort(best_blocks, axis=-1)
    candidates = jnp.take_along_axis(blocks, best_blocks[..., None], axis=-2)
    values, position = jax.lax.top_k(candidates.reshape(x.shape[:-1] + (k * block,)), k)
    indices = jnp.take_along_axis(best_blocks, position // block, axis=-1) * block + position % block
    return values, indices.astype(jnp.int32)


def tile_beams(tree, beam_size: int):
    """Repeats every batch row ``beam_size`` times: ``[B, ...]`` → ``[B*k, ...]`` (scalars kept)."""
    return jax.tree_util.tree_map(
        lambda x: x if x.ndim == 0 else jnp.repeat(x, beam_size, axis=0), tree)


def still_open(state: dict[str, jax.Array], beam: Beam) -> jax.Array:
    """:class:`Beam`'s stopping rule, bool ``[B]``: can a live beam still beat the worst finished?"""
    all_full = jnp.all(state["finished_flags"], axis=1)
    if beam.early_stopping:   # fairseq, CTranslate2, generate(early_stopping=True): k finished
        return state["open"] & ~all_full
    worst_finished = jnp.min(jnp.where(state["finished_flags"], state["finished_scores"], NEG_INF), axis=1)
    if beam.length_normalization == "hf":   # transformers' heuristic: the live beam as if it ended now
        best_live = state["live_logprobs"][:, 0] / length_penalty(state["step"], beam.alpha, "hf")
        return state["open"] & (best_live > jnp.where(all_full, worst_finished, NEG_INF))
    # Exact: a live log-probability only falls, and its penalty is largest at the sentence's limit.
    best_live = state["live_logprobs"][:, 0] / length_penalty(state["limit"], beam.alpha, "gnmt")
    return state["open"] & ~(all_full & (worst_finished >= best_live))


def init_beam_state(cache: Any, beam: Beam, *, batch_size: int, bos_id: int, pad_id: int,
                    length: int, max_decode_len: int, max_lengths: jax.Array | None = None) -> dict[str, Any]:
    """The state before the first step: beam 0 alone live (no k copies), nothing finished, all
    open; token arrays ``[B, k, length ≤ M]``, ``limit`` min(``max_lengths``, M); ``B*k`` cache rows."""
    k = beam.beam_size
    live_logprobs0 = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (batch_size, 1))
    return dict(
        step=jnp.zeros((), jnp.int32), live_logprobs=live_logprobs0,
        live_seqs=jnp.full((batch_size, k, length), pad_id, jnp.int32),
        last_ids=jnp.full((batch_size, k), bos_id, jnp.int32),
        finished_seqs=jnp.full((batch_size, k, length), pad_id, jnp.int32),
        finished_scores=jnp.full((batch_size, k), NEG_INF, jnp.float32),
        finished_flags=jnp.zeros((batch_size, k), jnp.bool_), open=jnp.ones((batch_size,), jnp.bool_),
        limit=(jnp.full((batch_size,), max_decode_len, jnp.int32) if max_lengths is None
               else jnp.minimum(jnp.asarray(max_lengths, jnp.int32), max_decode_len)),
        cache=cache)



def beam_loop(strategy: Any, tokens_to_logits: TokensToLogits, cache: Any, extra_state: dict | None = None, *,
              batch_size: int, bos_id: int, eos_id: int, pad_id: int, max_decode_len: int,
              max_lengths: jax.Array | None = None,
              banned_ids: tuple | None = None) -> tuple[jax.Array, jax.Array]:
    """The search of a beam-like ``strategy`` (:class:`Beam`'s settings and a ``candidates`` step)
    as one ``lax.while_loop`` of :func:`beam_step`: :class:`Beam.search`'s output; ``extra_state``:
    the strategy's own keys of the state (its ``candidates`` reads them)."""
    state = init_beam_state(cache, strategy, batch_size=batch_size, bos_id=bos_id, pad_id=pad_id,
                            length=max_decode_len, max_decode_len=max_decode_len, max_lengths=max_lengths)
    state = jax.lax.while_loop(
        lambda state: (state["step"] < max_decode_len) & jnp.any(state["open"]),
        lambda state: beam_step(state, tokens_to_logits, strategy, bos_id=bos_id, eos_id=eos_id,
                                pad_id=pad_id, banned_ids=banned_ids),
        dict(state, **(extra_state or {})))
    return beam_output(state, strategy, pad_id=pad_id)


def beam_step(state: dict[str, Any], tokens_to_logits: TokensToLogits, strategy: Any, *, bos_id: int,
              eos_id: int, pad_id: int, banned_ids: tuple | None = None) -> dict[str, Any]:
    """One step of a beam-like ``strategy``'s search: the model, the strategy's candidates
    (:class:`Candidates`), then one selection. Live: the first k candidates by order that
    neither end nor are dead, best first by log-probability. Finished: those of the first k
    that end (eos, or the sentence's limit: cut there, unless the strategy forced eos) join the
    finished, scored by :func:`length_penalty`, and the best k stay (as in fairseq and
    transformers only the first k can finish, so beam 1 is greedy; a closed sentence takes no
    more); then each sentence's stopping rule. Any B and token-array length above ``state["step"]``;
    other keys in the state pass through."""
    batch_size, k = state["live_logprobs"].shape
    step = state["step"]
    logits, cache = tokens_to_logits(flatten_beams(state["last_ids"])[:, None], state["cache"])
    at_limit_B = step + 1 >= state["limit"]
    found = strategy.candidates(state, logits, at_limit_B=at_limit_B, bos_id=bos_id, eos_id=eos_id,
                                pad_id=pad_id, banned_ids=banned_ids)
    seqs = jax.lax.dynamic_update_slice_in_dim(take_rows(state["live_seqs"], found.parents),
                                               found.tokens[:, :, None], step, axis=2)
    ends = (found.tokens == eos_id) | at_limit_B[:, None]
    alive = found.logprobs > NEG_INF / 2
    live_logprobs, pick, first_k = _pick_live(found, ends | ~alive, k)
    cache = gather_beams(cache, jnp.take_along_axis(found.parents, pick, axis=1), batch_size)

    ended = ends & alive & first_k & state["open"][:, None]
    penalty = length_penalty(step + 1, strategy.alpha, strategy.length_normalization)
    ended_scores = jnp.where(ended, found.logprobs / penalty, NEG_INF)
    merged_scores = jnp.concatenate([state["finished_scores"], ended_scores], axis=1)
    merged_seqs = jnp.concatenate([state["finished_seqs"], seqs], axis=1)
    merged_flags = jnp.concatenate([state["finished_flags"], ended], axis=1)
    merge_key, finished = merged_scores, {}
    if found.met is not None:   # one that misses a constraint ranks below the rest
        merged_met = jnp.concatenate([state["finished_met"], found.met], axis=1)
        merge_key = merged_scores + jnp.where(merged_met, 0.0, _UNMET)
    finished_scores, finished_pick = jax.lax.top_k(jnp.where(merged_flags, merge_key, NEG_INF), k)
    if found.met is not None:
        finished_scores = jnp.take_along_axis(merged_scores, finished_pick, axis=1)
        finished["finished_met"] = jnp.take_along_axis(merged_met, finished_pick, axis=1)
    carry = {name: take_rows(value, pick) for name, value in (found.carry or {}).items()}
    new_state = dict(   # other keys a caller keeps in the state pass through
        state, **carry, **finished, step=step + 1, live_seqs=take_rows(seqs, pick),
        live_logprobs=live_logprobs, last_ids=jnp.take_along_axis(found.tokens, pick, axis=1), cache=cache,
        finished_seqs=take_rows(merged_seqs, finished_pick), finished_scores=finished_scores,
        finished_flags=jnp.take_along_axis(merged_flags, finished_pick, axis=1))
    return dict(new_state, open=still_open(new_state, strategy))


def _pick_live(found: Candidates, out_BW: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(log-probabilities [B, k], picks [B, k], first k by order [B, W])``: the live hypotheses,
    the first k candidates by order not ``out`` (ended or dead), best first by log-probability."""
    if found.order is None:   # position order (plain beam search): one top-k, no W × W work
        live_logprobs, pick = jax.lax.top_k(jnp.where(out_BW, NEG_INF, found.logprobs), k)
        return live_logprobs, pick, (jnp.arange(found.logprobs.shape[1]) < k)[None, :]
    _, pick = jax.lax.top_k(-jnp.where(out_BW, jnp.iinfo(jnp.int32).max, found.order), k)
    best_first = jnp.argsort(-jnp.take_along_axis(found.logprobs, pick, axis=1), axis=1, stable=True)
    pick = jnp.take_along_axis(pick, best_first, axis=1)
    first_k = jnp.sum(found.order[:, None, :] < found.order[:, :, None], axis=2) < k
    return jnp.take_along_axis(found.logprobs, pick, axis=1), pick, first_k


def beam_output(state: dict[str, Any], beam: Beam, *, pad_id: int) -> tuple[jax.Array, jax.Array]:
    """``(sequences [B, k, L], scores [B, k])``, best first (with none finished: the live ones)."""
    any_finished = jnp.any(state["finished_flags"], axis=1)
    lengths = jnp.sum(state["live_seqs"] != pad_id, axis=2)
    live_scores = state["live_logprobs"] / length_penalty(lengths, beam.alpha, beam.length_normalization)
    seqs = jnp.where(any_finished[:, None, None], state["finished_seqs"], state["live_seqs"])
    scores = jnp.where(any_finished[:, None], state["finished_scores"], live_scores)
    return seqs, scores

