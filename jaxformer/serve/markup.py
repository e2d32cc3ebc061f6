"""HTML as people send it (``format=html``), parsed with Beautiful Soup over Python's own
``html.parser`` (:class:`HtmlPlan`).

The text of each block (a paragraph, a list item, a cell: the inline content between block
elements and line breaks) is translated as sentences (:class:`~jaxformer.decode.text.TextPlan`),
in context, with its whitespace collapsed as a browser shows it. An inline element (``<b>``,
``<a href>``, ``<span>``…) then goes around the words that translate its own text where the
block's translation holds them (its text translated alone, found there, or its source words
found there unchanged: names, numbers), else around the words at the same relative place;
nested elements stay nested. Attributes are kept as they were; ``<script>``, ``<style>``,
``<code>``, ``<pre>`` and the like, and elements marked ``translate="no"`` or ``class="notranslate"``
are left untouched (inside a block they keep their relative place); comments stay.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from bs4 import BeautifulSoup, NavigableString, PageElement, Tag
from bs4.element import PreformattedString
from bs4.formatter import HTMLFormatter

from jaxformer.decode.text import TextPlan

BLOCKS = frozenset(
    "address article aside blockquote body caption center dd details dialog dir div dl dt fieldset "
    "figcaption figure footer form frameset h1 h2 h3 h4 h5 h6 head header hgroup hr html legend li "
    "main menu nav ol optgroup option p section select summary table tbody td tfoot th thead title tr "
    "ul".split())
BREAKS = frozenset({"br", "hr"})
UNTOUCHED = frozenset("script style code pre kbd samp var textarea svg math template noscript iframe "
                      "object canvas".split())
SPACE = re.compile(r"\s+")


class _AsWritten(HTMLFormatter):
    """Attributes in their order, entities as written (only &, <, > escaped), void elements as
    HTML writes them (``<br>``, not ``<br/>``)."""

    def __init__(self):
        super().__init__(entity_substitution=HTMLFormatter.REGISTRY["minimal"].entity_substitution,
                         void_element_close_prefix=None)

    def attributes(self, tag: Tag):
        return list(tag.attrs.items())   # Beautiful Soup sorts them by default


FORMATTER = _AsWritten()


def untouched(tag: Tag) -> bool:
    """Whether ``tag``'s content is never translated (code, scripts, ``translate="no"``)."""
    return (tag.name in UNTOUCHED or str(tag.get("translate", "")).lower() == "no"
            or "notranslate" in (tag.get("class") or []))


@dataclasses.dataclass
class _Span:
    """An element of a block over its source text ``[start, end)``; ``opaque``: kept as a whole
    (untouched, void, a comment) at one place; ``target``: its place in the translation."""

    element: PageElement
    start: int
    end: int
    children: list[_Span]
    opaque: bool = False
    spaced: bool = False                # opaque between spaces: kept between spaces
    fragment: TextPlan | None = None    # its own text, translated alone
    translated: str | None = None       # that translation
    target: tuple[int, int] = (0, 0)


class _Block:
    """One block's inline nodes, its source text, spans and plans."""

    def __init__(self, nodes: list[PageElement], plan_text: Callable[[str], TextPlan]):
        self.nodes, self.text, self._opaque = nodes, "", None
        self.spans = [s for s in (self._visit(node) for node in nodes) if s is not None]
        self.plan = plan_text(self.text)
        self.fragments = [s for s in _walk(self.spans) if not s.opaque and self.text[s.start:s.end].strip()
                          and (s.start, s.end) != (0, len(self.text))]
        for span in self.fragments:
            span.fragment = plan_text(self.text[span.start:span.end].strip())

    def _visit(self, node: PageElement) -> _Span | None:
        if isinstance(node, NavigableString) and not isinstance(node, PreformattedString):
            piece = SPACE.sub(" ", str(node))
            if piece.startswith(" ") and self.text.endswith(" "):
                if self._opaque and self._opaque.start == len(self.text):
                    self._opaque.spaced = True
                piece = piece[1:]
            self.text += piece
            return None
        if not isinstance(node, Tag) or untouched(node) or node.is_empty_element:
            self._opaque = _Span(node, len(self.text), len(self.text), [], opaque=True)
            return self._opaque
        start = len(self.text)
        children = [s for s in (self._visit(child) for child in list(node.children)) if s is not None]
        return _Span(node, start, len(self.text), children)

    @property
    def sentences(self) -> list[str]:
        return self.plan.sentences + [s for span in self.fragments for s in span.fragment.sentences]

    def rebuild(self, soup: BeautifulSoup, translations: Sequence[str]) -> None:
        """Replaces the block's nodes with their translation (``translations``: :attr:`sentences`')."""
        count = len(self.plan.sentences)
        target = self.plan.join(translations[:count])
        for span in self.fragments:
            n = len(span.fragment.sentences)
            span.translated = span.fragment.join(translations[count:count + n])
            count += n
        _place(self.spans, target, 0, len(target), len(target) / max(len(self.text), 1), self.text)
        parent = self.nodes[0].parent
        index = parent.index(self.nodes[0])
        for node in self.nodes:
            node.extract()
        for k, node in enumerate(_render(soup, self.spans, target, 0, len(target))):
            parent.insert(index + k, node)


class HtmlPlan:
    """``html``'s blocks to translate (:attr:`sentences`) and the document rebuilt from their
    translations (:meth:`join`). ``plan_text(text)``: the :class:`TextPlan` of a text in the
    source language."""

    def __init__(self, html: str, plan_text: Callable[[str], TextPlan]):
        self.soup = BeautifulSoup(html, "html.parser")
        self.blocks: list[_Block] = []
        self._collect(self.soup, plan_text)

    def _collect(self, node: Tag, plan_text: Callable[[str], TextPlan]) -> None:
        run: list[PageElement] = []
        for child in list(node.children):
            kind = _kind(child)
            if kind == "inline":
                run.append(child)
                continue
            self._flush(run, plan_text)
            run = []
            if kind == "block":
                self._collect(child, plan_text)
        self._flush(run, plan_text)

    def _flush(self, run: list[PageElement], plan_text: Callable[[str], TextPlan]) -> None:
        if run:
            block = _Block(run, plan_text)
            if block.plan.sentences:
                self.blocks.append(block)

    @property
    def sentences(self) -> list[str]:
        """Every block's sentences and inline elements' texts, in order."""
        return [s for block in self.blocks for s in block.sentences]

    def join(self, translations: Sequence[str]) -> str:
        """The document with :attr:`sentences` replaced by ``translations`` (once per plan)."""
        count = 0
        for block in self.blocks:
            n = len(block.sentences)
            block.rebuild(self.soup, translations[count:count + n])
            count += n
        return self.soup.decode(formatter=FORMATTER)


def _kind(node: PageElement) -> str:
    """``inline`` (part of a block's text), ``block`` (holds blocks: walked into) or ``skip``."""
    if isinstance(node, PreformattedString):   # comments, doctypes, CDATA: left where they are
        return "skip"
    if isinstance(node, NavigableString):
        return "inline"
    if node.name in BREAKS:
        return "skip"
    if untouched(node):
        return "inline"
    if node.name in BLOCKS or node.find(lambda t: t.name in BLOCKS or t.name in BREAKS) is not None:
        return "block"
    return "inline"


def _walk(spans: list[_Span]):
    for span in spans:
        yield span
        yield from _walk(span.children)


def _find(text: str, needle: str, lo: int, hi: int, near: int) -> tuple[int, int] | None:
    """The whole-word, case-blind occurrence of ``needle`` in ``text[lo:hi]`` nearest ``near``."""
    needle = needle.strip()
    if not needle:
        return None
    found = [m.span() for m in re.finditer(rf"(?<!\w){re.escape(needle)}(?!\w)", text[lo:hi], re.IGNORECASE)]
    if not found:
        return None
    start, end = min(found, key=lambda span: abs(span[0] + lo - near))
    return start + lo, end + lo


def _word_start(text: str, i: int, lo: int) -> int:
    while i > lo and not text[i - 1].isspace():
        i -= 1
    return i


def _word_end(text: str, i: int, hi: int) -> int:
    while i < hi and not text[i].isspace():
        i += 1
    return i


def _place(spans: list[_Span], target: str, lo: int, hi: int, ratio: float, source: str) -> None:
    """Sets each span's ``target`` within ``[lo, hi)``, after its earlier siblings', its
    children within it (module docstring)."""
    cursor = lo
    for span in spans:
        near = min(max(round(span.start * ratio), cursor), hi)
        if span.opaque:
            at = near if near in (cursor, hi) or target[near - 1].isspace() else _word_end(target, near, hi)
            span.target = (at, at)
        else:
            found = _find(target, span.translated or "", cursor, hi, near) \
                or _find(target, source[span.start:span.end], cursor, hi, near)
            if found is None:   # the words at the same relative place, whole
                start = _word_start(target, near, cursor)
                stop = min(max(round(span.end * ratio), start + 1), hi)
                found = (start, _word_end(target, stop, hi) if stop > start else start)
            span.target = found
        cursor = span.target[1]
        _place(span.children, target, span.target[0], span.target[1], ratio, source)


def _render(soup: BeautifulSoup, spans: list[_Span], target: str, lo: int, hi: int) -> list[PageElement]:
    """The nodes of ``target[lo:hi]`` with ``spans`` (placed, nested) as elements."""
    out: list[PageElement] = []
    pos = lo
    for span in spans:
        start, end = span.target
        if start > pos:
            out.append(NavigableString(target[pos:start]))
        if span.opaque:
            out.append(span.element)
            if span.spaced and start < hi and not target[start].isspace():
                out.append(NavigableString(" "))
        else:
            tag = soup.new_tag(span.element.name, attrs=dict(span.element.attrs))
            for node in _render(soup, span.children, target, start, end):
                tag.append(node)
            out.append(tag)
        pos = max(pos, end)
    if hi > pos:
        out.append(NavigableString(target[pos:hi]))
    return out
