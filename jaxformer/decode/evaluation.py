"""Evaluation and batched translation of a trained model: teacher-forced dev loss,
greedy / beam / sampled decoding in fixed-shape length buckets, and BLEU and chrF
(sacrebleu).

Scoring follows sacrebleu's own choice of BLEU tokenizer for the target language
(``zh`` → ``zh``, ``ja`` → ``ja-mecab``, ``ko`` → ``ko-mecab``, else ``13a``), as its
command line does. The Japanese and Korean tokenizers need MeCab
(``pip install "sacrebleu[ja]"`` / ``"sacrebleu[ko]"``); without it the Evaluator refuses
to start rather than report an incomparable score; ``--sacrebleu-tokenize char`` is
the explicit alternative.

The trainer evaluates with it; :class:`jaxformer.decode.translator.Translator` translates
with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.data.batching import Examples, bucket_boundaries, collate
from jaxformer.data.tokenizer import Tokenizer
from jaxformer.decode.decoding import beam_translate, greedy_translate, jit_decoder, sample_translate
from jaxformer.decode.exported import ExportCache
from jaxformer.decode.penalties import NO_PENALTIES, Penalties
from jaxformer.decode.staged import StagedBeamSearch
from jaxformer.model import sharding as sharding_lib
from jaxformer.model.transformer import Transformer
from jaxformer.model.validation import check_token_ids


class Evaluator:
    """Dev/test evaluation and batched translation: teacher-forced loss, decoding, BLEU."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, batch_size: int,
                 target_language: str, layout: sharding_lib.Layout | None = None,
                 tokenize: str | None = None, max_len_a: float = 1.0, max_len_b: int = 50,
                 scoring: bool = True, exports: ExportCache | None = None, staged: bool = False,
                 decoders: dict[Any, Any] | None = None):
        """
        Args:
          batch_size: the most sentences per decoding batch; a smaller input is padded
            only to the next power of two (one compile per size).
          target_language: ISO code (``"de"``, ``"zh"``) choosing sacrebleu's BLEU tokenizer.
          tokenize: a sacrebleu tokenizer name that overrides that choice.
          max_len_a, max_len_b: a translation has at most ``a * L + b`` tokens (fairseq's
            ``--max-len-a/--max-len-b``) and never more than ``max_len``: L is each
            sentence's own length in beam search, the batch's padded length in greedy
            decoding and sampling.
          scoring: build the BLEU/chrF scorers (the translate tool needs none).
          exports: serve greedy and beam decoders from this cache of exported programs
            (:mod:`jaxformer.decode.exported`; the translate tool's, without a layout).
          staged: beam search in stages (:class:`jaxformer.decode.staged.StagedBeamSearch`),
            without a layout; bulk translation's choice.
          decoders: where to keep the jitted decoders, by their settings (default: a new
            dict); evaluators of one model, layout and ``exports``/``staged`` choice may
            share one, as a training run's do across runs
            (:class:`jaxformer.train.programs.RunPrograms`).

        Raises:
          ValueError: an unknown tokenizer, or one whose package is missing (the
            message names the install command and the alternative).
        """
        self.model, self.tokenizer = model, tokenizer
        self.layout = layout
        self.batch_size = batch_size
        # Coarse buckets: each is one compile of the decode loop and of the eval step.
        self.boundaries = bucket_boundaries(model.config.max_len, step=32)
        self._decoders: dict[Any, Any] = {} if decoders is None else decoders
        self.exports = exports
        self.staged = staged and layout is None
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        if max_len_a < 0 or max_len_b < 1 - max_len_a:
            raise ValueError(f"max_len_a={max_len_a}, max_len_b={max_len_b} allow no output token: "
                             f"need a >= 0 and a + b >= 1.")
        if scoring:
            from sacrebleu.metrics import CHRF

            self.bleu, self.chrf = make_bleu(target_language, tokenize), CHRF()

    def _decoder(self, decoder, **static):
        """``decoder(params, src[, rng])`` with the statics bound; under a layout, jitted with
        explicit in/out shardings (:func:`jaxformer.decode.decoding.jit_decoder`). Cached."""
        key = (decoder, tuple(sorted(static.items())))
        if key not in self._decoders:
            if self.exports is not None and self.layout is None and decoder is not sample_translate:
                model, plain = self.model, decoder.__wrapped__   # ids are checked before decode_batch

                def fn(params, src_BS):
                    return plain(model, params, src_BS, **static)

                self._decoders[key] = self.exports.decoder(fn, decoder.__name__, model.config, **static)
            else:
                self._decoders[key] = jit_decoder(decoder, self.model, self.layout, **static)
        return self._decoders[key]

    def _staged(self, **rule) -> StagedBeamSearch:
        """The staged beam search for these settings (cached: its compiled stages are kept)."""
        key = ("staged", tuple(sorted(rule.items())))
        if key not in self._decoders:
            self._decoders[key] = StagedBeamSearch(self.model, **rule)
        return self._decoders[key]

    def _place(self, batch):
        """This process's block of rows of a (whole, host) batch, as global sharded arrays."""
        count, position = sharding_lib.mesh_processes(self.layout.mesh)
        rows = next(iter(batch.values())).shape[0] // count
        start = position * rows
        return sharding_lib.shard_batch({k: v[start:start + rows] for k, v in batch.items()},
                                        self.layout.batch)

    def _length_batches(self, lengths):
        order = np.argsort(lengths, kind="stable")
        buckets = np.searchsorted(np.asarray(self.boundaries), np.asarray(lengths)[order])
        for b in np.unique(buckets):
            members = order[buckets == b]
            for start in range(0, members.size, self.batch_size):
                yield self.boundaries[b], members[start:start + self.batch_size]

    def _rows(self, count: int) -> int:
        """Rows of a batch of ``count`` sentences: the next power of two (few compiled
        shapes), at most ``batch_size``, and a multiple of the data shards under a layout."""
        rows = min(self.batch_size, 1 << max(count - 1, 0).bit_length())
        if self.layout is not None:
            multiple = self.layout.data_size * sharding_lib.mesh_processes(self.layout.mesh)[0]
            rows = -(-rows // multiple) * multiple
        return rows

    def _decode(self, sources: Sequence[str], decode_batch) -> list[list[tuple[str, float]]]:
        """Sorts sources by length into fixed-shape batches, decodes each with
        ``decode_batch(src [b, L], max_decode_len) -> (ids [b, n, M], scores [b, n])`` and
        restores the input order. Sources longer than ``max_len`` tokens are truncated."""
        c = self.model.config
        ids = [s[: c.max_len] for s in self.tokenizer.encode_source(sources)]
        out: list[list[tuple[str, float]]] = [[] for _ in ids]
        for length, members in self._length_batches([max(1, len(s)) for s in ids]):
            src = np.full((self._rows(members.size), length), c.pad_id, np.int32)
            for r, i in enumerate(members):
                src[r, : len(ids[i])] = ids[i]
            check_token_ids(src, name="src", vocab_size=c.src_vocab_size, max_len=c.max_len)
            src = self._place({"src": src})["src"] if self.layout else jnp.asarray(src)
            hyps, scores = sharding_lib.to_host(decode_batch(src, self.max_decode_len(length)))
            for r, i in enumerate(members):
                texts = self.tokenizer.decode(hyps[r])
                out[i] = list(zip(texts, (float(x) for x in scores[r])))
        return out

    def max_decode_len(self, source_length: int) -> int:
        """The output limit for a batch of padded source length ``source_length``."""
        return max(1, min(int(self.max_len_a * source_length + self.max_len_b), self.model.config.max_len))

    def translate_n_best(self, params: Any, sources: Sequence[str], *, beam_size: int = 4,
                         alpha: float = 0.6, length_normalization: str = "gnmt", early_stopping: bool = False,
                         penalties: Penalties = NO_PENALTIES) -> list[list[tuple[str, float]]]:
        """Beam search: for each source, ``beam_size`` (translation, score) pairs, best first.

        ``length_normalization="hf"`` decodes as Hugging Face ``generate`` does (length^α,
        its stopping rule, no source-length limit; :func:`jaxformer.decode.beam_search.beam_search`);
        ``early_stopping``: a sentence closes once ``beam_size`` hypotheses ended (fairseq's,
        CTranslate2's rule); ``penalties``: ``--no-repeat-ngram-size``, ``--repetition-penalty``
        (:mod:`jaxformer.decode.penalties`).
        """
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        extra_len = None if length_normalization == "hf" else self.max_len_b
        rule = dict(beam_size=beam_size, alpha=alpha, len_a=self.max_len_a, extra_len=extra_len,
                    length_normalization=length_normalization, bos_id=bos, eos_id=eos,
                    # left out when off, so the exported programs keep their cache keys
                    **({"early_stopping": True} if early_stopping else {}), **_penalty_static(penalties))
        if self.staged:
            staged = self._staged(**rule)
            return self._decode(sources, lambda src, max_decode_len: staged(params, src, max_decode_len))

        def decode_batch(src, max_decode_len):
            return self._decoder(beam_translate, max_decode_len=max_decode_len, **rule)(params, src)

        return self._decode(sources, decode_batch)

    def translate(self, params: Any, sources: Sequence[str], *, beam_size: int = 1,
                  alpha: float = 0.6, length_normalization: str = "gnmt", early_stopping: bool = False,
                  penalties: Penalties = NO_PENALTIES) -> list[str]:
        """Best translation of each source, in input order: greedy for ``beam_size=1``,
        else beam search with the length penalty α (``"gnmt"`` or ``"hf"``; with ``"hf"``
        greedy also forces eos at the last step, as ``generate``); ``penalties`` as in
        :meth:`translate_n_best`."""
        if beam_size > 1:
            return [n_best[0][0] for n_best in self.translate_n_best(
                params, sources, beam_size=beam_size, alpha=alpha, length_normalization=length_normalization,
                early_stopping=early_stopping, penalties=penalties)]
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        # Each sentence's own a·L + b limit, as beam search has ("hf": none, as generate).
        limits = {} if length_normalization == "hf" else dict(len_a=self.max_len_a, extra_len=self.max_len_b)

        def decode_batch(src, max_decode_len):
            hyp = self._decoder(greedy_translate, max_decode_len=max_decode_len, bos_id=bos, eos_id=eos,
                                forced_eos=length_normalization == "hf", **limits,
                                **_penalty_static(penalties))(params, src)
            return hyp[:, None], jnp.zeros(hyp.shape[:1] + (1,))

        return [n_best[0][0] for n_best in self._decode(sources, decode_batch)]

    def sample(self, params: Any, sources: Sequence[str], rng: jax.Array, *, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None,
               penalties: Penalties = NO_PENALTIES) -> list[str]:
        """One sampled translation per source (see :func:`jaxformer.decode.decoding.sample`)."""
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        counter = iter(range(1 << 30))

        def decode_batch(src, max_decode_len):
            hyp = self._decoder(sample_translate, max_decode_len=max_decode_len, bos_id=bos, eos_id=eos,
                                temperature=temperature, top_k=top_k, top_p=top_p,
                                len_a=self.max_len_a, extra_len=self.max_len_b,
                                **_penalty_static(penalties),
                                )(params, src, jax.random.fold_in(rng, next(counter)))
            return hyp[:, None], jnp.zeros(hyp.shape[:1] + (1,))

        return [n_best[0][0] for n_best in self._decode(sources, decode_batch)]

    def loss(self, params: Any, examples: Examples, eval_step: Callable) -> dict[str, float]:
        """Teacher-forced per-token loss, perplexity and accuracy on tokenized pairs.

        Args:
          eval_step: ``(params, batch) -> {"loss_sum", "nll_sum", "correct", "tokens"}``
            sums, jitted for this evaluator's layout (the trainer's
            :func:`jaxformer.train.step.jit_eval_step`).
        """
        totals = None
        lengths = [max(len(s), len(t) + 1) for s, t in zip(examples.src, examples.tgt)]
        rows = self._rows(self.batch_size)   # a multiple of the data shards under a layout
        for length, members in self._length_batches(lengths):
            indices = np.concatenate([members, np.full(rows - members.size, -1)])
            batch = collate(examples, length, indices, pad_id=self.model.config.pad_id,
                                     bos_id=self.tokenizer.bos_id, eos_id=self.tokenizer.eos_id)
            batch = self._place(batch) if self.layout else batch
            sums = eval_step(params, batch)
            totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
        totals = jax.device_get(totals)
        tokens = max(float(totals["tokens"]), 1.0)
        return {"loss": float(totals["loss_sum"]) / tokens,
                "ppl": math.exp(min(float(totals["nll_sum"]) / tokens, 50.0)),
                "accuracy": float(totals["correct"]) / tokens}

    def score(self, hypotheses: Sequence[str], references: Sequence[str]) -> float:
        """Corpus BLEU of ``hypotheses`` against one reference each.

        Raises:
          ValueError: the lists differ in length (sacrebleu would silently drop the
            extra hypotheses).
        """
        _check_aligned(hypotheses, references)
        return float(self.bleu.corpus_score(list(hypotheses), [list(references)]).score)

    def degenerate(self, hypotheses: Sequence[str]) -> dict[str, Any]:
        """The hypotheses that repeat an n-gram three or more times in a row
        (:func:`repeats_ngram` on the BLEU tokenizer's tokens: words and punctuation,
        characters of Chinese), the mark of a looping decoder.

        Returns:
          ``{"count", "fraction", "examples"}``: examples are the first three indices.
        """
        found = [i for i, h in enumerate(hypotheses) if repeats_ngram(self.bleu.tokenizer(h).split())]
        return {"count": len(found), "fraction": len(found) / max(len(hypotheses), 1),
                "examples": found[:3]}

    def scores(self, hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
        """Corpus BLEU and chrF with their sacrebleu signatures (the strings to report with
        the numbers): ``{"bleu", "bleu_signature", "chrf", "chrf_signature"}``.

        Raises:
          ValueError: the lists differ in length.
        """
        _check_aligned(hypotheses, references)
        refs = [list(references)]
        return {"bleu": float(self.bleu.corpus_score(list(hypotheses), refs).score),
                "bleu_signature": str(self.bleu.get_signature()),
                "chrf": float(self.chrf.corpus_score(list(hypotheses), refs).score),
                "chrf_signature": str(self.chrf.get_signature())}


def repeats_ngram(tokens: Sequence[str], times: int = 3, max_n: int = 4) -> bool:
    """Whether some n-gram (1 ≤ n ≤ ``max_n``) with a word in it (a token holding a letter
    or digit) occurs ``times`` or more times in a row: ``a , a , a ,`` (n = 2) and
    ``x x x`` (n = 1) do, ``a b a b`` does not, and neither does ``. . .`` (how the 13a
    tokenizer splits an ellipsis typed as three dots)."""
    tokens = list(tokens)
    wordy = [any(c.isalnum() for c in t) for t in tokens]
    for n in range(1, max_n + 1):
        for start in range(len(tokens) - n * times + 1):
            gram = tokens[start:start + n]
            if any(wordy[start:start + n]) and all(
                    tokens[start + r * n:start + (r + 1) * n] == gram for r in range(1, times)):
                return True
    return False


def _penalty_static(penalties: Penalties) -> dict[str, Penalties]:
    """The decoder's ``penalties`` argument, left out when inactive so the default keeps
    the compiled programs and export-cache keys it always had."""
    return {"penalties": penalties} if penalties.active else {}


def _check_aligned(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references: scoring "
                         f"needs one reference per hypothesis, in the same order.")


def make_bleu(target_language: str, tokenize: str | None = None):
    """sacrebleu's ``BLEU`` for ``target_language`` (its tokenizer choice) or ``tokenize``.

    Raises:
      ValueError: an unknown tokenizer name, or a MeCab tokenizer (``ja-mecab``,
        ``ko-mecab``) without its package; the message says how to install it and
        that ``--sacrebleu-tokenize char`` scores without it.
    """
    from sacrebleu.metrics.bleu import BLEU

    if tokenize is not None and tokenize not in BLEU.TOKENIZERS:
        raise ValueError(f"Unknown sacrebleu tokenizer {tokenize!r}; "
                         f"choose one of {sorted(BLEU.TOKENIZERS)}.")
    try:
        return BLEU(tokenize=tokenize, trg_lang=target_language)
    except (RuntimeError, ImportError) as e:   # sacrebleu's message for a missing MeCab
        chosen = tokenize or BLEU._TOKENIZER_MAP.get(target_language, BLEU.TOKENIZER_DEFAULT)
        extra = {"ja-mecab": "ja", "ko-mecab": "ko"}.get(chosen)
        install = f"pip install 'sacrebleu[{extra}]'" if extra else "install what sacrebleu asks for"
        reason = ("MeCab is not installed" if extra
                  else (str(e).strip().splitlines() or [type(e).__name__])[0].strip())
        raise ValueError(
            f"BLEU for target language {target_language!r} uses sacrebleu's {chosen!r} tokenizer, "
            f"which cannot start ({reason}). Either {install}, or pass --sacrebleu-tokenize char "
            f"(character BLEU, not comparable with published {chosen} scores).") from e
