"""The engine interface (issue 51): a new engine is one class. ``GreedyExample`` below is a
whole engine over a loaded run, the functional API's ``decode()`` behind the
:class:`~jaxformer.decode.engine.Engine` protocol, and the translate command (sentences, bulk
mode with its manifest and resume) runs it as it runs the JAX and CTranslate2 engines."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from jaxformer.cli import bulk as bulk_cli
from jaxformer.cli import translate as translate_lib
from jaxformer.cli.translate_flags import parse_translate_args
from jaxformer.data import corpus
from jaxformer.decode.decoding import decode
from jaxformer.decode.engine import Engine, Request, Translation, refusal, translate_nonblank
from jaxformer.decode.served_run import ServedRun
from jaxformer.decode.strategies import Greedy
from jaxformer.decode.translator import Translator
from jaxformer.model.transformer import Transformer
from jaxformer.run.config import TrainConfig
from jaxformer.train.trainer import train

PAIRS = [p for p in corpus.read_tsv(corpus.builtin_corpus_path("en-de"))[0] if len(p[0]) < 50][:200]
LIMIT = 10   # the example's one output limit


class GreedyExample:
    """Greedy decoding of a run, a sentence at a time, at one fixed output limit."""

    name = "greedy-example"
    honours = frozenset()   # greedy and beam search only (of which it does greedy)

    def __init__(self, run: ServedRun):
        self.run, self.model = run, Transformer(run.config)
        self.params, self.checkpoint = run.restore_params()

    def translate(self, sentences, request, *, first_index=0):
        problem = refusal(self, request)
        if problem:
            raise ValueError(problem)
        return translate_nonblank(sentences, request, first_index, self._translate)

    def _translate(self, sentences, request, indices):
        tok, out = self.run.tokenizer, []
        for ids in tok.encode_source(sentences):
            src = jnp.asarray([ids[: self.run.config.max_len]], jnp.int32)
            seqs, _ = decode(self.model, self.params, src, Greedy(), bos_id=tok.bos_id, eos_id=tok.eos_id,
                             max_decode_len=LIMIT)
            out.append(Translation(((tok.decode(seqs[:, 0])[0], 0.0),)))
        return out

    def rules(self, request):
        return f"greedy, at most {LIMIT} tokens"

    def describe(self):
        return "decode() a sentence at a time"

    def digest(self):
        return {"engine": self.name, "params_sha256": self.checkpoint.fingerprint()}

    def close(self):
        self.params = None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    (root / "corpus.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS))
    train(TrainConfig.flat(workdir=str(root / "run"), train_file=str(root / "corpus.tsv"), preset="tiny",
                           max_steps=2, warmup_steps=1, batch_tokens=256, vocab_size=200, max_len=32,
                           num_layers=1, eval_every=1000, dev_bleu_sentences=4, beam_size=1, progress=False,
                           devices=1))
    return root / "run"


def test_the_engines_and_a_new_one_are_engines(run):
    served = ServedRun.load(run)
    example = GreedyExample(served)
    for engine in (example, Translator(served, batch_size=4)):
        assert isinstance(engine, Engine)
        assert engine.checkpoint == served.checkpoint and engine.run is served
    assert "cannot honour sampling" in refusal(example, Request(sample=True))
    with pytest.raises(ValueError, match="cannot honour n_best"):
        example.translate(["x"], Request(n_best=2, beam_size=2))
    assert refusal(Translator(served), Request(sample=True, n_best=1)) is None


def test_the_command_runs_any_engine_sentences_and_bulk(run, tmp_path, capsys, killed_at_chunk):
    sources = [s for s, _ in PAIRS[:9]]
    example = GreedyExample(ServedRun.load(run))
    expected = [t.text for t in example.translate(sources, Request())]
    args = parse_translate_args(["--workdir", str(run), *sources[:3]])
    translate_lib.translate_with(args, example, "engine greedy-example (a test)")
    out = capsys.readouterr()
    assert out.out.splitlines() == expected[:3]
    assert "[engine greedy-example (a test); decode() a sentence at a time; greedy, at most 10" in out.err
    source, output = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(sources[:4] + [""] + sources[4:]) + "\n")
    args = parse_translate_args(["--workdir", str(run), "--input", str(source), "--output", str(output),
                                 "--chunk-lines", "3"])
    with killed_at_chunk(2):
        bulk_cli.translate(args, example, translate_lib._translate_lines)
    manifest = json.loads((tmp_path / "out.txt.parts" / "manifest.json").read_text())
    assert manifest["engine"] == "greedy-example" and manifest["checkpoint"] == "best step 2"
    bulk_cli.translate(args, example, translate_lib._translate_lines)   # resumed
    assert output.read_text().splitlines() == expected[:4] + [""] + expected[4:]
    assert "4 chunk(s), 1 found finished" in capsys.readouterr().err
