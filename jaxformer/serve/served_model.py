"""One served run (:class:`ServedModel`): its engine behind a :class:`~jaxformer.serve.batcher.Batcher`,
the pairs it serves in LibreTranslate's codes, and texts (plain or HTML) translated as
sentences in one engine call and joined back (:meth:`ServedModel.translate`). No decoding of
its own: every translation is the engine's, under one fixed output limit (the run's
``max_len_a`` 0, ``max_len_b`` fixed at load), so a sentence's translation never depends on what
it was batched with.

``alternatives`` N (LibreTranslate's field) asks for N more translations: the beam stays the
run's when N + 1 fits in it, else widens to ``alternatives_limit`` + 1 (one wider beam per model,
so the JAX engine's warm-up compiles both); N is at most ``alternatives_limit``. Alternative k
of a text is its sentences' k-th hypotheses (each sentence's last where it has fewer), as
argostranslate builds them; duplicates and the translation itself are dropped.
"""

from __future__ import annotations

import dataclasses
import io
import re
import unicodedata
from collections.abc import Iterator, Sequence
from typing import Any

from jaxformer.decode.engine import Engine, Request, Translation, refusal
from jaxformer.decode.text import TextPlan
from jaxformer.serve.batcher import Batcher
from jaxformer.serve.languages import Route, lt_codes
from jaxformer.serve.markup import HtmlPlan


@dataclasses.dataclass
class Result:
    """One text's answer: its translation, alternatives, sentence scores and notes."""

    text: str
    alternatives: list[str]
    scores: list[float]
    notes: list[str]


@dataclasses.dataclass(frozen=True)
class Extras:
    """Our fields beyond LibreTranslate's: ``terminology`` (source term → target term, held by
    each sentence whose source has the term as whole words: constrained beam search) and
    ``prefix`` (each text's first sentence starts with it), both the JAX engine's."""

    terminology: tuple[tuple[str, str], ...] = ()
    prefix: str = ""

    def __bool__(self) -> bool:
        return bool(self.terminology or self.prefix.strip())


class ServedModel:
    """``engine`` serving the pair ``pair`` (LibreTranslate's codes; ``None``: the run's recorded
    pair) or, for a multilingual run, every pair of its languages, as ``name`` (default: the pair,
    ``en-de``, or a multilingual run's folder name; it labels the metrics and logs). Raises
    ``ValueError`` for a run of one pair that records no source or target language and was
    given none, naming ``--workdir RUN:SRC-TGT``."""

    def __init__(self, engine: Engine, *, pair: tuple[str, str] | None = None, name: str | None = None,
                 alternatives_limit: int, wait_s: float, max_sentences: int, max_queue: int,
                 workers: int = 1, metrics: Any = None):
        self.engine, self.run = engine, engine.run
        self.multilingual = self.run.multilingual
        self.beam = int(self.run.defaults["beam_size"])
        self.alternatives_limit = alternatives_limit
        self.alternatives_beam = max(self.beam, alternatives_limit + 1)
        sources, targets = self.run.languages
        if self.multilingual:
            self.codes = lt_codes(sources)   # model code -> LibreTranslate code
        else:
            if pair is None and not (sources and targets):
                missing = " and ".join(side for side, have in (("source", sources), ("target", targets))
                                       if not have)
                raise ValueError(f"the run {self.run.root} records no {missing} language: give its pair as "
                                 f"--workdir {self.run.root}:SRC-TGT (e.g. :en-de).")
            self.pair = pair or tuple(lt_codes([sources[0], targets[0]]).values())
        self.name = name or (self.run.root.name if self.multilingual else "-".join(self.pair))
        self.batcher = Batcher(self._call, wait_s=wait_s, max_sentences=max_sentences, max_queue=max_queue,
                               workers=workers, name=self.name,
                               on_call=metrics and metrics.on_call(self.name),
                               on_error=metrics and metrics.on_error(self.name))
        if metrics is not None:
            metrics.watch_queue(self.name, lambda: self.batcher.waiting)

    def pairs(self) -> Iterator[tuple[str, str, str | None, str | None]]:
        """``(source, target, model source, model target)``: LibreTranslate's and the model's codes."""
        if not self.multilingual:
            yield self.pair[0], self.pair[1], None, None
            return
        for src, src_code in self.codes.items():
            for tgt, tgt_code in self.codes.items():
                if src != tgt:
                    yield src_code, tgt_code, src, tgt

    @property
    def features(self) -> frozenset[str]:
        """What its engine honours (:data:`jaxformer.decode.engine.FEATURES`)."""
        return self.engine.honours

    def _call(self, sentences: list[str], request: Request) -> list[Translation]:
        return self.engine.translate(sentences, request)

    def request(self, route: Route, alternatives: int = 0) -> Request:
        """The engine request of a route with ``alternatives``: the run's beam, or the wider one."""
        if alternatives + 1 <= self.beam:
            return Request(n_best=alternatives + 1, src_lang=route.src_lang, tgt_lang=route.tgt_lang)
        return Request(beam_size=self.alternatives_beam, n_best=alternatives + 1, src_lang=route.src_lang,
                       tgt_lang=route.tgt_lang)

    def refusal(self, extras: Extras) -> str | None:
        """Why this model's engine cannot serve ``extras``, or ``None``."""
        needs = Request(constraints=(("x",),) if extras.terminology else None,
                        prefixes=("x",) if extras.prefix.strip() else None)
        problem = refusal(self.engine, needs)
        return problem and f"{problem}: serve this model with --engine jax"

    def counter(self, route: Route):
        """Token counts of sentences as the engine encodes them (eos and language tokens included)."""
        tokenizer = self.run.tokenizer_for(route.src_lang, route.tgt_lang)
        return lambda sentences: [len(ids) for ids in tokenizer.encode_source(sentences)]

    async def translate(self, texts: Sequence[str], route: Route, *, source: str, html: bool = False,
                        alternatives: int = 0, extras: Extras = Extras()) -> list[Result]:
        """Each text's :class:`Result`: its sentences (all texts') translated in one batched
        request. ``source``: the source's code (sentence rules); ``html``: the texts are HTML
        (:class:`~jaxformer.serve.markup.HtmlPlan`; no alternatives). Raises
        :class:`~jaxformer.serve.batcher.QueueFull`, or the engine's error."""
        count, max_len = self.counter(route), self.run.config.max_len
        plan_text = lambda text: TextPlan(text, source, count, max_len)   # noqa: E731
        plans = [HtmlPlan(text, plan_text) if html else plan_text(text) for text in texts]
        sentences = [s for plan in plans for s in plan.sentences]
        alternatives = 0 if html else alternatives   # none for HTML: the translation stays the one without
        request = self.request(route, alternatives)
        if extras:
            request = dataclasses.replace(request, **_extras_fields(plans, extras))
        translations = await self.batcher.translate(sentences, request, alone=bool(extras))
        results, at = [], 0
        for plan in plans:
            mine = translations[at:at + len(plan.sentences)]
            at += len(plan.sentences)
            results.append(_result(plan, mine, alternatives))
        return results

    def warm_up(self) -> int:
        """Translates a sentence of each source length bucket (the JAX engine's; CTranslate2 has
        one) under the run's beam and the alternatives' beam, so no request compiles after. Runs on
        the engine's thread (:meth:`Batcher.run`); returns the sentences translated."""
        route = next(Route(self, src, tgt) for _, _, src, tgt in self.pairs())
        if self.multilingual and self.run.tokenizer.src_lang and self.run.tokenizer.tgt_lang:
            route = Route(self, self.run.tokenizer.src_lang, self.run.tokenizer.tgt_lang)
        count = self.counter(route)
        evaluator = getattr(self.engine, "evaluator", None)   # the JAX engine's buckets of source lengths
        lengths = list(evaluator.boundaries) if evaluator is not None else [8]
        sentences = [_sentence_of(count, n) for n in lengths]
        requests = [self.request(route)]
        if self.alternatives_limit + 1 > self.beam:   # the wider beam is another program
            requests.append(self.request(route, self.alternatives_limit))
        done = 0
        for request in requests:
            for sentence in sentences:
                self.engine.translate([sentence], request)
                done += 1
        return done

    def attention_png(self, sentence: str, translation: str) -> bytes:
        """The cross-attention heat map (PNG, mean of layers and heads) of ``sentence`` and its
        ``translation`` (the JAX engine's; ``ValueError`` otherwise)."""
        if "attention" not in self.features or self.multilingual:
            raise ValueError("the heat map is drawn by the JAX engine for a model of one pair "
                             "(jaxformer-serve --engine jax)")
        from jaxformer.decode.translator import save_attention_png

        weights, src_pieces, tgt_pieces = self.engine.cross_attention(sentence, translation)
        buffer = io.BytesIO()
        save_attention_png(buffer, weights, src_pieces, tgt_pieces,
                           title="cross-attention (mean of layers and heads)")
        return buffer.getvalue()


def _sentence_of(count, length: int) -> str:
    """A sentence of at most ``length`` tokens, as long as such sentences of "a" go."""
    low, high = 1, max(1, length)
    while low < high:   # the most words whose tokens fit
        mid = (low + high + 1) // 2
        low, high = (mid, high) if count([" ".join(["a"] * mid)])[0] <= length else (low, mid - 1)
    return " ".join(["a"] * low)


def _terms_in(sentence: str, terminology: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """The target terms whose source term ``sentence`` holds as whole words (after NFKC)."""
    text = unicodedata.normalize("NFKC", sentence)
    found = []
    for source, target in terminology:
        term = re.escape(unicodedata.normalize("NFKC", source).strip())
        if re.search(rf"(?<!\w){term}(?!\w)", text):
            found.append(target)
    return tuple(found)


def _extras_fields(plans: Sequence[TextPlan], extras: Extras) -> dict[str, Any]:
    """The request's per-sentence ``constraints`` and ``prefixes`` for ``extras``."""
    constraints, prefixes = [], []
    for plan in plans:
        for i, sentence in enumerate(plan.sentences):
            constraints.append(_terms_in(sentence, extras.terminology))
            prefixes.append(extras.prefix if i == 0 else "")
    return {"constraints": tuple(constraints) if extras.terminology else None,
            "prefixes": tuple(prefixes) if extras.prefix.strip() else None}


def _result(plan, translations: Sequence[Translation], alternatives: int) -> Result:
    """A plan's :class:`Result` from its sentences' translations."""
    text = plan.join([t.text for t in translations])
    others = [plan.join([t.hypotheses[min(k, len(t.hypotheses) - 1)][0] for t in translations])
              for k in range(1, alternatives + 1)]
    unique = [a for a in dict.fromkeys(others) if a not in (text, "")]
    return Result(text, unique, [float(t.hypotheses[0][1]) for t in translations],
                  [note for t in translations for note in t.notes])
