"""Translation through CTranslate2 on CPUs (``jaxformer-translate --engine ct2``), with no JAX:
the run's tokenizer, decoding defaults and length limits, the model from
:func:`~jaxformer.serve.ct2_model.cached_model`.

CTranslate2's rules differ from the JAX engine's in three places (docs/translation.md,
"Serving with CTranslate2"): its length penalty is |Y|^α (``length_penalty``), never GNMT's;
beam search ends a sentence once ``beam_size`` hypotheses have ended (no exact stopping
rule); and the output limit is one per call, so each batch of sentences of similar source
length (sorted, as the JAX engine's batches are) gets a·L + b for its longest source L.
Sampling draws from CTranslate2's generator, seeded per call from ``--seed`` and the call's
first line index: reproducible for the same input and batches, but other draws than JAX's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from jaxformer.data.tokenizer import load_tokenizer, with_languages
from jaxformer.decode.defaults import decoding_defaults, length_limits
from jaxformer.model.config import TransformerConfig
from jaxformer.run.directory import RunDir
from jaxformer.serve.ct2_model import cached_model, find_checkpoint

INSTALL = "pip install -e '.[serve]'"   # the extra that brings ctranslate2


@dataclasses.dataclass(frozen=True)
class CT2Search:
    """CTranslate2's decoding settings: beam search (``beam_size`` 1: greedy) with length
    penalty |Y|^``alpha``, or with ``sample`` ancestral sampling (``temperature``, ``top_k``,
    ``top_p``; ``None``: off); the repetition rules and ``num_hypotheses`` (n-best) as named."""

    beam_size: int = 4
    alpha: float = 0.6
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    num_hypotheses: int = 1
    sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def options(self) -> dict[str, Any]:
        """``translate_batch``'s keyword arguments for these settings."""
        common = dict(repetition_penalty=self.repetition_penalty,
                      no_repeat_ngram_size=self.no_repeat_ngram_size, num_hypotheses=self.num_hypotheses,
                      return_scores=True, min_decoding_length=0,
                      max_input_length=0)   # sources arrive cut to max_len, as the JAX engine cuts them
        if self.sample:
            return dict(common, beam_size=1, sampling_temperature=self.temperature,
                        sampling_topk=self.top_k or 0, sampling_topp=self.top_p or 1.0)
        return dict(common, beam_size=self.beam_size, length_penalty=self.alpha)


def thread_layout(throughput: bool, inter_threads: int | None = None,
                  intra_threads: int | None = None) -> tuple[int, int]:
    """``(translators, threads each)`` for this machine's C usable cores: for ``throughput`` (a
    file) C translators of 1 thread, each on its own batches (on 2 cores 2.0× the sentences/s of
    1 × 2 at beam 4, benchmarks/README.md); for one sentence 1 translator of C threads. Given
    values are kept; a missing one fills the rest of the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if inter_threads is None and intra_threads is None:
        return (cores, 1) if throughput else (1, cores)
    if inter_threads is None:
        return max(1, cores // intra_threads), intra_threads
    return inter_threads, intra_threads or max(1, cores // inter_threads)


class CT2Engine:
    """A run's checkpoint decoded by ``ctranslate2.Translator`` on the CPU, with
    :class:`~jaxformer.decode.translator.Translator`'s face for the translate command:
    ``config``, ``tokenizer``, ``defaults``, ``kind``, ``step``, :meth:`decode`,
    :meth:`params_digest`.

    Args:
      workdir, checkpoint, batch_size, max_len_a, max_len_b: as ``Translator``'s.
      quantization: the weights' type (:data:`jaxformer.interop.ct2.QUANTIZATIONS`).
      throughput, inter_threads, intra_threads: the thread layout (:func:`thread_layout`).

    Raises ``ImportError`` (naming :data:`INSTALL`) without ctranslate2; ``FileNotFoundError``:
    not a run, no such checkpoint; ``ValueError``: a damaged record;
    ``jaxformer.interop.marian_weights.ConversionError``: a quantization or model CTranslate2
    cannot take.
    """

    def __init__(self, workdir: str | Path, *, checkpoint: str | int = "auto", quantization: str = "float32",
                 batch_size: int = 32, max_len_a: float | None = None, max_len_b: int | None = None,
                 throughput: bool = False, inter_threads: int | None = None,
                 intra_threads: int | None = None, src_lang: str | None = None, tgt_lang: str | None = None):
        try:
            import ctranslate2
        except ImportError as e:
            raise ImportError(f"--engine ct2 needs the ctranslate2 package ({e}): {INSTALL}") from None
        self.workdir = Path(workdir)
        record = RunDir(self.workdir).read_run_record()
        self.config = TransformerConfig.from_dict(record["model"])
        self.tokenizer = load_tokenizer(self.workdir, record)
        if src_lang or tgt_lang:   # a multilingual model's languages (M2M100/NLLB: its own codes)
            self.tokenizer = with_languages(self.tokenizer, src_lang, tgt_lang)
        self.defaults = decoding_defaults(record)
        self.max_len_a, self.max_len_b = length_limits(record, max_len_a, max_len_b)
        self.batch_size, self.quantization = batch_size, quantization
        self.checkpoint = find_checkpoint(self.workdir, checkpoint)
        self.kind, self.step = self.checkpoint.kind, self.checkpoint.step
        self.model_dir = cached_model(self.workdir, self.checkpoint, quantization)
        self.threads = thread_layout(throughput, inter_threads, intra_threads)
        ct2_config = json.loads((self.model_dir / "config.json").read_text())
        self._cut_eos = bool(ct2_config.get("add_source_eos"))   # CT2 appends the source's </s> itself
        vocab_file = next(self.model_dir / name for name in ("target_vocabulary.json",
                                                             "shared_vocabulary.json")
                          if (self.model_dir / name).is_file())
        self._target_ids = {piece: i for i, piece in enumerate(json.loads(vocab_file.read_text()))}
        banned = getattr(self.tokenizer, "banned_ids", None)   # a model's generation rules, else pad, bos
        banned = (self.config.pad_id, self.tokenizer.bos_id) if banned is None else banned
        self._suppress = [[piece] for piece in sorted(set(self.tokenizer.target_pieces(list(banned))))]
        forced = getattr(self.tokenizer, "forced_first_id", None)   # M2M100/NLLB: the target language
        self._prefix = None if forced is None else self.tokenizer.target_pieces([forced])
        self._ctranslate2 = ctranslate2
        self._translator = self._new_translator(*self.threads)

    def _new_translator(self, inter_threads: int, intra_threads: int):
        return self._ctranslate2.Translator(str(self.model_dir), device="cpu", inter_threads=inter_threads,
                                            intra_threads=intra_threads)

    def max_decode_len(self, source_length: int) -> int:
        """The most tokens of a sentence's output, eos included, for a source of ``source_length``
        tokens: a·L + b, within [1, max_len] (the JAX engine's limit)."""
        return max(1, min(int(self.max_len_a * source_length + self.max_len_b), self.config.max_len))

    def decode(self, sentences: list[str], search: CT2Search, *, seed: int | None = None,
               indices: list[int] | None = None, length_limits: bool = True) -> list[list[tuple[str, float]]]:
        """(translation, score) lists of ``sentences``, best first, in order (a blank one:
        ``[("", 0.0)]``); scores are CTranslate2's (log-probability over |Y|^α). Sources are cut
        to ``max_len`` tokens; ``seed`` and the first of ``indices`` seed sampling (a fresh
        one-thread translator per call); ``length_limits`` is accepted for the JAX engine's face
        (CTranslate2 always limits by batch)."""
        del length_limits
        todo = [i for i, sentence in enumerate(sentences) if sentence.strip()]
        ids = [s[: self.config.max_len] for s in self.tokenizer.encode_source([sentences[i] for i in todo])]
        translator = self._translator
        if search.sample:   # CT2's generator is per thread, seeded when the thread first draws
            first = (indices or [0])[0]
            self._ctranslate2.set_random_seed(int.from_bytes(
                hashlib.sha256(f"{seed or 0} {first}".encode()).digest()[:4], "little"))
            translator = self._new_translator(1, self.threads[1])
        order = sorted(range(len(todo)), key=lambda j: len(ids[j]))
        # The JAX engine's M tokens include the eos that ends a beam hypothesis (and, with the "hf"
        # rule of imported models, greedy's forced eos); CT2 stops at M without one.
        hf = self.defaults["length_normalization"] == "hf"
        beam_counts_eos = int(not search.sample and (search.beam_size > 1 or hf))
        pending = []
        for start in range(0, len(order), self.batch_size):
            members = order[start: start + self.batch_size]
            pieces = [self.tokenizer.source_pieces(ids[j][:-1] if self._cut_eos else ids[j]) for j in members]
            limit = self.max_decode_len(max(len(ids[j]) for j in members))
            prefix = None if self._prefix is None else [self._prefix] * len(pieces)
            pending.append((members, translator.translate_batch(
                pieces, prefix, asynchronous=True, max_decoding_length=limit - beam_counts_eos,
                suppress_sequences=self._suppress or None, **search.options())))
        out = [[("", 0.0)] for _ in sentences]
        for members, results in pending:
            for j, result in zip(members, results):
                result = result.result()
                texts = self.tokenizer.decode([[self._target_ids.get(p, self.tokenizer.unk_id) for p in hyp]
                                               for hyp in result.hypotheses])
                out[todo[j]] = list(zip(texts, (float(s) for s in result.scores)))
        return out

    def params_digest(self) -> str:
        """The checkpoint's fingerprint and the quantization (a bulk job's record)."""
        return f"{self.checkpoint.fingerprint()} {self.quantization}"

    def describe(self) -> str:
        """One line: the engine, its model and thread layout."""
        inter, intra = self.threads
        return (f"CTranslate2 {self._ctranslate2.__version__}, {self.quantization}, {inter} translator(s) × "
                f"{intra} thread(s), model {self.model_dir}")

