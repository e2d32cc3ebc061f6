"""Lexically constrained beam search (:class:`Constrained`): every hypothesis that ends holds
each of its sentence's target phrases, and an optional forced target prefix comes first.

The search is dynamic beam allocation (Post & Vilar, "Fast Lexically Constrained Decoding with
Dynamic Beam Allocation for Neural Machine Translation", NAACL 2018) in the vectorized form of
Hu et al. ("Improved Lexically Constrained Decoding for Translation and Monolingual Rewriting",
NAACL 2019), with the semantics of fairseq's
``LexicallyConstrainedBeamSearch`` (fairseq/search.py) and ``ConstraintState``
(fairseq/token_generation_constraints.py): constraints are unordered; a hypothesis that started a
phrase may leave it (its progress on that phrase resets); eos is allowed only once every
constraint is met; each step's candidates (the best 2k extensions, each hypothesis' best token,
and for each unmet phrase the token that starts or continues it) are grouped into *banks* by the
number of constraint tokens met and the k live hypotheses taken round robin from the highest
bank down. The state per hypothesis has a fixed size: for each phrase, bit p says "the last p + 1
tokens equal the phrase's first p + 1" (the Shift-And string matcher, Baeza-Yates & Gonnet 1992),
so an overlap such as ``a a b`` inside ``a a a b`` is found, and a met flag.

Constraints are data, not settings: int32 ``tokens [B, C, P]`` (C phrases of at most P tokens)
and ``prefix [B, Q]``, padded with -1, one compile per (C, P, Q). A sentence without constraints
or prefix gets :class:`~jaxformer.decode.beam_search.Beam`'s search: from the same log-probabilities,
the same hypotheses and scores, bit for bit (``tests/test_constrained.py``); the Evaluator runs a
batch without any as ``Beam`` itself (:attr:`Constrained.plain`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

import chex
import jax
import jax.numpy as jnp

from jaxformer.decode.beam_search import (
    NEG_INF,
    Beam,
    Candidates,
    TokensToLogits,
    beam_loop,
    blocked_top_k,
    flatten_beams,
    take_rows,
    unflatten_beams,
)
from jaxformer.decode.generation import banned_mask
from jaxformer.decode.penalties import NoRepeatNGram, apply_processors
from jaxformer.decode.strategies import first_argmax


def bank_rule(constraint_tokens: int) -> int:
    """The smallest beam that gives every bank a slot: one bank per number of constraint tokens
    met, 0 … T, so T + 1 (fairseq's banks share the beam evenly, ``beam // (T + 1)`` each)."""
    return constraint_tokens + 1


@dataclasses.dataclass(frozen=True)
class Constrained:
    """Beam search whose finished hypotheses hold every constraint phrase: :class:`Beam`'s
    settings (checked by it: its ``ValueError``), the constraints being data ``search`` takes.

    ``search(..., constraints={"tokens": [B, C, P], "prefix": [B, Q]})`` (int32, -1 padded; either
    or both may be missing) returns :class:`Beam`'s ``(sequences [B, k, M], scores [B, k])``: the
    hypotheses that meet every constraint first, then (only where none could, at the length
    limit) the best that end there. With k < T + 1 (T a sentence's constraint tokens,
    :func:`bank_rule`) the lower banks get no slot and a phrase may be found late or not at all.
    The loop and the finished-hypothesis merge are :class:`Beam`'s
    (:func:`~jaxformer.decode.beam_search.beam_loop`); :meth:`candidates` is this search's step.
    Sources: Post & Vilar 2018 §3; Hu et al. 2019 §4-5; fairseq ``LexicallyConstrainedBeamSearch``.
    """

    beam_size: int = 4
    alpha: float = 0.6
    length_normalization: Literal["gnmt", "hf"] = "gnmt"
    early_stopping: bool = False
    processors: tuple = ()
    forced_eos: bool = True
    supports_constraints: ClassVar[bool] = True   # decode(..., constraints=...) takes them

    def __post_init__(self):
        beam = Beam(self.beam_size, self.alpha, self.length_normalization, self.early_stopping,
                    self.processors, forced_eos=self.forced_eos)
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, getattr(beam, field.name))

    beams = property(lambda self: self.beam_size)

    @classmethod
    def of(cls, beam: Beam) -> Constrained:
        """The constrained search with ``beam``'s settings (its processors on the log-probabilities:
        ``penalize_logits``, CTranslate2's order, is plain beam search's alone)."""
        return cls(**{field.name: getattr(beam, field.name) for field in dataclasses.fields(cls)})

    @property
    def plain(self) -> Beam:
        """:class:`Beam` with these settings: what a batch without constraints or prefix runs."""
        return Beam(**{field.name: getattr(self, field.name) for field in dataclasses.fields(self)})

    def search(self, tokens_to_logits: TokensToLogits, cache: Any, *, batch_size: int, bos_id: int,
               eos_id: int, pad_id: int, max_decode_len: int, max_lengths: jax.Array | None = None,
               keys_B: jax.Array | None = None, constraints: dict | None = None,
               banned_ids: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array]:
        """``(sequences [B, k, M] int32, scores [B, k] float32)``; ``cache`` has ``B*k`` rows."""
        extra_state = init_constraint_state(constraints, batch_size, self.beam_size)
        return beam_loop(self, tokens_to_logits, cache, extra_state, batch_size=batch_size, bos_id=bos_id,
                         eos_id=eos_id, pad_id=pad_id, max_decode_len=max_decode_len, max_lengths=max_lengths,
                         banned_ids=banned_ids)

    def candidates(self, state: dict[str, Any], logits_RV: jax.Array, *, at_limit_B: jax.Array, bos_id: int,
                   eos_id: int, pad_id: int, banned_ids: tuple[int, ...] | None = None) -> Candidates:
        """The step's candidates (:func:`~jaxformer.decode.beam_search.beam_step`): those of
        :func:`_candidates` from :func:`_step_logprobs`, ranked by :func:`_bank_order`, each with its
        constraint state after its token (:func:`advance`)."""
        full, lifted = _step_logprobs(state, logits_RV, self, at_limit_B=at_limit_B, bos_id=bos_id,
                                      eos_id=eos_id, pad_id=pad_id, banned_ids=banned_ids)
        parents, tokens, logprobs = _candidates(state, full, lifted)
        bits, met, count = advance(take_rows(state["c_bits"], parents), take_rows(state["c_met"], parents),
                                   tokens, state["c_tokens"], state["c_lengths"])
        banks = state["c_tokens"].shape[1] * state["c_tokens"].shape[2] + 1
        order = _bank_order(count, logprobs > NEG_INF / 2, banks=banks)
        return Candidates(parents, tokens, logprobs, order=order, met=jnp.all(met, axis=2),
                          carry={"c_bits": bits, "c_met": met})


def init_constraint_state(constraints: dict | None, batch_size: int, beam_size: int) -> dict[str, jax.Array]:
    """The constraint keys of the search state: the phrases ``tokens [B, C, P]`` and ``lengths
    [B, C]``, the ``prefix [B, Q]`` and ``prefix_len [B]``, each hypothesis' Shift-And ``bits
    [B, k, C, P]`` (none set) and ``met [B, k, C]`` (the empty slots' True)."""
    constraints = constraints or {}
    tokens = jnp.asarray(constraints.get("tokens", jnp.full((batch_size, 1, 1), -1)), jnp.int32)
    prefix = jnp.asarray(constraints.get("prefix", jnp.full((batch_size, 1), -1)), jnp.int32)
    chex.assert_rank(tokens, 3)
    chex.assert_rank(prefix, 2)
    chex.assert_equal_shape_prefix([tokens, prefix], 1)
    lengths = jnp.sum(tokens >= 0, axis=2).astype(jnp.int32)
    _, phrases, width = tokens.shape
    return dict(c_tokens=tokens, c_lengths=lengths, prefix=prefix,
                prefix_len=jnp.sum(prefix >= 0, axis=1).astype(jnp.int32),
                c_bits=jnp.zeros((batch_size, beam_size, phrases, width), jnp.bool_),
                c_met=jnp.broadcast_to((lengths == 0)[:, None, :], (batch_size, beam_size, phrases)),
                finished_met=jnp.zeros((batch_size, beam_size), jnp.bool_))


def advance(bits_BWCP: jax.Array, met_BWC: jax.Array, token_BW: jax.Array, tokens_BCP: jax.Array,
            lengths_BC: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token's Shift-And update of each candidate's constraint state: ``(bits [B, W, C, P],
    met [B, W, C], tokens met [B, W] int32)``: the met phrases' lengths and the longest progress
    of an unmet one (bits cleared once met)."""
    match = tokens_BCP[:, None, :, :] == token_BW[:, :, None, None]
    shifted = jnp.concatenate([jnp.ones_like(bits_BWCP[..., :1]), bits_BWCP[..., :-1]], axis=-1)
    bits = shifted & match
    positions_P = jnp.arange(bits.shape[-1], dtype=jnp.int32)
    last = positions_P[None, None, None, :] == (lengths_BC[:, None, :, None] - 1)
    met = met_BWC | jnp.any(bits & last, axis=-1)
    bits = bits & ~met[..., None]
    progress = jnp.max(jnp.where(bits, positions_P + 1, 0), axis=-1)
    # One phrase in progress counts, as fairseq's ConstraintState (a trie walk) has one: a token
    # that starts two phrases is one step, and leaving one phrase for another gains nothing.
    count = (jnp.sum(jnp.where(met, lengths_BC[:, None, :], 0), axis=-1)
             + jnp.max(jnp.where(met, 0, progress), axis=-1))
    return bits, met, count.astype(jnp.int32)


def _step_logprobs(state: dict[str, Any], logits_RV: jax.Array, beam: Constrained, *, at_limit_B: jax.Array,
                   bos_id: int, eos_id: int, pad_id: int,
                   banned_ids: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array]:
    """``(logp [B, k, V], logp with no n-gram ban [B, k, V])``: the step's log-probabilities after
    the processors, the banned ids (default pad and bos) never, the prefix forced, eos only where
    every constraint is met (or, with ``forced_eos``, at the limit ``at_limit_B``, where it is the
    only token)."""
    batch_size, k = state["live_logprobs"].shape
    step = state["step"]
    logp_RV = jax.nn.log_softmax(logits_RV.astype(jnp.float32), axis=-1)
    seqs_RM = flatten_beams(state["live_seqs"])
    kept = tuple(p for p in beam.processors if not isinstance(p, NoRepeatNGram))
    full = lifted = logp_RV   # Beam's operations exactly, so a line without constraints gets its bytes
    if beam.processors:
        full = jnp.maximum(apply_processors(beam.processors, logp_RV, seqs_RM, step), NEG_INF)
        lifted = full if kept == beam.processors else jnp.maximum(
            apply_processors(kept, logp_RV, seqs_RM, step), NEG_INF)
    vocab = logp_RV.shape[-1]
    ids_11V = jnp.arange(vocab)[None, None, :]
    eos_forced_B = at_limit_B if beam.forced_eos else jnp.zeros_like(at_limit_B)
    forcing_B = (step < state["prefix_len"]) & ~eos_forced_B
    forced_B = jax.lax.dynamic_index_in_dim(state["prefix"], jnp.minimum(step, state["prefix"].shape[1] - 1),
                                            axis=1, keepdims=False)
    eos_ok_BN = (jnp.all(state["c_met"], axis=2) & ~forcing_B[:, None]) | eos_forced_B[:, None]
    never_11V = banned_mask(vocab, bos_id=bos_id, pad_id=pad_id, banned_ids=banned_ids)[None, None, :]
    banned = ((eos_forced_B[:, None, None] & (ids_11V != eos_id)) | never_11V
              | (forcing_B[:, None, None] & (ids_11V != forced_B[:, None, None]))
              | (~eos_ok_BN[:, :, None] & (ids_11V == eos_id)))
    def masked(logp_RV):
        logp_BNV = jnp.where(banned, NEG_INF, unflatten_beams(logp_RV, batch_size))
        if beam.forced_eos and beam.length_normalization == "hf":
            logp_BNV = jnp.where(at_limit_B[:, None, None] & (ids_11V == eos_id), 0.0, logp_BNV)
        return logp_BNV

    full, lifted = (masked(full), masked(lifted)) if lifted is not full else (masked(full),) * 2
    full = jnp.where(forcing_B[:, None, None], lifted, full)   # a forced token is never banned
    chex.assert_shape([full, lifted], (batch_size, k, vocab))
    return full, lifted


def _candidates(state: dict[str, Any], full: jax.Array, lifted: jax.Array) -> tuple[jax.Array, ...]:
    """The step's candidates, ``(parent beam, token, log-probability)`` each ``[B, W]``, W =
    2k + k(2C + 1), best first by log-probability (a stable sort: the best 2k extensions in
    ``Beam``'s order, then the others); a duplicate of a better candidate gets ``NEG_INF``."""
    batch_size, k, vocab = full.shape
    live = state["live_logprobs"][:, :, None]
    top_logprobs, top_idx = blocked_top_k((live + full).reshape(batch_size, k * vocab), 2 * k)
    # Each hypothesis' best token, and for each unmet phrase the tokens that start and continue it.
    best = first_argmax(full)[..., None]                                               # [B, k, 1]
    tokens_BCP, met = state["c_tokens"], state["c_met"]
    progress = jnp.max(jnp.where(state["c_bits"], jnp.arange(tokens_BCP.shape[2]) + 1, 0), axis=-1)
    width = tokens_BCP.shape[2]
    following = jnp.take_along_axis(jnp.broadcast_to(tokens_BCP[:, None], met.shape + (width,)),
                                    jnp.minimum(progress, width - 1)[..., None], axis=-1)[..., 0]
    starts = jnp.broadcast_to(tokens_BCP[:, None, :, 0], met.shape)
    wanted = jnp.concatenate([jnp.where(met, -1, starts), jnp.where(met, -1, following)], axis=2)
    wanted_logp = jnp.take_along_axis(lifted, jnp.maximum(wanted, 0), axis=2)
    extra_tokens = jnp.concatenate([best, jnp.maximum(wanted, 0)], axis=2)            # [B, k, E]
    extra_logp = jnp.concatenate([jnp.take_along_axis(full, best, axis=2),
                                  jnp.where(wanted >= 0, wanted_logp, NEG_INF)], axis=2)
    extra_count = extra_tokens.shape[2]
    parents = jnp.concatenate([top_idx // vocab, jnp.repeat(jnp.arange(k, dtype=jnp.int32), extra_count)[None]
                               .repeat(batch_size, axis=0)], axis=1)
    tokens = jnp.concatenate([top_idx % vocab, extra_tokens.reshape(batch_size, -1)], axis=1)
    tokens = tokens.astype(jnp.int32)
    logprobs = jnp.concatenate([top_logprobs, (live + extra_logp).reshape(batch_size, -1)], axis=1)
    logprobs = jnp.maximum(logprobs, NEG_INF)
    order = jnp.argsort(-logprobs, axis=1, stable=True)
    parents, tokens, logprobs = (jnp.take_along_axis(x, order, axis=1) for x in (parents, tokens, logprobs))
    key = parents * vocab + tokens
    count = key.shape[1]
    earlier = jnp.arange(count)[None, :, None] > jnp.arange(count)[None, None, :]       # [1, W(i), W(j)]
    duplicate = jnp.any((key[:, :, None] == key[:, None, :]) & earlier, axis=2)
    return parents, tokens, jnp.where(duplicate, NEG_INF, logprobs)


def _bank_order(count_BW: jax.Array, alive_BW: jax.Array, banks: int) -> jax.Array:
    """int32 ``[B, W]`` sort keys of dynamic beam allocation: rank r within bank b (by position,
    the candidates being best first) gives ``r · banks + (banks - 1 - b)``: round robin from the
    highest bank down (fairseq's stripes); the dead last."""
    positions = jnp.arange(count_BW.shape[1])
    before = positions[None, None, :] < positions[None, :, None]                        # j before i
    same = (count_BW[:, :, None] == count_BW[:, None, :]) & alive_BW[:, None, :] & before
    rank = jnp.sum(same, axis=2).astype(jnp.int32)
    return jnp.where(alive_BW, rank * banks + (banks - 1 - count_BW), jnp.iinfo(jnp.int32).max)
