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
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from jaxformer.decode.engine import Request, Translation, refusal, translate_nonblank
from jaxformer.decode.served_run import ServedRun
from jaxformer.serve.ct2_model import cached_model

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

    @classmethod
    def of(cls, request: Request, defaults: dict[str, Any]) -> CT2Search:
        """``request``'s settings over a run's ``defaults``, but for the repetition penalty: the
        run's was tuned on log-probabilities, and on CT2's logits it is far stronger
        (docs/translation.md), so CT2 takes it from the request alone."""
        rules = request.rules(defaults)
        return cls(rules["beam_size"], rules["alpha"], request.repetition_penalty or 1.0,
                   rules["no_repeat_ngram_size"], request.n_best, request.sample, request.temperature,
                   request.top_k, request.top_p)

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


def import_ctranslate2():
    """The ``ctranslate2`` module. Raises ``ImportError`` naming what failed: not installed (and
    :data:`INSTALL`), or installed but not importable here (a missing shared library, a build
    for other CPUs), with the import's own error."""
    try:
        import ctranslate2
    except ImportError as e:
        if e.name == "ctranslate2":   # not there at all
            raise ImportError(f"--engine ct2 needs the ctranslate2 package, which is not installed: "
                              f"{INSTALL}") from None
        raise ImportError(f"ctranslate2 is installed but cannot be imported here ({e}); reinstall it "
                          f"(pip install --force-reinstall ctranslate2) or use --engine jax") from None
    except OSError as e:   # a shared library that cannot be loaded
        raise ImportError(f"ctranslate2 is installed but cannot be imported here ({e}); reinstall it "
                          f"(pip install --force-reinstall ctranslate2) or use --engine jax") from None
    return ctranslate2


class CT2Engine:
    """The CTranslate2 engine (:class:`jaxformer.decode.engine.Engine`): a run's checkpoint
    decoded by ``ctranslate2.Translator`` on the CPU, its model converted once per checkpoint
    (:func:`~jaxformer.serve.ct2_model.cached_model`). It honours sampling and n-best lists;
    constraints, prefixes, GNMT's length penalty, the exact stop and attention maps are the JAX
    engine's.

    Args:
      run: the run (:class:`~jaxformer.decode.served_run.ServedRun`), or its folder (then
        ``load`` holds :meth:`ServedRun.load`'s options).
      quantization: the weights' type (:data:`jaxformer.interop.ct2.QUANTIZATIONS`).
      batch_size: the most sentences per ``translate_batch`` call.
      throughput, inter_threads, intra_threads: the thread layout (:func:`thread_layout`).

    Raises ``ImportError`` (:func:`import_ctranslate2`); ``FileNotFoundError``: not a run, no
    such checkpoint; ``ValueError``: a damaged record;
    ``jaxformer.interop.ConversionError``: a quantization or model CTranslate2 cannot take.
    """

    name = "ct2"
    honours = frozenset({"sampling", "n_best"})

    def __init__(self, run: ServedRun | str | Path, *, quantization: str = "float32", batch_size: int = 32,
                 throughput: bool = False, inter_threads: int | None = None,
                 intra_threads: int | None = None, **load):
        self._ctranslate2 = import_ctranslate2()
        self.run = run if isinstance(run, ServedRun) else ServedRun.load(run, **load)
        self.config, self.tokenizer, self.defaults = self.run.config, self.run.tokenizer, self.run.defaults
        self.batch_size, self.quantization = batch_size, quantization
        self.model_dir, self.checkpoint = cached_model(self.run, quantization)
        self.threads = thread_layout(throughput, inter_threads, intra_threads)
        ct2_config = json.loads((self.model_dir / "config.json").read_text())
        self._cut_eos = bool(ct2_config.get("add_source_eos"))   # CT2 appends the source's </s> itself
        vocab_file = next(self.model_dir / name for name in ("target_vocabulary.json",
                                                             "shared_vocabulary.json")
                          if (self.model_dir / name).is_file())
        self._target_ids = {piece: i for i, piece in enumerate(json.loads(vocab_file.read_text()))}
        self._translator = self._new_translator(*self.threads)

    def _new_translator(self, inter_threads: int, intra_threads: int):
        return self._ctranslate2.Translator(str(self.model_dir), device="cpu", inter_threads=inter_threads,
                                            intra_threads=intra_threads)

    def max_decode_len(self, source_length: int) -> int:
        """The most tokens of a sentence's output, eos included, for a source of ``source_length``
        tokens: a·L + b, within [1, max_len] (the JAX engine's limit)."""
        return max(1, min(int(self.run.max_len_a * source_length + self.run.max_len_b), self.config.max_len))

    def translate(self, sentences: list[str], request: Request, *, first_index: int = 0) -> list[Translation]:
        """:meth:`Engine.translate <jaxformer.decode.engine.Engine.translate>`; scores are
        CTranslate2's (log-probability over |Y|^α). Sources are cut to ``max_len`` tokens;
        sampling is seeded from the request's seed and ``first_index`` (a fresh one-thread
        translator per call: CT2's generator is per thread, seeded when the thread first draws).
        Raises ``ValueError`` for a request it cannot honour."""
        problem = refusal(self, request)
        if problem:
            raise ValueError(problem + ": use the JAX engine (--engine jax).")
        return translate_nonblank(sentences, request, first_index,
                                  functools.partial(self._translate, first_index=first_index))

    def _translate(self, sentences: list[str], request: Request, indices: list[int], *,
                   first_index: int) -> list[Translation]:
        tokenizer = self.run.tokenizer_for(request.src_lang, request.tgt_lang)
        search = CT2Search.of(request, self.defaults)
        ids = [s[: self.config.max_len] for s in tokenizer.encode_source(sentences)]
        translator = self._translator
        if search.sample:   # CT2's generator is per thread, seeded when the thread first draws
            self._ctranslate2.set_random_seed(int.from_bytes(
                hashlib.sha256(f"{request.seed} {first_index}".encode()).digest()[:4], "little"))
            translator = self._new_translator(1, self.threads[1])
        order = sorted(range(len(ids)), key=lambda j: len(ids[j]))
        # CTranslate2 never forces eos: at its last step it finishes the best candidates whatever
        # their token, its M counting the eos step. Where the JAX engine forces eos at the limit (a
        # beam hypothesis of our runs, greedy's with the "hf" rule; an imported model's
        # forced_eos_token_id) CT2 stops one step earlier, so both put their last word at M - 1.
        forced = self.run.forced_eos
        hf = self.defaults["length_normalization"] == "hf"
        eos_at_limit = not search.sample and ((search.beam_size > 1 or hf) if forced is None else forced)
        prefix, suppress = self.generation_rules(tokenizer)
        pending = []
        for start in range(0, len(order), self.batch_size):
            members = order[start: start + self.batch_size]
            pieces = [tokenizer.source_pieces(ids[j][:-1] if self._cut_eos else ids[j]) for j in members]
            limit = self.max_decode_len(max(len(ids[j]) for j in members))
            pending.append((members, translator.translate_batch(
                pieces, None if prefix is None else [prefix] * len(pieces), asynchronous=True,
                max_decoding_length=limit - eos_at_limit, suppress_sequences=suppress,
                **search.options())))
        out: list[Translation] = [None] * len(ids)
        for members, results in pending:
            for j, result in zip(members, results):
                result = result.result()
                texts = tokenizer.decode([[self._target_ids.get(p, tokenizer.unk_id) for p in hyp]
                                          for hyp in result.hypotheses])
                out[j] = Translation(tuple(zip(texts, (float(s) for s in result.scores))))
        return out

    def generation_rules(self, tokenizer) -> tuple[list[str] | None, list[list[str]] | None]:
        """``(target prefix, suppressed sequences)`` as ``translate_batch`` takes them: a
        multilingual model's target language forced first (M2M100/NLLB), and the ids its
        generation rules never produce (by default pad and the decoder start), as pieces."""
        forced = getattr(tokenizer, "forced_first_id", None)
        prefix = None if forced is None else tokenizer.target_pieces([forced])
        banned = getattr(tokenizer, "banned_ids", None)
        banned = (self.config.pad_id, tokenizer.bos_id) if banned is None else banned
        return prefix, [[piece] for piece in sorted(set(tokenizer.target_pieces(list(banned))))] or None

    def rules(self, request: Request) -> str:
        """The rules line of the translate command: CTranslate2's beam search rules."""
        search = CT2Search.of(request, self.defaults)
        if search.sample:
            return "sampling"
        if search.beam_size == 1:
            return "greedy"
        return (f"beam {search.beam_size}, CTranslate2's rules: length penalty |Y|^{search.alpha}, a "
                f"sentence ends once {search.beam_size} hypotheses ended, one length limit per batch of "
                f"similar sources, repetition penalty {search.repetition_penalty:g} on the logits"
                + (f", no repeated {search.no_repeat_ngram_size}-gram" if search.no_repeat_ngram_size
                   else ""))

    def describe(self) -> str:
        """One line: the engine, its model and thread layout."""
        inter, intra = self.threads
        return (f"CTranslate2 {self._ctranslate2.__version__}, {self.quantization}, {inter} translator(s) × "
                f"{intra} thread(s), model {self.model_dir}")

    def digest(self) -> dict[str, Any]:
        """The engine, the checkpoint's fingerprint with the quantization, and the thread layout
        (a bulk job's record: each changes the bytes)."""
        return {"engine": "ct2", "params_sha256": f"{self.checkpoint.fingerprint()} {self.quantization}",
                "quantization": self.quantization, "ct2_threads": list(self.threads)}

    def close(self) -> None:
        """Releases the CTranslate2 translator and its threads."""
        self._translator = None
