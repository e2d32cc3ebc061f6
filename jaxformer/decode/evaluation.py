"""Evaluation and batched translation of a trained model (:class:`Evaluator`): teacher-forced
dev loss, decoding in fixed-shape length buckets, BLEU and chrF (sacrebleu). BLEU tokenizes as
sacrebleu's command line does for the target language (``zh``, ``ja-mecab``, ``ko-mecab``, else
``13a``); without MeCab a Japanese or Korean target is refused, not scored incomparably.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.data.batching import Examples, bucket_boundaries, collate
from jaxformer.data.tokenizer import Tokenizer
from jaxformer.decode.constraint_inputs import batch_arrays
from jaxformer.decode.decoding import _decode, jit_decoder
from jaxformer.decode.exported import ExportCache
from jaxformer.decode.generation import with_forced_first
from jaxformer.decode.staged import StagedBeamSearch
from jaxformer.model import sharding as sharding_lib
from jaxformer.model.transformer import Transformer
from jaxformer.model.validation import check_token_ids


class Evaluator:
    """Dev/test evaluation and batched translation: teacher-forced loss, decoding, BLEU."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, batch_size: int,
                 target_language: str = "", layout: sharding_lib.Layout | None = None,
                 tokenize: str | None = None, max_len_a: float = 1.0, max_len_b: int = 50,
                 scoring: bool = True, exports: ExportCache | None = None, staged: bool = False,
                 decoders: dict[Any, Any] | None = None, bleu: Any = None, fixed_rows: bool = False):
        """``batch_size``: the most sentences per decoding batch (fewer: padded to a power of two, or
        with ``fixed_rows`` to ``batch_size`` rows, one program per length bucket whatever a batch
        holds, so a service's warm-up compiles them all);
        ``target_language`` (ISO code) or ``tokenize`` chooses the BLEU tokenizer (:func:`make_bleu`,
        its ``ValueError``); at most ``max_len_a`` × L + ``max_len_b`` tokens (fairseq's
        ``--max-len-a/b``), never ``max_len``; ``scoring``: build the BLEU/chrF scorers; ``exports``:
        serve unsampled decoders from exported programs without a layout; ``staged``: a
        ``stageable`` strategy (``Beam``) in stages (:mod:`jaxformer.decode.staged`) without a
        layout; ``decoders``: the compiled decoders by settings, shareable by evaluators of one
        model, layout, exports and staging; ``bleu``: a BLEU scorer made already
        (:func:`make_bleu`'s) instead of one made here."""
        self.model, self.tokenizer, self.layout, self.batch_size = model, tokenizer, layout, batch_size
        self.fixed_rows = fixed_rows
        # Coarse buckets: each is one compile of the decode loop and of the eval step.
        self.boundaries = bucket_boundaries(model.config.max_len, step=32)
        self._decoders: dict[Any, Any] = {} if decoders is None else decoders
        self.exports, self.staged = exports, staged and layout is None
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        if scoring:
            from sacrebleu.metrics import CHRF

            self.bleu, self.chrf = bleu or make_bleu(target_language, tokenize), CHRF()

    def _decoder(self, strategy: Any, sampled: bool, **static) -> Callable:
        """``fn(params, src_BS, indices_B, rng)``, cached: staged, exported (``rng`` ``None``) or jitted."""
        key = (strategy, sampled, tuple(sorted(static.items())))
        if key not in self._decoders:
            if getattr(strategy, "supports_constraints", False):   # its constraints: a fifth argument
                self._decoders[key] = jit_decoder(self.model, strategy, self.layout, **static)
            elif self.staged and getattr(strategy, "stageable", False):
                max_decode_len = static.pop("max_decode_len")
                staged = StagedBeamSearch(self.model, strategy, **static)
                self._decoders[key] = lambda params, src, index, rng: staged(params, src, max_decode_len)
            elif self.exports is not None and self.layout is None and not sampled:
                fn = functools.partial(_decode, self.model, strategy=strategy, **static)   # params, src, idx
                exported = self.exports.decoder(fn, "decode", self.model.config, strategy=strategy, **static)
                self._decoders[key] = lambda params, src, index, rng: exported(params, src, index)
            else:
                self._decoders[key] = jit_decoder(self.model, strategy, self.layout, **static)
        return self._decoders[key]

    def _place(self, batch):
        """This process's block of rows of a (whole, host) batch, as global sharded arrays."""
        count, position = sharding_lib.mesh_processes(self.layout.mesh)
        rows = next(iter(batch.values())).shape[0] // count
        return sharding_lib.shard_batch({k: v[position * rows:(position + 1) * rows]
                                         for k, v in batch.items()}, self.layout.batch)

    def _length_batches(self, lengths):
        order = np.argsort(lengths, kind="stable")
        buckets = np.searchsorted(np.asarray(self.boundaries), np.asarray(lengths)[order])
        for b in np.unique(buckets):
            members = order[buckets == b]
            for start in range(0, members.size, self.batch_size):
                yield self.boundaries[b], members[start:start + self.batch_size]

    def _rows(self, count: int) -> int:
        """Rows for ``count`` sentences: the next power of two ≤ ``batch_size`` (``fixed_rows``:
        ``batch_size``), times the data shards."""
        rows = min(self.batch_size, 1 << max(count - 1, 0).bit_length())
        rows = self.batch_size if self.fixed_rows else rows
        if self.layout is not None:
            multiple = self.layout.data_size * sharding_lib.mesh_processes(self.layout.mesh)[0]
            rows = -(-rows // multiple) * multiple
        return rows

    def decode(self, params: Any, sources: Sequence[str], strategy: Any, *, rng: jax.Array | None = None,
               indices: Sequence[int] | None = None, length_limits: bool = True,
               requests: Sequence[Any] | None = None) -> list[list]:
        """Each source's (translation, score) list, best first, in order: ``sources`` (cut to
        ``max_len`` tokens) decoded with ``strategy`` in length-sorted fixed-shape batches (``rng``,
        ``indices``: ``decode``'s ``rng``, ``indices_B``); ``length_limits``: at most a·L + b tokens,
        L the source's length (``False``: the batch's limit only, as ``generate``); ``requests``:
        each source's :class:`~jaxformer.decode.constraint_inputs.Request`, for a strategy that
        ``supports_constraints`` (a batch without any runs its ``plain`` program)."""
        c = self.model.config
        ids = [s[: c.max_len] for s in self.tokenizer.encode_source(sources)]
        indices = np.arange(len(ids)) if indices is None else np.asarray(indices)
        static = dict(bos_id=self.tokenizer.bos_id, eos_id=self.tokenizer.eos_id, len_a=self.max_len_a,
                      extra_len=self.max_len_b if length_limits else None)
        # The model's generation rules, where its tokenizer states them (M2M100: nothing banned, the
        # target language forced first); a tokenizer without them: pad and bos banned.
        if (banned := getattr(self.tokenizer, "banned_ids", None)) is not None:
            static["banned_ids"] = tuple(banned)
        strategy = with_forced_first(strategy, getattr(self.tokenizer, "forced_first_id", None))
        out: list[list[tuple[str, float]]] = [[] for _ in ids]
        for length, members in self._length_batches([max(1, len(s)) for s in ids]):
            rows = self._rows(members.size)
            batch = {"src": np.full((rows, length), c.pad_id, np.int32),
                     "index": np.zeros((rows, 1), np.int32)}   # rank 2, as the batch sharding wants
            for r, i in enumerate(members):
                batch["src"][r, : len(ids[i])], batch["index"][r, 0] = ids[i], indices[i]
            chosen = strategy
            if requests is not None and any(requests[i].phrases or requests[i].prefix for i in members):
                batch.update(batch_arrays([requests[i] for i in members], rows))
            elif getattr(strategy, "supports_constraints", False):   # none here: the plain program, its bytes
                chosen = strategy.plain
            check_token_ids(batch["src"], name="src", vocab_size=c.src_vocab_size, max_len=c.max_len)
            batch = self._place(batch) if self.layout else jax.tree_util.tree_map(jnp.asarray, batch)
            decoder = self._decoder(chosen, rng is not None, max_decode_len=self.max_decode_len(length),
                                    **static)
            constraints = {k: batch[k] for k in ("tokens", "prefix") if k in batch} or None
            hyps, scores = sharding_lib.to_host(decoder(params, batch["src"], batch["index"], rng,
                                                        *[constraints] * (constraints is not None)))
            for r, i in enumerate(members):
                out[i] = list(zip(self.tokenizer.decode(hyps[r]), (float(x) for x in scores[r])))
        return out

    def max_decode_len(self, source_length: int) -> int:
        """The output limit of a batch of sources padded to ``source_length``."""
        return max(1, min(int(self.max_len_a * source_length + self.max_len_b), self.model.config.max_len))

    def loss(self, params: Any, examples: Examples, eval_step: Callable) -> dict[str, float]:
        """Teacher-forced per-token loss, perplexity and accuracy on tokenized pairs by ``eval_step(params,
        batch) -> {"loss_sum", "nll_sum", "correct", "tokens"}``, jitted for this layout."""
        totals = None
        lengths = [max(len(s), len(t) + 1) for s, t in zip(examples.src, examples.tgt)]
        rows = self._rows(self.batch_size)   # a multiple of the data shards under a layout
        for length, members in self._length_batches(lengths):
            indices = np.concatenate([members, np.full(rows - members.size, -1)])
            batch = collate(examples, length, indices, pad_id=self.model.config.pad_id,
                                     bos_id=self.tokenizer.bos_id, eos_id=self.tokenizer.eos_id)
            sums = eval_step(params, self._place(batch) if self.layout else batch)
            totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
        totals = jax.device_get(totals)
        tokens = max(float(totals["tokens"]), 1.0)
        return {"loss": float(totals["loss_sum"]) / tokens,
                "ppl": math.exp(min(float(totals["nll_sum"]) / tokens, 50.0)),
                "accuracy": float(totals["correct"]) / tokens}

    def score(self, hypotheses: Sequence[str], references: Sequence[str]) -> float:
        """Corpus BLEU of ``hypotheses`` against one reference each (as :meth:`scores`)."""
        return self.scores(hypotheses, references)["bleu"]

    def degenerate(self, hypotheses: Sequence[str]) -> dict[str, Any]:
        """The hypotheses that loop (:func:`repeats_ngram` on the BLEU tokenizer's tokens):
        ``{"count", "fraction", "examples"}``, examples the first three indices."""
        found = [i for i, h in enumerate(hypotheses) if repeats_ngram(self.bleu.tokenizer(h).split())]
        return {"count": len(found), "fraction": len(found) / max(len(hypotheses), 1), "examples": found[:3]}

    def scores(self, hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
        """``{"bleu", "bleu_signature", "chrf", "chrf_signature"}``: corpus scores and sacrebleu
        signatures. ``ValueError`` when the lists differ in length (sacrebleu would drop some)."""
        if len(hypotheses) != len(references):
            raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references: scoring "
                             f"needs one reference per hypothesis, in the same order.")
        hyps, refs = list(hypotheses), [list(references)]
        bleu, chrf = self.bleu.corpus_score(hyps, refs), self.chrf.corpus_score(hyps, refs)
        return {"bleu": float(bleu.score), "bleu_signature": str(self.bleu.get_signature()),
                "chrf": float(chrf.score), "chrf_signature": str(self.chrf.get_signature())}


def repeats_ngram(tokens: Sequence[str], times: int = 3, max_n: int = 4) -> bool:
    """Whether an n-gram (n ≤ ``max_n``) with a letter or digit occurs ``times`` in a row
    (``a , a , a ,`` and ``x x x`` do; ``a b a b`` and ``. . .`` do not)."""
    tokens = list(tokens)
    wordy = [any(c.isalnum() for c in t) for t in tokens]
    for n in range(1, max_n + 1):
        for start in range(len(tokens) - n * times + 1):
            gram = tokens[start:start + n]
            if any(wordy[start:start + n]) and all(
                    tokens[start + r * n:start + (r + 1) * n] == gram for r in range(1, times)):
                return True
    return False


def make_bleu(target_language: str, tokenize: str | None = None):
    """sacrebleu's ``BLEU`` for ``target_language`` (its tokenizer choice) or ``tokenize``;
    ``ValueError`` for an unknown tokenizer or one that cannot start (naming the install)."""
    from sacrebleu.metrics.bleu import BLEU

    try:
        return BLEU(tokenize=tokenize, trg_lang=target_language)
    except (RuntimeError, ImportError, KeyError) as e:   # an unknown name; a missing MeCab
        chosen = tokenize or BLEU._TOKENIZER_MAP.get(target_language, BLEU.TOKENIZER_DEFAULT)
        extra = {"ja-mecab": "ja", "ko-mecab": "ko"}.get(chosen)
        install = f"pip install 'sacrebleu[{extra}]'" if extra else "install what sacrebleu asks for"
        reason = "MeCab is not installed" if extra else (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"Unknown sacrebleu tokenizer {tokenize!r}; choose one of {sorted(BLEU.TOKENIZERS)}."
            if chosen not in BLEU.TOKENIZERS else
            f"BLEU for target language {target_language!r} uses sacrebleu's {chosen!r} tokenizer, "
            f"which cannot start ({reason}). Either {install}, or pass --sacrebleu-tokenize char "
            f"(character BLEU, not comparable with published {chosen} scores).") from e
