"""End to end: train.py on a slice of the shipped corpus, then resume (issue: the main job)."""

import json
import shutil

import pytest

from jaxformer.data import corpus
from jaxformer.decode.translator import Translator
from jaxformer.run.config import TrainConfig
from jaxformer.train.trainer import train


@pytest.fixture(scope="module")
def corpus_slice(tmp_path_factory):
    """Short pairs of the shipped corpus: 2,000 to train on, 40 dev and 40 test pairs in
    files of their own. Split by hash (the default, ``jaxformer.data.corpus.Splitter``), a
    slice this size gives dev and test 25% each: ~620 test sentences decoded at beam 4
    in every ``train()`` here, each batch shape compiled, for no other check."""
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    root = tmp_path_factory.mktemp("corpus")
    short = [p for p in pairs if len(p[0]) < 60 and len(p[1]) < 60][:2080]
    for name, chunk in (("train", short[:2000]), ("dev", short[2000:2040]), ("test", short[2040:])):
        (root / f"{name}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in chunk))
    return root


def _config(workdir, corpus, max_steps):
    return TrainConfig.flat(workdir=str(workdir), train_file=str(corpus / "train.tsv"),
                       dev_file=str(corpus / "dev.tsv"), test_file=str(corpus / "test.tsv"),
                       preset="tiny", vocab_size=400,
                       max_len=32, batch_tokens=512, max_steps=max_steps, warmup_steps=30,
                       lr_scale=2.0, eval_every=30, dev_bleu_sentences=40, eval_batch_size=32,
                       log_every=10, checkpoint_every=30, progress=False, devices=1)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus_slice):
    """A 30-step run (checkpoint and dev evaluation at step 30), trained once for the module;
    tests work on copies of it."""
    workdir = tmp_path_factory.mktemp("trained") / "run"
    assert train(_config(workdir, corpus_slice, 30))["final_step"] == 30
    return workdir


def test_train_checkpoints_and_resumes(tmp_path, trained_run, corpus_slice, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(trained_run, workdir)
    capsys.readouterr()
    record = json.loads((workdir / "config.json").read_text())   # the user's corpus: languages not known
    assert record["target_language"] == "xx" and "source_language" not in record
    # The second half runs its layers under nn.scan (issue #19): the unrolled checkpoint of
    # step 30 converts on restore; evaluation decodes through the unrolled view. The
    # languages given now are recorded.
    second = train(_config(workdir, corpus_slice, 60).replace(scan_layers=True, src_lang="en", tgt_lang="de"))
    out = capsys.readouterr().out
    assert "resumed" in out and "at step 30" in out
    assert second["final_step"] == 60
    record = json.loads((workdir / "config.json").read_text())
    assert record["model"]["scan_layers"]
    assert (record["source_language"], record["target_language"]) == ("en", "de")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert min(s for s in steps if s > 30) == 40, "the resumed run must continue, not start over"
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses
    assert any("dev/bleu" in r for r in rows) and any("dev/loss" in r for r in rows)
    for name in ("config.json", "tokenizer/spm.model", "results.json", "samples.txt",
                 "plots/loss.png", "plots/lr.png", "plots/bleu.png"):
        assert (workdir / name).exists(), name
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["30", "60"]
    assert list((workdir / "tensorboard").iterdir())
    results = json.loads((workdir / "results.json").read_text())
    assert "nrefs:1" in results["sacrebleu_signature"] and results["test_sentences"] > 0
    assert results["final_step"] == 60
    # The scanned model translates from the step-60 (scanned) and the best (step 30 here:
    # unrolled) checkpoints, and draws its heat maps.
    assert Translator(workdir, checkpoint="latest").step == 60
    translator = Translator(workdir)
    assert len(translator(["Click OK."], beam_size=1)) == 1
    weights, src_pieces, tgt_pieces = translator.cross_attention("Click OK.", "Klicken Sie auf OK.")
    assert weights.shape == (len(tgt_pieces), len(src_pieces))

    # Resuming with another architecture names the differing field.
    with pytest.raises(ValueError, match="d_model"):
        train(TrainConfig.flat(**{**_config(workdir, corpus_slice, 100).to_dict(), "d_model": 48}))


def test_translate_cli_uses_the_run(tmp_path, trained_run, capsys):
    from jaxformer.cli.translate import main as translate_cli

    def main(argv):   # the JAX engine; the CTranslate2 engine's are in tests/test_ct2_serving.py
        return translate_cli(["--engine", "jax", *argv])

    workdir = tmp_path / "run"
    shutil.copytree(trained_run, workdir)
    sentences = ["Click OK.", "Choose Format - Cells.", "Enter the name of the new table."]
    main(["--workdir", str(workdir), "--beam-size", "1", *sentences])
    greedy = capsys.readouterr().out.splitlines()
    assert len(greedy) == 3
    # Order is restored after length sorting: each line equals its sentence decoded alone.
    for sentence, line in zip(sentences, greedy):
        main(["--workdir", str(workdir), "--beam-size", "1", sentence])
        assert capsys.readouterr().out.splitlines() == [line]

    main(["--workdir", str(workdir), "--beam-size", "3", "--n-best", "3", *sentences[:2]])
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "0", "1", "1", "1"]
    scores = [float(r[1]) for r in rows[:3]]
    assert scores == sorted(scores, reverse=True)

    png = tmp_path / "attention.png"
    main(["--workdir", str(workdir), "--sample", "--temperature", "0.7", "--top-k", "5",
          "--attention-png", str(png), sentences[0]])
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert png.stat().st_size > 1000

    (tmp_path / "input.txt").write_text("\n".join(sentences) + "\n")
    main(["--workdir", str(workdir), "--beam-size", "1", "--input", str(tmp_path / "input.txt")])
    assert capsys.readouterr().out.splitlines() == greedy

    # An empty input line gives an empty output line; the others are unchanged.
    (tmp_path / "gaps.txt").write_text(f"{sentences[0]}\n\n{sentences[1]}\n")
    main(["--workdir", str(workdir), "--beam-size", "1", "--input", str(tmp_path / "gaps.txt")])
    assert capsys.readouterr().out.splitlines() == [greedy[0], "", greedy[1]]

    bad_calls = {
        "config.json": ["--workdir", str(tmp_path / "nowhere"), "x"],
        "--layer 9 is out of range": ["--workdir", str(workdir), "--attention-png",
                                      str(tmp_path / "a.png"), "--layer", "9", "x"],
        "--input file": ["--workdir", str(workdir), "--input", str(tmp_path / "missing.txt")],
        "is not a regular file (a folder, a pipe?)": ["--workdir", str(workdir), "--input", str(tmp_path)],
        "folder of --attention-png": ["--workdir", str(workdir), "--attention-png",
                                      str(tmp_path / "no" / "a.png"), "x"],
        # no file type (matplotlib would write heatmap.png) or one matplotlib cannot write
        "--attention-png '" + str(tmp_path / "heatmap") + "' needs a file type": [
            "--workdir", str(workdir), "--attention-png", str(tmp_path / "heatmap"), "x"],
        "a.xyz' needs a file type": ["--workdir", str(workdir), "--attention-png", str(tmp_path / "a.xyz"),
                                     "x"],
        "--temperature must be a positive finite number": ["--workdir", str(workdir), "--sample",
                                                           "--temperature", "0", "x"],
        "is one of the run's own files": ["--workdir", str(workdir), "--output",
                                          str(workdir / "config.json"), "x"],
        "as arguments or in --input, not both": ["--workdir", str(workdir), "--input",
                                                 str(workdir / "config.json"), "x"],
    }
    for message, argv in bad_calls.items():
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def _final_params(workdir):
    from jaxformer.decode.translator import Translator

    return Translator(workdir, checkpoint="latest").params


def test_step_budget_gives_the_same_run_on_a_slower_machine(tmp_path, trained_run, corpus_slice, monkeypatch):
    """Issue 22: the default budget is steps, so a slow loop changes the wall time only."""
    import time

    import jax
    import numpy as np

    from jaxformer.train import trainer

    checked, calls = trainer.check_token_ids, []

    def slow_check(*args, **kwargs):   # runs once per batch tensor, before every step
        calls.append(1)
        time.sleep(0.02)
        return checked(*args, **kwargs)

    monkeypatch.setattr(trainer, "check_token_ids", slow_check)
    slow = train(_config(tmp_path / "slow", corpus_slice, 30))
    fast = json.loads((trained_run / "results.json").read_text())
    for key in ("test_bleu", "test_chrf", "final_step", "best_dev_bleu", "degenerate", "steps"):
        assert slow[key] == fast[key], key
    assert slow["stopped_by"] == "max_steps" and slow["steps"]["cut_by_max_minutes"] is False
    assert len(calls) == 3 * 30 and "matmul_gflops" not in slow   # 1.8 s of sleep in the loop
    jax.tree_util.tree_map(np.testing.assert_array_equal, _final_params(tmp_path / "slow"),
                           _final_params(trained_run))


def test_a_max_minutes_cut_is_reported(tmp_path, corpus_slice, monkeypatch, capsys):
    from jaxformer.train import trainer

    # The clock is the preemption module's to read; here it says "time is up" at step 10.
    monkeypatch.setattr(trainer, "past_deadline", lambda deadline, step, every: step >= 10)
    # The fixture's settings otherwise, so every program comes from the compilation cache.
    cfg = TrainConfig.flat(**{**_config(tmp_path / "cut", corpus_slice, 30).to_dict(), "max_minutes": 5.0})
    results = train(cfg)
    assert results["stopped_by"] == "max_minutes" and results["final_step"] == 10
    assert results["steps"] == {"done": 10, "max_steps": 30, "fraction_done": 10 / 30,
                                "cut_by_max_minutes": True}
    out = capsys.readouterr().out
    assert "--max-minutes 5 stopped training at step 10 of --max-steps 30 (33% of the step budget)" in out
