"""Argos Translate packages (``jaxformer-convert --to-argos``, jaxformer.interop.argos): a tiny run
trained here, packaged; the zip's layout and metadata, its model decoded by CTranslate2 exactly as
argostranslate calls it (translate.py's ``translate_batch``) against our CT2 engine, the
languages, and the refusals. The ``slow`` test runs benchmarks/argos_libretranslate.py against
the real argostranslate and LibreTranslate in the virtual environments named by
``JAXFORMER_ARGOS_VENV`` and ``JAXFORMER_LT_VENV`` (docs/argos.md sets them up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ctranslate2 = pytest.importorskip("ctranslate2")
pytest.importorskip("spacy")
pytest.importorskip("langcodes")

from jaxformer.cli.convert import main as convert_main  # noqa: E402
from jaxformer.data import corpus  # noqa: E402
from jaxformer.decode.engine import Request  # noqa: E402
from jaxformer.decode.served_run import ServedRun  # noqa: E402
from jaxformer.interop.argos import language, run_languages  # noqa: E402
from jaxformer.model.config import preset  # noqa: E402
from jaxformer.run.config import TrainConfig  # noqa: E402
from jaxformer.serve.ct2_engine import CT2Engine  # noqa: E402
from jaxformer.train.trainer import train  # noqa: E402

PAIRS = [p for p in corpus.read_tsv(corpus.builtin_corpus_path("en-de"))[0]
         if len(p[0]) < 50 and len(p[1]) < 50]
SOURCES = [s for s, _ in PAIRS[:24]]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run of 120 steps on 300 short pairs of the shipped en-de corpus given as a file (so
    it records no languages)."""
    root = tmp_path_factory.mktemp("argos-run")
    (root / "corpus.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS[:300]))
    train(TrainConfig.flat(workdir=str(root / "run"), train_file=str(root / "corpus.tsv"), preset="tiny",
                           max_steps=120, warmup_steps=20, lr_scale=0.3, batch_tokens=512, vocab_size=300,
                           max_len=32, eval_every=1000, dev_bleu_sentences=4, beam_size=1, progress=False,
                           devices=1))
    return root / "run"


@pytest.fixture(scope="module")
def package(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("argos-package") / "en-de.argosmodel"
    convert_main(["--to-argos", str(run), "--out", str(out), "--from-code", "en", "--to-code", "de"])
    return out


def test_the_package_is_one_folder_with_metadata_model_tokenizer_splitter_and_readme(run, package, tmp_path):
    with zipfile.ZipFile(package) as z:
        names = z.namelist()
        z.extractall(tmp_path)
    [top] = {name.split("/")[0] for name in names}
    root = tmp_path / top
    assert {"metadata.json", "sentencepiece.model", "README.md", "model/model.bin", "model/config.json",
            "spacy/config.cfg", "spacy/meta.json", "spacy/tokenizer"} <= {n.split("/", 1)[1] for n in names}
    assert json.loads((root / "metadata.json").read_text()) == {
        "package_version": "1.0", "argos_version": "1.11", "type": "translate", "from_code": "en",
        "from_name": "English", "to_code": "de", "to_name": "German", "links": []}
    assert (root / "sentencepiece.model").read_bytes() == (run / "tokenizer" / "spm.model").read_bytes()
    results = json.loads((run / "results.json").read_text())
    readme = (root / "README.md").read_text()
    assert "English → German" in readme and f"Test BLEU {results['test_bleu']:.2f}" in readme
    assert "`corpus.tsv`" in readme and "ARGOS_CHUNK_TYPE=SPACY" in readme and "step 120" in readme
    import spacy

    nlp = spacy.load(root / "spacy", exclude=["parser"])   # as argostranslate's SpacySentencizerSmall
    nlp.add_pipe("sentencizer")
    assert nlp.lang == "en"
    assert [s.text for s in nlp("Click OK. Then close Dr. Smith's dialog!").sents] == [
        "Click OK.", "Then close Dr. Smith's dialog!"]
    again = tmp_path / "again.argosmodel"   # the same run gives the same bytes
    convert_main(["--to-argos", str(run), "--out", str(again), "--from-code", "en", "--to-code", "de"])
    assert again.read_bytes() == package.read_bytes()


def test_the_model_decodes_as_argostranslate_calls_it_to_our_ct2_engine_s_text(run, package, tmp_path):
    """translate.py's ``translate_batch`` options and tokenizer.py's decode, on the package's files
    alone, against ``CT2Engine`` at beam 4 and |Y|^0.2: equal wherever our limits do not bind (a
    source or output under ``max_len``) and the model wrote no ``<unk>`` (argostranslate replaces it)."""
    import sentencepiece as spm

    with zipfile.ZipFile(package) as z:
        z.extractall(tmp_path)
    [root] = tmp_path.iterdir()
    sp = spm.SentencePieceProcessor(model_file=str(root / "sentencepiece.model"))
    translator = ctranslate2.Translator(str(root / "model"), device="cpu")
    options = dict(replace_unknowns=True, max_batch_size=32, batch_type="tokens", beam_size=4,
                   num_hypotheses=1, length_penalty=0.2, return_scores=True)   # argostranslate's translate.py
    results = translator.translate_batch([sp.encode(s, out_type=str) for s in SOURCES], **options)
    theirs = [sp.decode_pieces(r.hypotheses[0]).replace("▁", " ").replace("_", " ") for r in results]
    theirs = [text[1:] if text.startswith(" ") else text for text in theirs]
    engine = CT2Engine(ServedRun.load(run, max_len_a=0, max_len_b=256), batch_size=8)
    ours = [t.text for t in engine.translate(SOURCES, Request(4, 0.2, "hf", True, 0, 1.0))]
    comparable = [i for i, text in enumerate(ours) if "⁇" not in text and len(sp.encode(text)) < 31
                  and len(sp.encode(SOURCES[i])) <= 32]   # the tiny run's max_len: we cut longer sources
    assert len(comparable) >= len(SOURCES) // 2
    assert [theirs[i] for i in comparable] == [ours[i] for i in comparable]


def test_languages_come_from_the_flags_else_the_run_else_a_refusal_naming_the_flags(run, tmp_path, capsys):
    shipped = {"train": {"pair": "en-fr", "train_file": None}, "target_language": "fr"}
    assert run_languages(shipped) == ("en", "fr")
    assert run_languages({"train": {"pair": "en-de", "train_file": "mine.tsv"}, "target_language": "xx"}) == (
        None, None)
    assert run_languages({"source_language": "fr", "target_language": "deu"}) == ("fr", "deu")
    assert [language(c) for c in ("deu", "pt-BR", "zh-Hant", "zh", "EN")] == [
        ("de", "German"), ("pb", "Portuguese (Brazil)"), ("zt", "Chinese (Traditional)"), ("zh", "Chinese"),
        ("en", "English")]
    out = tmp_path / "x.argosmodel"
    for flags, message in (([], "give --from-code CODE and --to-code CODE"),
                           (["--from-code", "en"], "no target language (a run trained on your own corpus"),
                           (["--from-code", "en", "--to-code", "xx"],
                            "language code 'xx' is not a language")):
        with pytest.raises(SystemExit) as stop:
            convert_main(["--to-argos", str(run), "--out", str(out), *flags])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".argos-*"))   # nothing left behind


def _fake_run(path: Path, tokenizer: dict, files: dict[str, bytes]) -> Path:
    """A run directory holding only what the refusals read: a config.json and tokenizer files."""
    (path / "tokenizer").mkdir(parents=True)
    for name, data in files.items():
        (path / "tokenizer" / name).write_bytes(data)
    record = {"model": preset("tiny", src_vocab_size=64).to_dict(), "tokenizer": tokenizer}
    (path / "config.json").write_text(json.dumps(record))
    return path


def test_what_argostranslate_cannot_express_is_refused_by_name(run, package, tmp_path, capsys):
    def vocab(*pieces: str) -> bytes:
        return json.dumps({p: i for i, p in enumerate(["<pad>", "</s>", "<unk>", *pieces])}).encode()

    marian = {"kind": "marian", "dir": "tokenizer"}
    two = {"source.spm": b"s", "target.spm": b"t", "vocab.json": vocab("▁a")}
    multi_target = {"source.spm": b"s", "target.spm": b"s", "vocab.json": vocab(">>deu<<", ">>fra<<")}
    cases = {"two sentencepiece models": (_fake_run(tmp_path / "opus", marian, two),
                                          "source.spm and target.spm differ"),
             "a multi-target OPUS-MT model": (
                 _fake_run(tmp_path / "mul", marian, multi_target),
                 "multilingual: each source starts with a target-language token (>>deu<<, >>fra<<)"),
             "NLLB": (_fake_run(tmp_path / "nllb", {"kind": "nllb"}, {}), "multilingual NLLB run"),
             "an existing --out": (run, "exists; remove it or choose a new file"),
             "a --out not .argosmodel": (run, "must end in .argosmodel"),
             "a --out in no folder": (run, "is in no folder; create the folder first")}
    outs = {"an existing --out": package, "a --out not .argosmodel": tmp_path / "x.zip",
            "a --out in no folder": tmp_path / "none" / "x.argosmodel"}
    for name, (workdir, message) in cases.items():
        out = outs.get(name, tmp_path / "x.argosmodel")
        with pytest.raises(SystemExit) as stop:
            convert_main(["--to-argos", str(workdir), "--out", str(out), "--from-code", "en",
                          "--to-code", "de"])
        assert stop.value.code == 2 and message in capsys.readouterr().err, name
    with pytest.raises(SystemExit) as stop:   # the language flags belong to --to-argos
        convert_main(["--to-ct2", str(run), "--out", str(tmp_path / "ct2"), "--to-code", "de"])
    assert stop.value.code == 2 and "--to-code cannot go with --to-ct2" in capsys.readouterr().err


VENVS = {name: os.environ.get(f"JAXFORMER_{name.upper()}_VENV") for name in ("argos", "lt")}


@pytest.mark.slow
@pytest.mark.skipif(not all(v and Path(v, "bin", "python").is_file() for v in VENVS.values()),
                    reason="JAXFORMER_ARGOS_VENV and JAXFORMER_LT_VENV name no argostranslate and "
                           "LibreTranslate environments (docs/argos.md)")
def test_argostranslate_and_libretranslate_translate_as_our_ct2_engine(run, tmp_path):
    """The real packages install ours and translate every line as we do, except where the
    difference is reproduced (a line split into sentences, an unknown piece replaced)."""
    report_file = tmp_path / "report.json"
    script = REPO / "benchmarks" / "argos_libretranslate.py"
    subprocess.run([sys.executable, str(script), "--workdir", str(run), "--argos-venv", VENVS["argos"],
                    "--lt-venv", VENVS["lt"], "--from-code", "en", "--to-code", "de", "--sentences", "40",
                    "--json", str(report_file)], check=True, timeout=1800, cwd=REPO)
    report = json.loads(report_file.read_text())
    assert len(report["checks"]) == 3
    for check in report["checks"]:
        assert check["unexplained"] == 0 and check["equal"] >= check["lines"] // 2, check["name"]
    lt = report["checks"][2]
    status, languages = lt["responses"]["GET /languages"]
    assert status == 200 and {(entry["code"], entry["name"]) for entry in languages} == {
        ("en", "English"), ("de", "German")}
    assert lt["responses"]["POST /translate (unknown target)"] == [400, {"error": "qq is not supported"}]
    status, body = lt["responses"]["POST /translate (form)"]
    assert status == 200 and lt["libretranslatepy"]["translation"] == body["translatedText"]
