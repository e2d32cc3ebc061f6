"""The ``README.md`` of an Argos Translate package (:mod:`jaxformer.interop.argos`): the pair, the
model and checkpoint, the run's data and its license, the test scores of ``results.json``, how
argostranslate and LibreTranslate decode with it, and how to use it offline. argostranslate
shows it as the package's description (``Package.get_readme``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SHIPPED_DATA = ("LibreOffice Help (the corpus shipped with jaxformer, jaxformer/corpora/README.md), "
                "© The Document Foundation and contributors, licensed MPL-2.0")


def package_readme(run, source, target, quantization: str, checkpoint, spacy_lang: str) -> str:
    """The README's Markdown for ``run`` (a :class:`~jaxformer.decode.served_run.ServedRun`)
    packaged as ``source`` → ``target`` (:class:`~jaxformer.interop.argos.Language`) with weights
    ``quantization`` from ``checkpoint`` (a :class:`~jaxformer.run.checkpoint_files.Checkpoint`),
    sentences split by spaCy's ``spacy_lang`` rules."""
    config, record, workdir = run.config, run.record, run.root
    kind, step = checkpoint.kind, checkpoint.step
    lines = [f"# {source.name} → {target.name} ({source.code} → {target.code}), trained with jaxformer", "",
             "An Argos Translate package: argostranslate and LibreTranslate install it as it is.", "",
             "## Model", "",
             f"- An encoder-decoder Transformer: {config.num_encoder_layers}+{config.num_decoder_layers} "
             f"layers, d_model {config.d_model}, {config.num_heads} heads, d_ff {config.d_ff}, "
             f"{config.norm_position}-norm, vocabulary {config.src_vocab_size} (one sentencepiece model for "
             f"both sides), max_len {config.max_len} tokens.",
             f"- Checkpoint: {kind}, step {step}; CTranslate2 weights in `model/` as "
             f"{quantization}.",
             *_results(workdir), "",
             "## Data and license", "", *_data(record), "",
             "## Use", "",
             "```bash",
             "pip install argostranslate          # or LibreTranslate, with spaCy in its environment",
             "export ARGOS_CHUNK_TYPE=SPACY       # split sentences with this package's spacy/ folder",
             "python -c \"import argostranslate.package as p; p.install_from_path('THIS.argosmodel')\"",
             f"python -c \"import argostranslate.translate as t; print(t.translate('…', "
             f"'{source.code}', '{target.code}'))\"",
             "```", "",
             "argostranslate's default sentence splitter, MiniSBD, downloads its model on first use, and "
             "fails offline. With `ARGOS_CHUNK_TYPE=SPACY` it loads `spacy/`, a blank spaCy pipeline "
             f"(spaCy's `{spacy_lang}` tokenizer rules, no trained component), and splits with spaCy's "
             "rule-based sentencizer.", "",
             "argostranslate translates a line's sentences in one `translate_batch` call: beam size "
             "max(N, 4) for N hypotheses, length penalty 0.2 (log-probability / length^0.2), at most 1024 "
             "source and 256 output tokens, `<unk>` replaced by the source piece it attends to most. "
             "argostranslate from PyPI loads the model with `compute_type=\"auto\"` (int8 on most CPUs; "
             "`ARGOS_COMPUTE_TYPE=float32` keeps these weights' type); LibreTranslate's fork keeps the "
             f"model's type. A sentence of up to {config.max_len} tokens (`jaxformer-translate` cuts a "
             "longer source there) translates as `jaxformer-translate --engine ct2 --quantization Q "
             "--beam-size 4 --alpha 0.2 --length-normalization hf --early-stopping --repetition-penalty 1 "
             "--no-repeat-ngram-size 0` does (Q: the weights' type, int8 for argostranslate's auto); "
             "jaxformer's docs/argos.md has the measurements.", ""]
    return "\n".join(lines)


def _results(workdir: Path) -> list[str]:
    """The test scores line of ``results.json``, if the run has one."""
    path = workdir / "results.json"
    if not path.is_file():
        return ["- No test scores: the run has no results.json."]
    results = json.loads(path.read_text())
    if "test_bleu" not in results:
        return ["- No test scores: the run's results.json has none."]
    scores = f"- Test BLEU {results['test_bleu']:.2f}"
    if "test_chrf" in results:
        scores += f", chrF {results['test_chrf']:.2f}"
    scores += (f" on {results.get('test_sentences', '?')} sentences of its test split "
               f"({results.get('decoding', 'its decoding')}, {results.get('checkpoint', '?')} checkpoint; "
               f"sacrebleu {results.get('sacrebleu_signature', '?')}).")
    return [scores]


def _data(record: dict[str, Any]) -> list[str]:
    """Where the weights come from, and the license that follows."""
    train, imported = record.get("train") or {}, record.get("imported_from")
    if imported:
        return [f"- Imported from {imported.get('format', 'another toolkit')} model "
                f"`{imported.get('name', '?')}`: its license applies (see its model card)."]
    lines = []
    if train.get("init_from"):
        lines.append("- Fine-tuned from another model (`train.py --init-from`): that model's license "
                     "also applies.")
    corpus = (record.get("data") or {}).get("corpus") or []
    if train.get("train_file") or train.get("src_file"):
        files = ", ".join(f"`{Path(c['path']).name}` (sha256 {c['sha256'][:12]}…)" for c in corpus)
        lines.append(f"- Trained on the user's corpus {files or '(not recorded)'}: its license applies.")
    else:
        lines.append(f"- Trained on the shipped {train.get('pair', '?')} corpus: {SHIPPED_DATA}.")
    lines.append("- jaxformer, which trained it, is Apache-2.0.")
    return lines
