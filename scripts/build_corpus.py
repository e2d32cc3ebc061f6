#!/usr/bin/env python3
"""Build the parallel corpora shipped in ``jaxformer/corpora/``.

Source: the LibreOffice offline help (professionally translated, MPL-2.0,
(c) The Document Foundation and contributors), as packaged by Debian:

    libreoffice-help-en-us   -> usr/share/libreoffice/help/en-US/text/**.html
    libreoffice-help-de      -> usr/share/libreoffice/help/de/text/**.html
    libreoffice-help-fr      -> usr/share/libreoffice/help/fr/text/**.html
    libreoffice-help-zh-cn   -> usr/share/libreoffice/help/zh-CN/text/**.html

Every translatable paragraph/heading carries the same ``id`` attribute
(``par_id...``, ``hd_id...``) in every language, so the key
(relative file path, id) aligns English with the other language paragraph
by paragraph. A few pages reuse an id (one embedded section per Calc
function, in an order that depends on the language); a repeated id is keyed
by (id, nearest preceding unit id that is unique in the file, repeat number)
instead, see ``extract_units``.

Getting the data
----------------
Either pass ``--help-root DIR`` where ``DIR/usr/share/libreoffice/help``
exists, e.g. prepared by hand with::

    apt-get update
    mkdir -p /tmp/lohelp && cd /tmp/lohelp
    apt-get download libreoffice-help-en-us libreoffice-help-de \\
        libreoffice-help-fr libreoffice-help-zh-cn
    for d in *.deb; do dpkg -x "$d" root; done
    python3 scripts/build_corpus.py --help-root /tmp/lohelp/root

or omit ``--help-root``: the script then runs ``apt-get download`` for the
needed packages in a temporary directory and unpacks them with ``dpkg -x``
(this does NOT install LibreOffice; ``--apt-update`` runs ``apt-get update``
first if the package lists are missing). The package versions used are
printed (``dpkg-deb -f <deb> Version``).

What counts as a unit
---------------------
A unit is a paragraph-level element (``p``, ``h1``..``h6``) with an ``id``
attribute. Page chrome (``bm_module``, ``bm_system``, ``bm_HID`` and
anything under ``<header>``, ``<aside>``, ``<footer>``) is ignored; ``span``
and ``div`` elements with ids are switch containers / layout, never units.
The text of a unit is its full text content including nested inline
elements; ``script``/``style`` are skipped, and inside a unit any element
with the ``hidden`` attribute is skipped unless its id starts with
``default`` (LibreOffice's ``switchinline`` spans hold one hidden variant
per platform/module; we keep the default variant, e.g. "Tools - Options"
rather than the macOS "LibreOffice - Preferences"). If a unit contains
another unit, the inner text belongs only to the inner unit.

Cleaning
--------
Unicode NFC, whitespace runs (tabs/newlines included) collapsed to a single
space, stripped. Dropped: English units with no counterpart key in the
target page (missing), repeated-id keys whose counts differ between the two
languages (ambiguous), pairs with an empty side, pairs with a
side containing no word character, pairs with a control character or
U+FFFD on either side (mis-encoded text), pairs whose two sides are identical
(numbers, code, menu paths and untranslated English), and exact duplicate
(source, target) pairs (first occurrence kept). Order: sorted by relative
file path, then document order.

Output: ``<out-dir>/en-de.tsv.gz`` etc., UTF-8, ``source<TAB>target`` per
line, gzip with mtime=0 and no embedded file name (byte-reproducible).

Standard library only; Python >= 3.11.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import subprocess
import sys
import tempfile
import unicodedata
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

# pair name -> (Debian package, help language directory)
PAIRS = {
    "en-de": ("libreoffice-help-de", "de"),
    "en-fr": ("libreoffice-help-fr", "fr"),
    "en-zh": ("libreoffice-help-zh-cn", "zh-CN"),
}
SRC_PACKAGE, SRC_LANG = "libreoffice-help-en-us", "en-US"
HELP_SUBDIR = Path("usr/share/libreoffice/help")

UNIT_TAGS = frozenset({"p", "h1", "h2", "h3", "h4", "h5", "h6"})
CHROME_IDS = frozenset({"bm_module", "bm_system", "bm_HID"})
CHROME_TAGS = frozenset({"header", "aside", "footer", "nav"})
SKIP_TAGS = frozenset({"script", "style", "template", "noscript"})
VOID_TAGS = frozenset({
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link",
    "meta", "param", "source", "track", "wbr",
})
# Inline tags join text without a separator; any other tag inside a unit
# acts as a word boundary.
INLINE_TAGS = frozenset({
    "a", "abbr", "b", "bdi", "bdo", "cite", "code", "data", "dfn", "em",
    "i", "kbd", "mark", "q", "s", "samp", "small", "span", "strong", "sub",
    "sup", "time", "tt", "u", "var", "font",
})
WORD_RE = re.compile(r"\w")
# C0/C1 control characters or U+FFFD: mis-encoded text (a few zh-CN
# paragraphs contain bytes decoded as Latin-1 mid-sentence).
BAD_CHAR_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd]")


def normalize(text: str) -> str:
    """NFC, collapse all whitespace (incl. tabs/newlines) to one space, strip."""
    return " ".join(unicodedata.normalize("NFC", text).split())


class UnitExtractor(HTMLParser):
    """Collects (id, text) for every unit of one help page, in document order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        # stack entries: [tag, opens_unit_index_or_None, starts_skip]
        self.stack: list[list] = []
        self.units: list[list] = []  # [id, list_of_text_chunks]
        self.open_units: list[int] = []  # indices into self.units
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in VOID_TAGS:
            if self.open_units and not self.skip and tag != "wbr":
                self.units[self.open_units[-1]][1].append(" ")
            return
        elem_id = attrs.get("id")
        starts_skip = False
        if tag in SKIP_TAGS or tag in CHROME_TAGS:
            starts_skip = True
        elif self.open_units and "hidden" in attrs and not (
            elem_id or ""
        ).startswith("default"):
            starts_skip = True
        unit_idx = None
        if (
            not starts_skip
            and not self.skip
            and tag in UNIT_TAGS
            and elem_id
            and elem_id not in CHROME_IDS
        ):
            unit_idx = len(self.units)
            self.units.append([elem_id, []])
        elif self.open_units and not self.skip and tag not in INLINE_TAGS:
            self.units[self.open_units[-1]][1].append(" ")
        self.stack.append([tag, unit_idx, starts_skip])
        if starts_skip:
            self.skip += 1
        if unit_idx is not None:
            self.open_units.append(unit_idx)

    def handle_startendtag(self, tag, attrs):
        # <x/>: no content, but keep word boundaries.
        self.handle_starttag(tag, attrs)
        if tag not in VOID_TAGS:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag in VOID_TAGS:
            return
        # Pop up to and including the matching open tag (tolerates missing
        # end tags); stray end tags with no open match are ignored.
        for pos in range(len(self.stack) - 1, -1, -1):
            if self.stack[pos][0] == tag:
                break
        else:
            return
        while len(self.stack) > pos:
            ptag, unit_idx, starts_skip = self.stack.pop()
            if starts_skip:
                self.skip -= 1
            if unit_idx is not None:
                self.open_units.remove(unit_idx)
            elif (
                self.open_units and not self.skip and ptag not in INLINE_TAGS
            ):
                self.units[self.open_units[-1]][1].append(" ")

    def handle_data(self, data):
        if self.open_units and not self.skip:
            self.units[self.open_units[-1]][1].append(data)

    def result(self) -> list[tuple[str, str]]:
        return [(uid, normalize("".join(chunks))) for uid, chunks in self.units]


def extract_units(path: Path) -> dict[tuple[str, str, int], str]:
    """Map alignment key -> normalised text, insertion-ordered by document.

    The key of a unit whose id occurs once in the file is (id, "", 0).
    Some pages are assembled from embedded sections that reuse paragraph
    ids (e.g. one table per Calc function) and whose order depends on the
    language (sections sorted by the localised function name), so an id's
    n-th occurrence is not a safe key. A repeated id is keyed by
    (id, ctx, n) instead, where ctx is the id of the nearest preceding unit
    whose id is unique in the file and n counts repeats within that context.
    """
    parser = UnitExtractor()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    parser.close()
    units = parser.result()
    counts = Counter(uid for uid, _ in units)
    ctx = ""
    seen: Counter[tuple[str, str]] = Counter()
    out: dict[tuple[str, str, int], str] = {}
    for uid, text in units:
        if counts[uid] == 1:
            ctx = uid
            key = (uid, "", 0)
        else:
            key = (uid, ctx, seen[(uid, ctx)])
            seen[(uid, ctx)] += 1
        out[key] = text
    return out


def html_files(lang_dir: Path) -> dict[str, Path]:
    text_dir = lang_dir / "text"
    return {
        p.relative_to(lang_dir).as_posix(): p for p in text_dir.rglob("*.html")
    }


def key_counts(units: dict[tuple[str, str, int], str]) -> Counter:
    """Number of occurrences of each (id, ctx) in a file."""
    return Counter(key[:2] for key in units)


def build_pair(help_dir: Path, tgt_lang: str, src_cache: dict) -> tuple[list, Counter]:
    stats: Counter[str] = Counter()
    src_files = html_files(help_dir / SRC_LANG)
    tgt_files = html_files(help_dir / tgt_lang)
    stats["files_en"] = len(src_files)
    stats["files_tgt"] = len(tgt_files)
    stats["files_common"] = len(src_files.keys() & tgt_files.keys())
    pairs: list[tuple[str, str]] = []
    seen_pairs: set[tuple[str, str]] = set()
    for rel in sorted(src_files):
        if rel not in src_cache:
            src_cache[rel] = extract_units(src_files[rel])
        src_units = src_cache[rel]
        tgt_units = extract_units(tgt_files[rel]) if rel in tgt_files else {}
        stats["seen_en"] += len(src_units)
        stats["seen_tgt"] += len(tgt_units)
        src_n, tgt_n = key_counts(src_units), key_counts(tgt_units)
        for key, src in src_units.items():
            if key not in tgt_units:
                stats["drop_missing_in_target"] += 1
                continue
            if src_n[key[:2]] != tgt_n[key[:2]]:
                stats["drop_ambiguous_id"] += 1
                continue
            stats["aligned"] += 1
            tgt = tgt_units[key]
            if not src or not tgt:
                stats["drop_empty"] += 1
            elif not WORD_RE.search(src) or not WORD_RE.search(tgt):
                stats["drop_no_word_char"] += 1
            elif BAD_CHAR_RE.search(src) or BAD_CHAR_RE.search(tgt):
                stats["drop_bad_encoding"] += 1
            elif src == tgt:
                stats["drop_identical"] += 1
            elif (src, tgt) in seen_pairs:
                stats["drop_duplicate"] += 1
            else:
                seen_pairs.add((src, tgt))
                pairs.append((src, tgt))
    stats["written"] = len(pairs)
    return pairs, stats


def write_tsv_gz(path: Path, pairs: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                           compresslevel=9) as gz:
            for src, tgt in pairs:
                # normalize() already removed tabs/newlines; be defensive.
                src = src.replace("\t", " ").replace("\n", " ")
                tgt = tgt.replace("\t", " ").replace("\n", " ")
                gz.write(f"{src}\t{tgt}\n".encode())
    os.replace(tmp, path)


def download_help(workdir: Path, packages: list[str], apt_update: bool) -> Path:
    """apt-get download + dpkg -x into workdir/root; returns workdir/root."""
    if apt_update:
        subprocess.run(["apt-get", "update"], check=True)
    debs_dir = workdir / "debs"
    debs_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *packages], cwd=debs_dir, check=True)
    root = workdir / "root"
    for deb in sorted(debs_dir.glob("*.deb")):
        pkg_version = subprocess.run(
            ["dpkg-deb", "--show", "--showformat=${Package} ${Version}",
             str(deb)],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
        print(f"unpacking {pkg_version}", flush=True)
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    return root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--help-root", type=Path,
                    help="directory containing usr/share/libreoffice/help "
                         "(default: apt-get download + dpkg -x into a temp dir)")
    ap.add_argument("--out-dir", type=Path, default=Path("jaxformer/corpora"))
    ap.add_argument("--pairs", nargs="+", choices=sorted(PAIRS),
                    default=list(PAIRS))
    ap.add_argument("--apt-update", action="store_true",
                    help="run apt-get update before apt-get download")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="lohelp-") as tmp:
        if args.help_root is None:
            pkgs = [SRC_PACKAGE] + [PAIRS[p][0] for p in args.pairs]
            root = download_help(Path(tmp), pkgs, args.apt_update)
        else:
            root = args.help_root
        help_dir = root / HELP_SUBDIR
        if not (help_dir / SRC_LANG / "text").is_dir():
            sys.exit(f"error: {help_dir / SRC_LANG / 'text'} not found")

        src_cache: dict = {}
        for name in args.pairs:
            _, lang = PAIRS[name]
            if not (help_dir / lang / "text").is_dir():
                sys.exit(f"error: {help_dir / lang / 'text'} not found")
            pairs, stats = build_pair(help_dir, lang, src_cache)
            out = args.out_dir / f"{name}.tsv.gz"
            write_tsv_gz(out, pairs)
            print(f"== {name} ({SRC_LANG} -> {lang}) -> {out} "
                  f"({out.stat().st_size} bytes)")
            for k in ("files_en", "files_tgt", "files_common", "seen_en",
                      "seen_tgt", "aligned", "drop_missing_in_target",
                      "drop_ambiguous_id", "drop_empty", "drop_no_word_char",
                      "drop_bad_encoding",
                      "drop_identical", "drop_duplicate", "written"):
                print(f"  {k:24s} {stats[k]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
