"""A run as an Argos Translate package (``jaxformer-convert --to-argos RUN --out FILE.argosmodel``),
the format argostranslate and LibreTranslate install (argostranslate's ``package.py``: a zip of
one folder, read by ``Package`` and ``install_from_path``)::

  jaxformer-en_de-1_0/
    metadata.json        codes, names, versions, type "translate" (IPackage.load_metadata_from_json)
    model/               the CTranslate2 model (jaxformer.interop.ct2.export_ct2) with its README.md
    sentencepiece.model  the one tokenizer of both sides (SentencePieceTokenizer)
    spacy/               a blank spaCy pipeline of the source language (sentence splitting offline)
    README.md            the pair, the run's data, license, test BLEU, how to install and use

argostranslate segments a text with ``sentencepiece.model`` into pieces, translates them with
``model/`` and decodes the pieces with the same model, so a run whose source and target have
different sentencepiece models (an OPUS-MT import with two ``.spm`` files that differ) cannot be
a package; nor can a multilingual M2M100/NLLB run (a package is one pair; its only hook is a
decoder ``target_prefix``, while those models also need the source language token). Both are
refused by name.

Sentence splitting: argostranslate's default splitter, MiniSBD, downloads its model on first
use and fails offline; ``ARGOS_CHUNK_TYPE=SPACY`` loads the package's ``spacy/`` folder instead,
with spaCy's rule-based ``sentencizer`` on top (argostranslate's ``sbd.SpacySentencizerSmall``).
The folder is written by spaCy itself (``spacy.blank(code).to_disk``): its tokenizer file is
spaCy's serialization of the language's rules, which we neither copy nor imitate. spaCy and
langcodes (the languages' names) are the ``argos`` extra.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

from jaxformer.decode.served_run import ServedRun
from jaxformer.interop import ConversionError
from jaxformer.interop.argos_readme import package_readme
from jaxformer.interop.ct2 import check_quantization, write_ct2
from jaxformer.run.checkpoint_files import Checkpoint
from jaxformer.run.directory import RunDir

ARGOS_VERSION = "1.11"   # the argostranslate release whose package format this follows (tests/test_argos.py)
PACKAGE_VERSION = "1.0"
# LibreTranslate's own codes for two variants (its language.py ``aliases``), and back
LIBRETRANSLATE_CODES = {"zh-Hant": "zt", "pt-BR": "pb", "zh-Hans": "zh"}
_TAGS_OF = {"zt": "zh-Hant", "pb": "pt-BR"}
INSTALL = "pip install -e '.[argos]'"   # spaCy and langcodes


class Language(NamedTuple):
    """A language as a package names it: ``code`` (ISO 639-1 where one exists, else 639-3;
    LibreTranslate's ``zt``/``pb`` for Traditional Chinese and Brazilian Portuguese) and English
    ``name``."""

    code: str
    name: str


def export_argos(run: ServedRun | str | Path, out_file: str | Path, *, quantization: str = "float32",
                 checkpoint: str | int = "auto", from_code: str | None = None,
                 to_code: str | None = None) -> Path:
    """Writes ``run`` (a :class:`~jaxformer.decode.served_run.ServedRun`, or its folder and
    ``checkpoint``, as :func:`jaxformer.interop.ct2.export_ct2` takes them) as Argos Translate
    package ``out_file`` (a new ``.argosmodel`` file), CTranslate2 weights as ``quantization``;
    returns ``out_file``. The languages are ``from_code``/``to_code``, else those the run records
    (:func:`run_languages`). A folder is loaded only after what a package cannot hold is refused.

    Raises ``ConversionError``: ``out_file`` exists, is not ``.argosmodel`` or has no folder; the
    run has no languages and none are given, or a code is not a language; a run argostranslate
    cannot express (:func:`one_sentencepiece_model`); spaCy or langcodes missing; what
    :func:`jaxformer.interop.ct2.export_ct2` raises. ``FileNotFoundError`` / ``ValueError``: not a
    run, no such checkpoint (the run directory's errors)."""
    out_file = Path(out_file)
    _check_out(out_file)
    check_quantization(quantization)
    workdir = run.root if isinstance(run, ServedRun) else Path(run)
    record = run.record if isinstance(run, ServedRun) else RunDir(workdir).read_run_record()
    spm_file = one_sentencepiece_model(workdir, record)
    source, target = package_languages(record, from_code, to_code)
    run = run if isinstance(run, ServedRun) else ServedRun.load(workdir, checkpoint=checkpoint)
    with tempfile.TemporaryDirectory(prefix=".argos-", dir=out_file.parent) as tmp:
        root = Path(tmp) / f"jaxformer-{source.code}_{target.code}-{PACKAGE_VERSION.replace('.', '_')}"
        root.mkdir()
        spacy_lang = write_sentence_splitter(root / "spacy", source.code)
        chosen = _write_model(run, root / "model", quantization)
        shutil.copyfile(spm_file, root / "sentencepiece.model")
        metadata = {"package_version": PACKAGE_VERSION, "argos_version": ARGOS_VERSION, "type": "translate",
                    "from_code": source.code, "from_name": source.name,
                    "to_code": target.code, "to_name": target.name, "links": []}
        (root / "metadata.json").write_text(json.dumps(metadata, indent=2, ensure_ascii=False) + "\n")
        readme = package_readme(run, source, target, quantization, chosen, spacy_lang)
        (root / "README.md").write_text(readme, encoding="utf-8")
        _zip(root, Path(tmp) / "package.zip").replace(out_file)
    return out_file


def _check_out(out_file: Path) -> None:
    """Raises ``ConversionError`` naming the fix: ``out_file`` is not a new ``.argosmodel`` file in
    an existing folder."""
    if out_file.suffix != ".argosmodel":
        problem = "must end in .argosmodel (the name argostranslate and LibreTranslate install)"
    elif out_file.exists():
        problem = "exists; remove it or choose a new file"
    elif not out_file.parent.is_dir():
        problem = "is in no folder; create the folder first"
    else:
        return
    raise ConversionError(f"--out {str(out_file)!r} {problem}.")


def _write_model(run: ServedRun, model_dir: Path, quantization: str) -> Checkpoint:
    """Writes the package's ``model/`` (the one use of the CTranslate2 exporter); returns the
    checkpoint it holds (the first readable of the run's)."""
    params, chosen = run.restore_params()
    write_ct2(run, params, model_dir, quantization)
    return chosen


def one_sentencepiece_model(workdir: Path, record: dict[str, Any]) -> Path:
    """The run's one sentencepiece model for both sides. Raises ``ConversionError`` naming what
    argostranslate cannot express: an M2M100/NLLB run, an OPUS-MT run whose ``source.spm`` and
    ``target.spm`` differ, or one whose sources start with a ``>>xx<<`` target-language token."""
    info = record.get("tokenizer", {})
    kind = info.get("kind", "sentencepiece")
    if kind in ("m2m100", "nllb"):
        raise ConversionError(
            f"this is a multilingual {kind.upper()} run; an Argos Translate package is one language "
            f"pair with one tokenizer and a decoder target_prefix only, with no place for the source "
            f"language token these models need. Serve it with jaxformer-translate --src-lang/--tgt-lang, "
            f"or export it with --to-ct2 or --to-hf.")
    if kind != "marian":
        return workdir / info.get("file", "tokenizer/spm.model")
    folder = workdir / info.get("dir", "tokenizer")
    if (folder / "source.spm").read_bytes() != (folder / "target.spm").read_bytes():
        raise ConversionError(
            "this OPUS-MT/Marian run has separate source and target sentencepiece models (source.spm "
            "and target.spm differ); an Argos Translate package has one sentencepiece.model for both "
            "sides. Export it with --to-ct2 or --to-hf, or fine-tune a run with one joint vocabulary.")
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    codes = sorted(piece for piece in vocab if piece.startswith(">>") and piece.endswith("<<"))
    if codes:
        raise ConversionError(
            f"this OPUS-MT/Marian run is multilingual: each source starts with a target-language token "
            f"({', '.join(codes[:3])}{', …' if len(codes) > 3 else ''}), which argostranslate never "
            f"writes. Serve it with jaxformer-translate, or export it with --to-ct2 or --to-hf.")
    return folder / "source.spm"


def run_languages(record: dict[str, Any]) -> tuple[str | None, str | None]:
    """The (source, target) language codes run ``record`` gives, ``None`` where it gives none:
    ``source_language`` / ``target_language`` (``"xx"``: a user's corpus, unknown), else the
    shipped corpus it trained on (``train.pair`` without ``--train-file``/``--src-file``)."""
    train = record.get("train") or {}
    shipped = train.get("pair") and not (train.get("train_file") or train.get("src_file"))
    pair = train["pair"].split("-", 1) if shipped else (None, None)
    recorded = [record.get(f"{side}_language") for side in ("source", "target")]
    return tuple(code if code not in (None, "", "xx") else shipped_code
                 for code, shipped_code in zip(recorded, pair))


def package_languages(record: dict[str, Any], from_code: str | None,
                      to_code: str | None) -> tuple[Language, Language]:
    """The package's source and target: the codes given, else the run's. Raises
    ``ConversionError`` naming ``--from-code``/``--to-code`` where neither gives one, or where a
    code is not a language."""
    recorded = run_languages(record)
    missing = [(side, flag) for side, flag, given, known in
               zip(("source", "target"), ("--from-code", "--to-code"), (from_code, to_code), recorded)
               if not (given or known)]
    if missing:
        sides = " or ".join(side for side, _ in missing)
        flags = " and ".join(f"{flag} CODE" for _, flag in missing)
        raise ConversionError(f"this run records no {sides} language (a run trained on your own corpus "
                              f"records target_language \"xx\"); give {flags} (ISO 639-1, e.g. en, de).")
    return tuple(language(given or known) for given, known in zip((from_code, to_code), recorded))


def language(code: str) -> Language:
    """``code`` as a package's :class:`Language`: normalized by langcodes (``deu`` → ``de``,
    ``de-de`` → ``de-DE``), then LibreTranslate's ``zt``/``pb``/``zh`` spelling where it has one.
    Raises ``ConversionError``: not a language code; langcodes not installed."""
    try:
        import langcodes
    except ImportError as e:
        raise ConversionError(f"--to-argos needs langcodes for the languages' names ({e}): {INSTALL}") from e
    tag = _TAGS_OF.get(code, code)
    try:
        tag = langcodes.standardize_tag(tag)
        parsed = langcodes.Language.get(tag)
    except (langcodes.LanguageTagError, ValueError):
        parsed = None
    if parsed is None or not parsed.is_valid() or parsed.language in (None, "und", "mul", "zxx"):
        raise ConversionError(f"language code {code!r} is not a language; give an ISO 639-1 code such as "
                              f"en or de (--from-code/--to-code).")
    return Language(LIBRETRANSLATE_CODES.get(tag, tag), parsed.display_name())


def write_sentence_splitter(folder: Path, code: str) -> str:
    """Writes a blank spaCy pipeline (no trained component: argostranslate adds the rule-based
    ``sentencizer``) to ``folder``: the source language's tokenizer rules where spaCy has them and
    needs no further package, else spaCy's multilingual ``xx``. Returns the spaCy language used.
    Raises ``ConversionError``: spaCy not installed."""
    try:
        import spacy
    except ImportError as e:
        raise ConversionError(f"--to-argos writes a spaCy sentence splitter, so that the package works "
                              f"offline ({e}): {INSTALL}") from e
    try:
        nlp = spacy.blank(code.split("-")[0])
    except ImportError:   # no such language in spaCy, or one whose tokenizer needs another package
        nlp = spacy.blank("xx")
    nlp.meta.update(name="sentences", version=PACKAGE_VERSION,
                    description="A blank spaCy pipeline: argostranslate's ARGOS_CHUNK_TYPE=SPACY splits "
                                "sentences with it and spaCy's rule-based sentencizer.")
    nlp.to_disk(folder)
    return nlp.lang


def _zip(root: Path, out: Path) -> Path:
    """``root`` and what it holds as zip ``out``, entries sorted and dated 1980-01-01, so that the
    same files give the same bytes."""
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as package:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            entry = zipfile.ZipInfo(path.relative_to(root.parent).as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
            entry.external_attr, entry.compress_type = 0o644 << 16, zipfile.ZIP_DEFLATED
            package.writestr(entry, path.read_bytes())
    return out
