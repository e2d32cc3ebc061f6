"""The languages a service offers, in LibreTranslate's codes (:class:`Catalog`): which served
model translates a pair, ``/languages`` as LibreTranslate answers it, and the detection behind
``source=auto`` and ``/detect`` (:class:`Detector`).

LibreTranslate's codes are ISO 639-1 where one exists (``en``, ``de``), else ISO 639-3, with a
script only where a language is written in several (``zh-Hans``, ``zh-Hant``, ``sr-Cyrl``); its
short forms ``zh``, ``zt`` and ``pb`` are taken too (``libretranslate/language.py``). A model's
own codes (M2M100 ``en``, NLLB ``eng_Latn``) are mapped with ``langcodes``' standard tags; names
are ``langcodes``' English names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import langcodes

ALIASES = {"zh": "zh-hans", "zt": "zh-hant", "pb": "pt-br"}   # LibreTranslate's short codes, lowercased


def lt_codes(model_codes: Iterable[str]) -> dict[str, str]:
    """LibreTranslate's codes for a model's language codes: the language's ISO 639-1 code where
    one exists, else its ISO 639-3 (``eng_Latn`` → ``en``, ``arb_Arab`` → ``ar``, ``ast_Latn`` →
    ``ast``), with the script only for a language the model has in several (``zho_Hans`` →
    ``zh-Hans``); where two codes would meet, the later keeps its own (``twi_Latn``, beside
    ``aka_Latn`` → ``ak``). A code ``langcodes`` cannot read stays as it is."""
    tags = {}
    for code in model_codes:
        try:
            tags[code] = langcodes.Language.get(langcodes.standardize_tag(code.replace("_", "-"), macro=True))
        except (ValueError, langcodes.LanguageTagError):
            tags[code] = None
    scripts: dict[str, set] = {}
    for tag in filter(None, tags.values()):
        scripts.setdefault(tag.language, set()).add(tag.script)
    out: dict[str, str] = {}
    taken: set[str] = set()
    for code, tag in tags.items():
        if tag is None or not tag.language:
            mapped = code
        elif len(scripts[tag.language]) > 1:
            mapped = tag.language + (f"-{tag.script}" if tag.script else "")
        else:
            mapped = tag.language + (f"-{tag.territory}" if tag.territory else "")
        out[code] = code if mapped.lower() in taken else mapped
        taken.add(out[code].lower())
    return out


def language_name(code: str) -> str:
    """The language's English name (``de`` → ``German``), or the code where none is known."""
    try:
        name = langcodes.Language.get(code).display_name()
    except (ValueError, langcodes.LanguageTagError):
        return code
    return code if name.startswith("Unknown language") else name


def _primary(code: str) -> str:
    """The language subtag of a code (``zh-Hant`` → ``zh``), or the code where it is no tag."""
    try:
        return langcodes.Language.get(code).language or code
    except (ValueError, langcodes.LanguageTagError):
        return code


def lookup_key(code: str) -> str:
    """The form a request's code is looked up in: lowercased, LibreTranslate's short forms expanded."""
    code = code.strip().lower()
    return ALIASES.get(code, code)


@dataclasses.dataclass(frozen=True)
class Route:
    """One direction a served model translates: the model and its own codes for the pair
    (``None`` for a model of one pair, which takes none)."""

    model: Any
    src_lang: str | None
    tgt_lang: str | None


class Catalog:
    """Every pair the served models translate, by LibreTranslate code.

    ``models``: objects with ``name``, ``pairs()`` — ``(source code, target code, model source
    code, model target code)`` in LibreTranslate's and the model's codes — and ``multilingual``.
    A model of one pair serves its pair before a multilingual model that also has it (said in
    :attr:`notes`). Raises ``ValueError`` naming both models when two of one kind serve a pair.
    """

    def __init__(self, models: Iterable[Any]):
        self.routes: dict[tuple[str, str], Route] = {}
        self.codes: dict[str, str] = {}          # lookup key -> code as shown
        owners: dict[tuple[str, str], Any] = {}
        self.notes: list[str] = []
        shadowed: dict[tuple[str, str], int] = {}
        for model in sorted(models, key=lambda m: m.multilingual):   # pair models first
            for src, tgt, model_src, model_tgt in model.pairs():
                key = (lookup_key(src), lookup_key(tgt))
                if key in owners:
                    other = owners[key]
                    if other.multilingual == model.multilingual:
                        raise ValueError(f"{other.name} and {model.name} both translate {src} → {tgt}: serve "
                                         f"one model per pair (drop one --workdir, or give another pair "
                                         f"as --workdir RUN:SRC-TGT).")
                    shadowed[(other.name, model.name)] = shadowed.get((other.name, model.name), 0) + 1
                    continue
                owners[key] = model
                self.routes[key] = Route(model, model_src if model.multilingual else None,
                                         model_tgt if model.multilingual else None)
                self.codes.setdefault(key[0], src)
                self.codes.setdefault(key[1], tgt)
        for (pair, many), count in shadowed.items():
            self.notes.append(f"{pair} serves its pair(s) before {many} ({count} pair(s))")
        if not self.routes:
            raise ValueError("no model to serve: give at least one --workdir.")
        targets: dict[str, set[str]] = {code: set() for code in self.codes}
        for src, tgt in self.routes:
            targets[src].add(self.codes[tgt])
        self._languages = [{"code": self.codes[key], "name": language_name(self.codes[key]),
                            "targets": sorted(targets[key])} for key in self.codes]

    def code(self, given: str) -> str | None:
        """The served code for a request's ``given`` code (any case, short forms), or ``None``."""
        return self.codes.get(lookup_key(given))

    def route(self, source: str, target: str) -> Route | None:
        """The route translating served codes ``source`` → ``target``, or ``None``."""
        return self.routes.get((lookup_key(source), lookup_key(target)))

    def sources(self) -> list[str]:
        """The served source codes, in order of first appearance."""
        return list(dict.fromkeys(self.codes[src] for src, _ in self.routes))

    def languages(self) -> list[dict[str, Any]]:
        """``GET /languages``: every served language (sources and targets) as LibreTranslate gives
        it, ``{"code", "name", "targets"}``, targets sorted."""
        return self._languages


class Detector:
    """Language detection among served source codes with ``py3langid`` (langid.py's model,
    shipped in its wheel: no download): :meth:`detect` gives LibreTranslate's candidate list.
    A served language the model does not know is never detected; with none it knows, every
    answer is the first served source at confidence 0."""

    def __init__(self, sources: list[str]):
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        self.sources = sources
        self.identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        known = set(self.identifier.nb_classes)
        self.by_base: dict[str, str] = {}
        for code in sources:   # zh-Hans before zh-Hant: the first served code of a language answers
            base = _primary(code)
            if base in known:
                self.by_base.setdefault(base, code)
        if self.by_base:
            self.identifier.set_languages(sorted(self.by_base))

    def detect(self, text: str, count: int = 3) -> list[dict[str, Any]]:
        """Up to ``count`` ``{"confidence": 0-100, "language": code}``, likeliest first."""
        if not self.by_base or not text.strip():
            return [{"confidence": 0.0, "language": self.sources[0]}]
        ranked = self.identifier.rank(text)[:count]
        return [{"confidence": round(100.0 * float(p), 1), "language": self.by_base[base]}
                for base, p in ranked]


def parse_pair(text: str) -> tuple[str, str]:
    """``SRC-TGT`` (``en-de``, ``zh-Hans-de``) as LibreTranslate codes; ``ValueError`` unless
    exactly one cut at a dash leaves two valid language tags."""
    parts = text.split("-")
    cuts = [("-".join(parts[:i]), "-".join(parts[i:])) for i in range(1, len(parts))]
    valid = [(a, b) for a, b in cuts if langcodes.tag_is_valid(a) and langcodes.tag_is_valid(b)]
    if len(valid) != 1:
        raise ValueError(f"{text!r} is not a language pair SRC-TGT of two language codes (e.g. en-de)")
    source, target = valid[0]
    mapped = lt_codes([source, target])
    return mapped[source], mapped[target]
