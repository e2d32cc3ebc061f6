"""The service's parts without a model (jaxformer.serve): sentences and HTML cut and joined
back, LibreTranslate's codes, the batcher over an engine written here, keys and limits. The
service over real runs and a real server: tests/test_serve.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("fastapi", reason="the service's dependencies: pip install -e '.[serve]'")

from jaxformer.decode.engine import Request, Translation  # noqa: E402
from jaxformer.decode.text import TextPlan, fit  # noqa: E402
from jaxformer.serve.batcher import Batcher, QueueFull  # noqa: E402
from jaxformer.serve.languages import Catalog, Detector, lt_codes, parse_pair  # noqa: E402
from jaxformer.serve.limits import ApiKeys, RateLimit  # noqa: E402
from jaxformer.serve.markup import HtmlPlan  # noqa: E402


def words(sentences):   # a tokenizer of one token per word, plus eos
    return [len(s.split()) + 1 for s in sentences]


def plan(text, max_len=32):
    return TextPlan(text, "en", words, max_len)


@pytest.mark.parametrize("text", [
    "Hello world. How are you?  Fine!\n\nA new paragraph.\r\nA line\nwith breaks.\n",
    "  leading and trailing spaces.  ",
    "Dr. Smith went to Washington D.C. yesterday. He liked it.",
    "",
    "\n\n",
])
def test_text_is_cut_into_sentences_and_joined_back_as_it_was(text):
    cut = plan(text)
    assert cut.join(cut.sentences) == text
    assert all(s == s.strip() and s for s in cut.sentences)
    assert not any("\n" in s for s in cut.sentences)
    assert cut.join([s.upper() for s in cut.sentences]) == "".join(
        part.upper() if i in cut.todo else part for i, part in enumerate(cut.parts))


def test_sentences_follow_the_splitter_and_keep_line_breaks():
    cut = plan("Hello Dr. Smith. How are you?\n\nFine.")
    assert cut.sentences == ["Hello Dr. Smith.", "How are you?", "Fine."]
    assert cut.join(["A.", "B?", "C."]) == "A. B?\n\nC."


def test_a_sentence_over_max_len_is_translated_in_pieces_that_fit():
    long = " ".join(f"w{i}" for i in range(100)) + "."
    cut = plan(f"Short one. {long}", max_len=16)
    assert cut.cut == 1 and len(cut.sentences) > 7
    assert all(n <= 16 for n in words(cut.sentences)) and cut.join(cut.sentences) == f"Short one. {long}"
    nospace = "x" * 100   # no space to cut at: cut at the middle character
    pieces = fit(nospace, lambda ss: [len(s) // 10 + 1 for s in ss], 4)
    assert "".join(pieces) == nospace and all(len(p) // 10 + 1 <= 4 for p in pieces)


HTML = ('<!DOCTYPE html><html><head><title>A title</title><style>p {color: red}</style></head><body>'
        '<p id="a" class="x y">Click <b>OK</b> to go on. '
        'Then <a href="/h?a=1&amp;b=2" data-x="1">go home</a>!</p>'
        '<ul><li>One <code>ls -l</code> two</li><li>Keep <span translate="no">this name</span> here</li></ul>'
        '<div>Line one<br>Line two <i>with <b>nested</b> tags</i></div><!-- a comment -->'
        '<script>var s = "<b>not text</b>";</script><pre>  code  stays </pre>'
        '<img src="a.png" alt=""></body></html>')


def test_html_blocks_are_translated_in_context_with_tags_around_their_words():
    cut = HtmlPlan(HTML, plan)
    assert cut.sentences[:3] == ["A title", "Click OK to go on.", "Then go home!"]
    assert "not text" not in " ".join(cut.sentences) and "ls -l" not in " ".join(cut.sentences)
    assert "this name" not in " ".join(cut.sentences) and "code  stays" not in " ".join(cut.sentences)
    out = HtmlPlan(HTML, plan).join([s.upper() for s in cut.sentences])
    for kept in ('<p id="a" class="x y">', '<a href="/h?a=1&amp;b=2" data-x="1">GO HOME</a>', "<b>OK</b>",
                 "<code>ls -l</code>", '<span translate="no">this name</span>', "<!-- a comment -->",
                 '<script>var s = "<b>not text</b>";</script>', "<pre>  code  stays </pre>",
                 '<img src="a.png" alt="">', "LINE ONE<br>LINE TWO <i>WITH <b>NESTED</b> TAGS</i>",
                 "<title>A TITLE</title>", "<style>p {color: red}</style>"):
        assert kept in out, kept
    assert "ONE <code>ls -l</code> TWO" in out and "KEEP <span" in out and "</span> HERE" in out


def test_an_inline_tag_goes_around_its_words_translation_or_the_words_at_its_place():
    source = "<p>Press the <b>red button</b> now.</p>"
    translations = {"Press the red button now.": "Drücken Sie jetzt den roten Knopf.",
                    "red button": "roten Knopf"}
    cut = HtmlPlan(source, plan)
    out = cut.join([translations[s] for s in cut.sentences])
    assert out == "<p>Drücken Sie jetzt den <b>roten Knopf</b>.</p>"
    cut = HtmlPlan(source, plan)   # not found: the words at the same relative place
    out = cut.join(["Drücken Sie jetzt den roten Knopf.", "Knöpfe"])
    assert out.count("<b>") == 1 and out.replace("<b>", "").replace("</b>", "") == \
        "<p>Drücken Sie jetzt den roten Knopf.</p>"


def test_language_codes_are_libretranslates():
    nllb = ["eng_Latn", "deu_Latn", "arb_Arab", "ars_Arab", "zho_Hans", "zho_Hant", "srp_Cyrl", "ace_Arab",
            "ace_Latn", "ast_Latn", "aka_Latn", "twi_Latn"]   # some of NLLB-200's codes
    codes = lt_codes(nllb)
    assert list(codes.values()) == ["en", "de", "ar", "ars", "zh-Hans", "zh-Hant", "sr", "ace-Arab",
                                    "ace-Latn", "ast", "ak", "twi_Latn"]   # twi_Latn: ak is aka_Latn's
    assert lt_codes(["en", "de", "pt-BR"]) == {"en": "en", "de": "de", "pt-BR": "pt-BR"}
    assert parse_pair("en-de") == ("en", "de") and parse_pair("zh-Hans-de") == ("zh", "de")
    with pytest.raises(ValueError, match="SRC-TGT"):
        parse_pair("english")


class _Model:
    def __init__(self, name, pairs, multilingual=False):
        self.name, self._pairs, self.multilingual = name, pairs, multilingual

    def pairs(self):
        return [(s, t, s, t) for s, t in self._pairs]


def test_one_model_per_pair_and_a_pair_model_before_a_multilingual_one():
    many = _Model("nllb", [(s, t) for s in ("en", "de", "fr") for t in ("en", "de", "fr") if s != t], True)
    catalog = Catalog([many, _Model("en-de", [("en", "de")])])
    assert catalog.route("EN", "de").model.name == "en-de" and catalog.route("de", "en").model is many
    assert catalog.route("en", "de").src_lang is None and catalog.route("de", "fr").src_lang == "de"
    assert "en-de serves its pair(s) before nllb (1 pair(s))" in catalog.notes
    assert {"code": "en", "name": "English", "targets": ["de", "fr"]} in catalog.languages()
    with pytest.raises(ValueError, match="a and b both translate en → de"):
        Catalog([_Model("a", [("en", "de")]), _Model("b", [("en", "de")])])
    assert Detector(["en", "de"]).detect("Das ist ein kleines Haus am See.")[0]["language"] == "de"
    assert Detector(["xx"]).detect("anything") == [{"confidence": 0.0, "language": "xx"}]


class _Engine:
    """An engine (jaxformer.decode.engine.Engine's translate) that upper-cases, records its calls,
    waits for ``gate`` and fails on a sentence "boom"."""

    def __init__(self):
        self.calls, self.gate = [], threading.Event()
        self.gate.set()

    def translate(self, sentences, request):
        self.gate.wait(10)
        self.calls.append(list(sentences))
        if "boom" in sentences:
            raise RuntimeError("the engine broke")
        return [Translation(((s.upper(), 0.0),)) for s in sentences]


def _batcher(engine, **options):
    settings = dict(wait_s=0.05, max_sentences=4, max_queue=100, workers=1) | options
    return Batcher(engine.translate, **settings)


def test_concurrent_requests_are_gathered_into_calls_of_at_most_max_sentences():
    async def main():
        engine = _Engine()
        batcher = _batcher(engine)
        batcher.start()
        requests = [["a"], ["b", "c"], ["d", "e", "f"], ["g"]]
        results = await asyncio.gather(*(batcher.translate(r, Request()) for r in requests))
        beam = await batcher.translate(["h"], Request(beam_size=2))   # other options: a call of its own
        await batcher.close()
        return engine.calls, results, beam

    calls, results, beam = asyncio.run(main())
    assert [[t.text for t in r] for r in results] == [["A"], ["B", "C"], ["D", "E", "F"], ["G"]]
    assert calls[:2] == [["a", "b", "c", "d"], ["e", "f", "g"]] and calls[2] == ["h"] and beam[0].text == "H"


def test_an_engine_error_fails_only_the_request_that_causes_it():
    async def main():
        engine = _Engine()
        batcher = _batcher(engine, max_sentences=8)
        batcher.start()
        results = await asyncio.gather(*(batcher.translate([s], Request()) for s in ("a", "boom", "c")),
                                       return_exceptions=True)
        after = await batcher.translate(["d"], Request())
        await batcher.close()
        return results, after

    (first, broken, third), after = asyncio.run(main())
    assert first[0].text == "A" and third[0].text == "C" and after[0].text == "D"
    assert isinstance(broken, RuntimeError)


def test_a_full_queue_refuses_and_a_cancelled_request_leaves_the_queue():
    async def main():
        engine = _Engine()
        engine.gate.clear()   # the engine busy: sentences wait
        batcher = _batcher(engine, max_sentences=2, max_queue=4, wait_s=0.0)
        batcher.start()
        first = asyncio.ensure_future(batcher.translate(["a", "b"], Request()))   # taken by the engine
        await asyncio.sleep(0.1)
        waiting = asyncio.ensure_future(batcher.translate(["c", "d", "e"], Request()))
        await asyncio.sleep(0.1)
        with pytest.raises(QueueFull):
            await batcher.translate(["f", "g"], Request())
        queued = batcher.waiting
        waiting.cancel()   # its client went away
        await asyncio.gather(waiting, return_exceptions=True)
        left = batcher.waiting
        engine.gate.set()
        done = await first
        await batcher.close()
        return queued, left, done, engine.calls

    queued, left, done, calls = asyncio.run(main())
    assert (queued, left) == (3, 0) and [t.text for t in done] == ["A", "B"] and calls == [["a", "b"]]


def test_keys_and_the_rate_limit(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# comment\nsecret-one\n\nsecret-two\n")
    keys = ApiKeys(path)
    assert keys.valid("secret-two") and keys.valid("secret-one")
    assert not keys.valid("secret") and not keys.valid(None) and not keys.valid("")
    (tmp_path / "empty.txt").write_text("# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys(tmp_path / "empty.txt")
    limit = RateLimit(3)
    assert [limit.hit("a") for _ in range(4)] == [True, True, True, False] and limit.hit("b")
    assert not limit.hit("b", cost=3) and str(limit) == "3 per 1 minute"
