"""One interface for every engine that translates a run (:class:`Engine`): the JAX
:class:`~jaxformer.decode.translator.Translator` and the CTranslate2 engine
(:class:`jaxformer.serve.ct2_engine.CT2Engine`) implement it over one
:class:`~jaxformer.decode.served_run.ServedRun`; the translate command, bulk mode, the
exporters and the HTTP service use nothing else. A new engine is one class with these
attributes and methods (``tests/test_engine.py`` has one).

A :class:`Request` says how to translate (each option left ``None`` takes the run's default,
:attr:`ServedRun.defaults`); :meth:`Engine.translate` returns a :class:`Translation` per
sentence, in order, a blank sentence an empty one. What an engine can honour beyond plain beam
search and greedy is :attr:`Engine.honours`, a set of :data:`FEATURES`.

Mirrors CTranslate2's ``Translator`` (one object per model, loading kept apart from
translating, ``translate_batch(sources, options) -> results with hypotheses and scores``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from jaxformer.decode.served_run import ServedRun
from jaxformer.model.validation import check_count, check_real
from jaxformer.run.checkpoint_files import Checkpoint

# What a request may ask beyond beam search and greedy decoding with the |Y|^α length penalty
# and the k-finished stop (what every engine does):
FEATURES = frozenset({
    "sampling",        # Request.sample: ancestral sampling, seeded per line
    "n_best",          # Request.n_best > 1: several hypotheses with scores
    "gnmt",            # length_normalization "gnmt": ((5+|Y|)/6)^α (paper §6.1)
    "exact_stop",      # early_stopping False: beam search's exact stopping rule
    "constraints",     # Request.constraints: target phrases every translation holds
    "prefix",          # Request.prefixes: a target prefix each translation starts with
    "attention",       # cross_attention(): a sentence's cross-attention weights
})


@dataclasses.dataclass(frozen=True)
class Request:
    """How to translate a batch of sentences; ``None`` takes the run's default.

    Attributes:
      beam_size: the beam width (1: greedy).
      alpha: the length penalty's exponent α.
      length_normalization: ``"gnmt"`` ((5 + |Y|)/6)^α or ``"hf"`` |Y|^α with ``generate``'s rules.
      early_stopping: end a sentence once ``beam_size`` hypotheses ended.
      no_repeat_ngram_size, repetition_penalty: the repetition rules (0, 1: off).
      n_best: hypotheses returned per sentence (≤ the beam).
      sample, temperature, top_k, top_p, seed: ancestral sampling, sentence i drawing from
        ``seed`` and its line index (``first_index + i``).
      constraints: per sentence, target phrases its translation must hold; prefixes: per
        sentence, the target prefix it starts with (``""``: none).
      src_lang, tgt_lang: a multilingual model's languages for this request (its codes); a
        model of one pair takes only its own.

    Raises ``ValueError`` (when made) for a value out of its range, naming it.
    """

    beam_size: int | None = None
    alpha: float | None = None
    length_normalization: str | None = None
    early_stopping: bool | None = None
    no_repeat_ngram_size: int | None = None
    repetition_penalty: float | None = None
    n_best: int = 1
    sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    constraints: tuple[tuple[str, ...], ...] | None = None
    prefixes: tuple[str, ...] | None = None
    src_lang: str | None = None
    tgt_lang: str | None = None

    def __post_init__(self):
        for name, minimum in (("beam_size", 1), ("no_repeat_ngram_size", 0), ("n_best", 1), ("top_k", 1)):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name), minimum=minimum)
        check_count("seed", self.seed, minimum=0, maximum=2**32 - 1)
        for name, above in (("alpha", None), ("repetition_penalty", 0.0), ("temperature", 0.0)):
            if getattr(self, name) is not None:
                check_real(name, getattr(self, name), above=above)
        problems = []
        if self.length_normalization not in (None, "gnmt", "hf"):
            problems.append(f"length_normalization must be 'gnmt' or 'hf', got {self.length_normalization!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.sample and self.n_best > 1:
            problems.append("n_best lists come from beam search; sampling draws one translation per sentence")
        if self.sample and (self.constraints or self.prefixes):
            problems.append("constraints and prefixes need (constrained) beam search, not sampling")
        if self.beam_size is not None and self.n_best > self.beam_size:
            problems.append(f"n_best {self.n_best} needs a beam at least as wide (beam_size "
                            f"{self.beam_size})")
        if problems:
            raise ValueError("; ".join(problems) + ".")

    def needs(self) -> frozenset[str]:
        """The :data:`FEATURES` this request asks for (``gnmt``/``exact_stop`` only where it says so)."""
        asked = {"sampling": self.sample, "n_best": self.n_best > 1,
                 "gnmt": self.length_normalization == "gnmt", "exact_stop": self.early_stopping is False,
                 "constraints": bool(self.constraints and any(self.constraints)),
                 "prefix": bool(self.prefixes and any(p.strip() for p in self.prefixes))}
        return frozenset(name for name, wanted in asked.items() if wanted)

    def rules(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """``defaults`` (a run's :attr:`ServedRun.defaults`) with this request's options over them."""
        return {**defaults, **{k: getattr(self, k) for k in defaults
                               if hasattr(self, k) and getattr(self, k) is not None}}


@dataclasses.dataclass(frozen=True)
class Translation:
    """One sentence's result: ``hypotheses`` (text, score) best first — scores are
    log-probabilities over the length penalty (0.0 for greedy and sampled ones) — and ``notes``
    about it (a constraint that could not be met, say), each a sentence without its line number."""

    hypotheses: tuple[tuple[str, float], ...]
    notes: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The best translation."""
        return self.hypotheses[0][0]


BLANK = Translation((("", 0.0),))   # what a blank sentence translates to


@runtime_checkable
class Engine(Protocol):
    """What any engine offers (see the module docstring)."""

    name: str                  # "jax", "ct2": how the command line and bulk manifests name it
    run: ServedRun             # the run it translates, as loaded
    checkpoint: Checkpoint     # the checkpoint it decodes (a fallback from run.checkpoint, maybe)
    honours: frozenset[str]    # the FEATURES it can serve

    def translate(self, sentences: Sequence[str], request: Request, *,
                  first_index: int = 0) -> list[Translation]:
        """A :class:`Translation` per sentence, in order; sentence i is line ``first_index + i`` of
        the whole input (its sampling key, its notes). Raises ``ValueError`` for a request this
        engine cannot honour (:meth:`refusal`)."""

    def rules(self, request: Request) -> str:
        """The decoding rules ``request`` runs under, in a few words (the command's rules line)."""

    def describe(self) -> str:
        """The engine, its model and its threads or devices, in one line."""

    def digest(self) -> dict[str, Any]:
        """What its outputs depend on besides the request, for a bulk job's manifest (``engine``,
        ``params_sha256`` and any engine settings)."""

    def close(self) -> None:
        """Frees what it holds (worker threads, device memory)."""


def refusal(engine: Engine, request: Request) -> str | None:
    """Why ``engine`` cannot honour ``request`` (the features it lacks, named), or ``None``."""
    lacking = sorted(request.needs() - engine.honours)
    if not lacking:
        return None
    return (f"the {engine.name} engine cannot honour {', '.join(lacking)}"
            f" (it honours {', '.join(sorted(engine.honours)) or 'beam search and greedy only'})")


def translate_nonblank(sentences: Sequence[str], request: Request, first_index: int,
                       translate: Callable[[list[str], Request, list[int]], list[Translation]]
                       ) -> list[Translation]:
    """:meth:`Engine.translate` for an engine's ``translate(sentences, request, indices)`` of
    non-blank sentences only (``indices``: their line indices in the whole input): a blank
    sentence is :data:`BLANK`, never decoded. Raises ``TypeError`` unless ``sentences`` is a
    sequence of strings, ``ValueError`` for per-sentence lists of another length."""
    if not isinstance(sentences, (list, tuple)) or not all(isinstance(s, str) for s in sentences):
        raise TypeError(f"sentences must be a list of strings, got {type(sentences).__name__}"
                        + (": wrap one sentence in a list" if isinstance(sentences, str) else ""))
    for name in ("constraints", "prefixes"):
        values = getattr(request, name)
        if values is not None and len(values) != len(sentences):
            raise ValueError(f"request.{name} has {len(values)} entries for {len(sentences)} sentences: "
                             f"give one per sentence.")
    check_count("first_index", first_index, minimum=0, maximum=2**31 - 1 - len(sentences))
    todo = [i for i, sentence in enumerate(sentences) if sentence.strip()]
    out = [BLANK] * len(sentences)
    if todo:
        picked = dataclasses.replace(
            request, **{name: tuple(getattr(request, name)[i] for i in todo)
                        for name in ("constraints", "prefixes") if getattr(request, name) is not None})
        done = translate([sentences[i] for i in todo], picked, [first_index + i for i in todo])
        for i, translation in zip(todo, done):
            out[i] = translation
    return out
