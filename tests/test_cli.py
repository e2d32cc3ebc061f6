"""Issue 14: the commands around the library, on one tiny run trained once for the module.

The run is trained through ``jaxformer.cli.train.main`` with a ``--config`` file and flags, a
learning rate too small to change a translation (dev BLEU stays flat, so ``--patience 2`` stops
it at step 30 of 40), ``--average-last 2`` and ``--tgt-lang zh``. The tests read its
files and run the translate command on it. One test builds the wheel and checks what it
holds; a slow one installs it (not editable) and runs both console scripts.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxformer.cli import translate as translate_lib
from jaxformer.cli.train import main as train_main
from jaxformer.cli.translate import main as translate_cli
from jaxformer.decode.strategies import Greedy
from jaxformer.decode.translator import Translator
from jaxformer.run.checkpoints import RunCheckpoints
from jaxformer.run.config import DEFAULT_CPU_RUN, TrainConfig
from jaxformer.run.train_flags import parse_train_args
from jaxformer.train.averaging import average_last_checkpoints


def translate_main(argv):
    """``jaxformer-translate`` on the JAX engine (the CTranslate2 engine's: tests/test_ct2_serving.py)."""
    return translate_cli(["--engine", "jax", *argv])


REPO = Path(__file__).resolve().parents[1]
SENTENCES = ["Click OK.", "Choose Format - Cells.", "Enter the name of the new table."]


def _train_argv(files, workdir, config):
    return ["--config", str(config), "--workdir", str(workdir), "--train-file", str(files["train"]),
            "--dev-file", str(files["dev"]), "--test-file", str(files["test"]), "--patience", "2",
            "--average-last", "2", "--tgt-lang", "zh", "--no-progress"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, short_corpus):
    """``(workdir, argv, printed)``: the trained run, its command line and its stdout."""
    root = tmp_path_factory.mktemp("cli")
    config = root / "tiny.yaml"
    config.write_text("preset: tiny\nnum_layers: 1\nvocab_size: 300\nmax_len: 32\nbatch_tokens: 256\n"
                      "max_steps: 40\nwarmup_steps: 10\nlr_scale: 1e-7\neval_every: 10\n"
                      "checkpoint_every: 10\nlog_every: 5\ndev_bleu_sentences: 12\nbeam_size: 1\n"
                      "max_minutes: 10\ndevices: 1\n")
    argv = _train_argv(short_corpus, root / "run", config)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train_main(argv)
    return root / "run", argv, printed.getvalue()


@pytest.fixture(autouse=True)
def no_process_wide_cache(monkeypatch):
    """In-process CLI calls leave JAX's process-wide cache setting alone and trace their
    decoders (the compile cache and the exported decoders are tested in subprocesses)."""
    monkeypatch.setattr(translate_lib, "enable_compilation_cache", lambda run_dir: False)


def test_run_stops_early_scores_with_chrf_and_the_zh_tokenizer_and_writes_test_files(run):
    workdir, _, _ = run
    results = json.loads((workdir / "results.json").read_text())
    assert results["stopped_by"] == "early_stopping" and results["final_step"] == 30
    assert "tok:zh" in results["sacrebleu_signature"]
    assert "test_chrf" in results and results["chrf_signature"].startswith("nrefs:1|")
    assert results["averaged"]["steps"] == [20, 30] and results["averaged"]["kept"] is False
    assert not (workdir / "averaged").exists()   # not better than the best: not kept
    lines = {name: (workdir / f"test.{name}").read_text().splitlines() for name in ("src", "ref", "hyp")}
    assert len(lines["src"]) == len(lines["ref"]) == len(lines["hyp"]) == results["test_sentences"] == 12


def test_train_log_holds_everything_printed_and_a_line_per_window(run):
    workdir, _, printed = run
    log = (workdir / "train.log").read_text()
    for line in printed.splitlines():
        assert line.strip() in log, line
    windows = [line for line in log.splitlines() if " | loss " in line]
    assert [line.split("step ")[1].split(" ")[0] for line in windows] == [str(s) for s in range(5, 31, 5)]
    assert all("tok/s" in line and "lr " in line and "min left" in line for line in windows)
    assert "test BLEU" in log and "chrF" in log and "version:" in log   # the signatures


def test_config_json_replays_the_run_with_equal_settings(run):
    workdir, argv, _ = run
    original = parse_train_args(argv, DEFAULT_CPU_RUN).cfg   # as jaxformer-train parses it
    replay = parse_train_args(["--config", str(workdir / "config.json")], DEFAULT_CPU_RUN).cfg
    assert replay == original
    saved = json.loads((workdir / "config.json").read_text())["train"]
    assert replay == TrainConfig.flat(**saved) and replay.to_dict() == saved


def _abstract_params(translator):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), translator.params)


def test_averaged_checkpoint_is_the_mean_and_the_translate_tool_uses_it(run, tmp_path, capsys):
    workdir, _, _ = run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    translator = Translator(copy, checkpoint="latest")
    checkpoints = RunCheckpoints(copy, read_only=True)
    try:
        abstract = _abstract_params(translator)
        averaged, steps = average_last_checkpoints(checkpoints, abstract, 2)
        parts = [checkpoints.params_at(step, abstract) for step in (20, 30)]
        checkpoints.save_averaged(30, averaged, {"bleu": 1.0, "steps": steps})
    finally:
        checkpoints.close()
    assert steps == [20, 30]
    # A float32 sum halved: the same arithmetic as NumPy's, so equal bit for bit. The run's
    # learning rate is tiny, so many weights did not move between the two checkpoints; the
    # mean must differ from both where they do (biases, which start at zero, always move).
    means = [(np.asarray(a) + np.asarray(b)) / 2 for a, b in zip(*map(jax.tree_util.tree_leaves, parts))]
    for mean, leaf in zip(means, jax.tree_util.tree_leaves(averaged)):
        np.testing.assert_array_equal(leaf, mean)
    assert any(not np.array_equal(mean, a) and not np.array_equal(mean, b)
               for mean, a, b in zip(means, *map(jax.tree_util.tree_leaves, parts)))
    loaded = Translator(copy, checkpoint="averaged")
    assert loaded.kind == "averaged"
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.params, averaged)
    translate_main(["--workdir", str(copy), "--checkpoint", "averaged", "--beam-size", "1", SENTENCES[0]])
    captured = capsys.readouterr()
    assert "[averaged checkpoint, step 30]" in captured.err and len(captured.out.splitlines()) == 1


def test_translate_input_gives_one_line_per_line_whatever_its_bytes(run, tmp_path, capsys):
    """A bare \\r inside a line, Windows line ends, a byte-order mark, an empty line and
    a line that is not UTF-8: 9 lines in, 9 out, in order; strict mode (the default)
    refuses the bad line by number instead of a UnicodeDecodeError traceback."""
    workdir, _, _ = run
    source = tmp_path / "in.txt"
    source.write_bytes(b"\xef\xbb\xbfClick OK.\r\n" + b"one\rtwo\n" + b"\n" + b"caf\xe9 latin-1\n"
                       + b"".join(f"{s}\n".encode() for s in (SENTENCES * 2)[:5]))
    with pytest.raises(SystemExit) as stop:
        translate_main(["--workdir", str(workdir), "--beam-size", "1", "--input", str(source)])
    assert stop.value.code == 2
    assert "1 line(s) of" in capsys.readouterr().err   # named, with its number
    out = tmp_path / "out.txt"
    translate_main(["--workdir", str(workdir), "--beam-size", "1", "--input", str(source),
                    "--output", str(out), "--input-errors", "replace"])
    assert "line 4" in capsys.readouterr().err
    lines = out.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 10 and lines[-1] == "" and lines[2] == ""   # 9 lines, the empty one empty
    # Gzipped input is read as training reads corpora; n-best lists keep n lines per line.
    import gzip

    gz = tmp_path / "in.txt.gz"
    gz.write_bytes(gzip.compress(b"Click OK.\n\nChoose Format - Cells.\n"))
    translate_main(["--workdir", str(workdir), "--input", str(gz), "--output", str(out), "--beam-size", "2",
                    "--n-best", "2"])
    rows = [line.split("\t") for line in out.read_text(encoding="utf-8").splitlines()]
    assert [int(r[0]) for r in rows] == [0, 0, 1, 1, 2, 2] and rows[2][2] == rows[3][2] == ""
    gz.write_bytes(gzip.compress(b"Click OK.\n" * 500)[:40])   # truncated
    with pytest.raises(SystemExit) as stop:
        translate_main(["--workdir", str(workdir), "--input", str(gz), "--beam-size", "1"])
    assert stop.value.code == 2 and "truncated or corrupt gzip" in capsys.readouterr().err


def test_translate_n_best_beyond_the_beam_or_with_sampling_is_refused(run, capsys):
    workdir, _, _ = run
    for flags in (["--n-best", "6"], ["--n-best", "2", "--sample"]):   # the run's beam is 1
        with pytest.raises(SystemExit) as stop:
            translate_main(["--workdir", str(workdir), *flags, SENTENCES[0]])
        assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--n-best 6 needs a beam" in err and "--beam-size 6" in err and "--sample gives one" in err


def test_flags_a_fine_tune_ignores_or_cannot_take_are_refused(run, tmp_path, capsys):
    """``--init-from`` takes the architecture and tokenizer from the run it loads: a
    ``--preset`` or ``--vocab-size`` the user chose, as a flag or in a
    ``--config`` settings file, would do nothing (and be recorded), so it is an error."""
    workdir, _, _ = run
    (settings := tmp_path / "settings.yaml").write_text("preset: base\nmax_steps: 3\n")
    for flags, named in ((["--preset", "base"], "--preset would do nothing"),
                         (["--vocab-size=500", "--preset", "tiny"], "--preset and --vocab-size would do"),
                         (["--vocab-s", "500"], "Unrecognized options: --vocab-s"),   # no abbreviations
                         (["--config", str(settings)], "--preset would do nothing (given as a flag or in "
                                                       "--config): drop it"),
                         # A mesh the loaded sizes cannot take: the fix is another mesh, not a flag.
                         (["--mesh", "model=8"], "tgt_vocab_size 300 is not a multiple of the mesh's model "
                                                 "axis (8). These are the sizes of the run --init-from")):
        with pytest.raises(SystemExit) as stop:
            train_main(["--workdir", str(tmp_path / "tuned"), "--init-from", str(workdir), *flags])
        assert stop.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "tuned").exists()


def test_a_fine_tunes_resume_and_fresh_start_are_checked_against_the_loaded_run(run, tmp_path, capsys):
    """A run started with ``--init-from`` and continued without the flag is still a
    fine-tune: a chosen ``--preset`` is refused, and its mesh is checked against the loaded
    run's sizes, not the default preset's. With ``--fresh``, a mesh the loaded run cannot
    take is refused before the old run is moved aside."""
    workdir, _, _ = run
    tuned = tmp_path / "tuned"   # a fine-tune's record, as a start that made no checkpoint yet leaves it
    tuned.mkdir()
    (tuned / "config.json").write_text(json.dumps({"model": {}, "train": {"init_from": str(workdir)}}))
    for flags, named in ((["--preset", "base"], f"this run fine-tunes {workdir} (--init-from)"),
                         # tiny's d_model 32, not the default preset's 512
                         (["--mesh", "fsdp=3", "--devices", "3"], "d_model 32 is not a multiple"),
                         (["--init-from", str(workdir), "--mesh", "model=8", "--fresh"],
                          "These are the sizes of the run --init-from")):
        with pytest.raises(SystemExit) as stop:
            train_main(["--workdir", str(tuned), *flags])
        assert stop.value.code == 2 and named in capsys.readouterr().err
        left = {p.name for p in tuned.iterdir()}   # the record stays; nothing moved or copied in
        assert "config.json" in left and not any(name.startswith("old-") for name in left), left
        assert "tokenizer" not in left and "prepared" not in left, left
    # A fine-tune's start into an empty folder: checked before anything is made in it.
    (empty := tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stop:
        train_main(["--workdir", str(empty), "--init-from", str(workdir), "--mesh", "model=8"])
    assert stop.value.code == 2 and "These are the sizes of the run --init-from" in capsys.readouterr().err
    assert not list(empty.iterdir())


def test_ctrl_c_while_a_run_starts_exits_130_with_the_way_back_not_a_traceback(tmp_path, capsys,
                                                                               monkeypatch):
    from jaxformer.train import trainer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "setup", interrupted)
    with pytest.raises(SystemExit) as stop:
        train_main(["--workdir", str(tmp_path / "run"), "--preset", "tiny"])
    err = capsys.readouterr().err
    assert stop.value.code == 130 and "interrupted; run the same command again" in err
    assert "Traceback" not in err


def test_translate_repetition_flags_are_checked_and_used(run, capsys, monkeypatch):
    workdir, _, _ = run
    for flags, message in ((["--no-repeat-ngram-size", "-1"], "--no-repeat-ngram-size must be at least 0"),
                           (["--repetition-penalty", "0"], "--repetition-penalty must be > 0")):
        with pytest.raises(SystemExit) as stop:
            translate_main(["--workdir", str(workdir), *flags, SENTENCES[0]])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    # The flags reach the decoder (the rules themselves: tests/test_penalties.py).
    from jaxformer.decode.evaluation import Evaluator
    from jaxformer.decode.strategies import penalties

    seen, decoder = [], Evaluator._decoder

    def recording(self, strategy, sampled, **static):
        seen.append(strategy.processors)
        return decoder(self, strategy, sampled, **static)

    monkeypatch.setattr(Evaluator, "_decoder", recording)
    translate_main(["--workdir", str(workdir), "--no-repeat-ngram-size", "1", "--repetition-penalty", "1.2",
                    *SENTENCES])
    assert len(capsys.readouterr().out.splitlines()) == len(SENTENCES)
    assert seen and set(seen) == {penalties(no_repeat_ngram_size=1, repetition_penalty=1.2)}

def test_translate_refuses_a_config_that_no_longer_matches_the_checkpoint(run, tmp_path, capsys):
    """An edited config.json never translates with a model the checkpoint does not fill (a
    decoder layer more) or with a subset of the checkpoint (shared embeddings, so the
    target embedding and the output projection go unused): best and latest alike are an
    error naming the fields (exit 2)."""
    from jaxformer.run.checkpoints import CheckpointMismatchError

    workdir, _, _ = run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    record = json.loads((copy / "config.json").read_text())
    assert not record["model"]["share_embeddings"]
    for edit, named in (({"num_decoder_layers": record["model"]["num_decoder_layers"] + 1},
                         r"missing from the checkpoint: \['decoder'\]\['layer_"),
                        ({"share_embeddings": True}, r"not in the model: \['")):
        (copy / "config.json").write_text(json.dumps({**record, "model": {**record["model"], **edit}}))
        for which in ("auto", "latest", "best"):
            with pytest.raises(CheckpointMismatchError, match=named):
                Translator(copy, checkpoint=which)
    with pytest.raises(SystemExit) as stop:
        translate_main(["--workdir", str(copy), SENTENCES[0]])
    assert stop.value.code == 2 and "does not hold this model's parameters" in capsys.readouterr().err


def test_translator_decode_names_sentences_and_indices_that_do_not_fit(run):
    workdir, _, _ = run
    translator = Translator(workdir)
    for sentences, options, words in ((["a"], dict(indices=[0.5]), "indices must be one integer"),
                                      (["a", "b"], dict(indices=[0]), "indices must be one integer"),
                                      ({"a": 1}, {}, "sentences must be a list of strings")):
        with pytest.raises((TypeError, ValueError), match=words):
            translator.decode(sentences, Greedy(), **options)


def test_greedy_and_sampled_translations_keep_each_sentences_length_limit(run):
    """--max-len-a 1 --max-len-b 1: a short source in a batch with a long one gets at most its
    own length + 1 tokens in greedy and sampling, as in beam search (not the bucket's)."""
    workdir, _, _ = run
    translator = Translator(workdir, max_len_a=1.0, max_len_b=1)
    sources = ["Hi", SENTENCES[0] * 3]
    limits = [len(ids) + 1 for ids in translator.tokenizer.encode_source(sources)]
    decoded, decode = [], translator.evaluator.tokenizer.decode

    def spy(ids):   # the generated ids of each row, eos and pad included
        decoded.extend(np.asarray(row) for row in ids)
        return decode(ids)

    translator.evaluator.tokenizer.decode = spy
    for translate in (lambda: translator(sources, beam_size=1),
                      lambda: translator.sample(sources, seed=1, temperature=3.0)):
        decoded.clear()
        translate()
        lengths = sorted(int((row != translator.tokenizer.pad_id).sum()) for row in decoded)
        assert all(n <= limit for n, limit in zip(lengths, sorted(limits))), (lengths, limits)


def test_translate_flags_output_checkpoint_and_batches_sized_to_the_input(run, tmp_path, capsys,
                                                                          monkeypatch):
    from jaxformer.decode.evaluation import Evaluator

    workdir, _, _ = run
    calls, decoder = [], Evaluator._decoder

    def spy(self, strategy, sampled, **static):
        fn = decoder(self, strategy, sampled, **static)

        def recorded(params, src, index, rng):
            out = fn(params, src, index, rng)
            calls.append((src.shape, static, out[0].shape))
            return out
        return recorded

    monkeypatch.setattr(Evaluator, "_decoder", spy)
    out = tmp_path / "out.txt"
    translate_main(["--workdir", str(workdir), "--output", str(out), "--max-len-a", "0.5",
                    "--max-len-b", "3", "--beam-size", "4", *SENTENCES])   # the run's default: greedy
    assert len(out.read_text().splitlines()) == 3 and capsys.readouterr().out == ""
    (src_shape, static, hyp_shape), = calls
    assert src_shape == (4, 32)   # 3 sentences → 4 rows (a power of two), not --batch-size 32
    assert (static["len_a"], static["extra_len"], static["max_decode_len"]) == (0.5, 3, 19)
    assert hyp_shape[-1] == 19    # 0.5 × 32 + 3 output positions
    calls.clear()
    translate_main(["--workdir", str(workdir), "--beam-size", "4", SENTENCES[0]])
    assert calls[0][0][0] == 1     # one sentence, one row
    for flag, shown in (("latest", "[latest checkpoint, step 30]"), ("20", "[step checkpoint, step 20]"),
                        ("best", "[best checkpoint, step 10]")):
        translate_main(["--workdir", str(workdir), "--checkpoint", flag, "--beam-size", "1", "x"])
        assert shown in capsys.readouterr().err
    bad_calls = {"No checkpoint of step 7": ["--checkpoint", "7"],
                 "No 'averaged' checkpoint": ["--checkpoint", "averaged"],
                 "is not best, latest": ["--checkpoint", "newest"],
                 "folder of --output": ["--output", str(tmp_path / "no" / "out.txt")],
                 "--max-len-a + --max-len-b >= 1": ["--max-len-a", "0", "--max-len-b", "0"],
                 "--max-len-a must be at least 0 and finite, got nan": ["--max-len-a", "nan"],
                 "--max-len-a must be at least 0 and finite, got inf": ["--max-len-a", "inf"],
                 "--alpha must be finite, got nan": ["--alpha", "nan"],
                 "--temperature must be a positive finite number": ["--sample", "--temperature", "nan"],
                 "--seed must be at least 0 and < 4294967296": ["--sample", "--seed", str(2**64)],
                 "--beam-size is for beam search; --sample draws one": ["--sample", "--beam-size", "4"],
                 "--temperature and --top-p are for sampling: add --sample": ["--temperature", "0.5",
                                                                              "--top-p", "0.9"],
                 "--head chooses what --attention-png draws": ["--head", "0"],
                 "--output '/proc/x.txt' cannot be written": ["--output", "/proc/x.txt"],   # Linux
                 "too long": ["--output", "x" * 300 + ".txt"],
                 "has too long a name for this folder": ["--output", "x" * 250 + ".txt"]}
    for message, argv in bad_calls.items():
        with pytest.raises(SystemExit) as exit_info:
            translate_main(["--workdir", str(workdir), *argv, "x"])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, message


def test_the_translator_names_bad_arguments_and_fingerprints_its_parameters(run):
    """A string is not a list of sentences (it would be translated letter by letter); a
    beam below 1, a NaN alpha, batch size 0 and a layer outside the model are named; a step
    given as a string is a step; the parameters' digest tells checkpoints apart."""
    from jaxformer.decode.translator import Translator

    workdir, _, _ = run
    translator = Translator(workdir, checkpoint="20")
    assert translator.step == 20
    for call, error, message in (
            (lambda: translator("Click OK."), TypeError, "wrap one sentence in a list"),
            (lambda: translator.n_best("Click OK."), TypeError, "list of strings"),
            (lambda: translator(["x"], beam_size=0), ValueError, "beam_size must be at least 1"),
            (lambda: translator(["x"], alpha=float("nan")), ValueError, "alpha must be a finite"),
            (lambda: translator.cross_attention("x", "y", layer=5), ValueError, "layer 5 is out of range"),
            (lambda: Translator(workdir, batch_size=0), ValueError, "batch_size must be at least 1"),
            (lambda: Translator(workdir, batch_size=1.5), ValueError, "batch_size must be an integer"),
            (lambda: Translator(workdir, max_len_a=float("nan")), ValueError, "max_len_a must be a finite"),
            (lambda: translator(["x"], beam_size=2.0), ValueError, "beam_size must be an integer, got 2.0"),
            (lambda: translator.sample(["x"], temperature=float("nan")), ValueError,
             "temperature must be a finite number"),
            (lambda: translator.sample(["x"], seed=2**64), ValueError, r"seed must be in \[0, 2\*\*32\)"),
            (lambda: translator.sample(["x"], seed=1.0), ValueError, "seed must be an integer"),
            (lambda: translator(["x"], beam_size=2, early_stopping="no"), ValueError,
             "early_stopping must be True or False"),
            (lambda: translator(["x"], beam_size=2, no_repeat_ngram_size=2.0), ValueError,
             "no_repeat_ngram_size must be an integer")):
        with pytest.raises(error, match=message):
            call()
    # An empty or blank sentence is translated as empty (as the command line writes an empty
    # line), not as what the model makes of a bare </s>; its neighbours are unchanged.
    alone = translator(["Click OK."], beam_size=1)
    assert translator(["", "Click OK.", "   "], beam_size=1) == ["", *alone, ""]
    assert translator.n_best(["  "], beam_size=2) == [[("", 0.0)]]
    assert translator.sample(["", "Click OK."], seed=3)[0] == ""
    digest = translator.params_digest()
    assert translator(["x"], beam_size=2, no_repeat_ngram_size=2)   # the refused 2.0 left nothing behind
    assert digest == Translator(workdir, checkpoint=np.int64(20)).params_digest()
    assert digest != Translator(workdir, checkpoint=10).params_digest()


def test_translate_answers_each_stdin_line_as_it_arrives(run, tmp_path, monkeypatch):
    workdir, _, _ = run
    out = tmp_path / "stream.txt"
    read_fd, write_fd = os.pipe()
    seen_before_second = []

    def user():
        os.write(write_fd, (SENTENCES[0] + "\n").encode())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n") >= 1):
            time.sleep(0.05)
        seen_before_second.append(out.exists() and out.read_text().count("\n") == 1)
        os.write(write_fd, ("\n" + SENTENCES[1] + "\n").encode())   # an empty line stays empty
        os.close(write_fd)

    with os.fdopen(read_fd) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        thread = threading.Thread(target=user)
        thread.start()
        translate_main(["--workdir", str(workdir), "--beam-size", "1", "--output", str(out)])
        thread.join()
    assert seen_before_second == [True], "the first line was not answered before the second arrived"
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and lines[1] == ""



def test_a_seed_samples_each_line_the_same_from_a_pipe_a_file_or_in_bulk(run, tmp_path, capsys, monkeypatch):
    """--sample --seed 1 draws line i from the key of its index in the input: a pipe answered
    line by line (--batch-size 1), --input read whole and bulk mode in chunks of 2 agree."""
    workdir, _, _ = run
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{s}\n" for s in SENTENCES), encoding="utf-8")
    sample = ["--workdir", str(workdir), "--sample", "--seed", "1", "--temperature", "3"]
    read_fd, write_fd = os.pipe()
    os.write(write_fd, source.read_bytes())
    os.close(write_fd)
    with os.fdopen(read_fd) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        translate_main([*sample, "--batch-size", "1"])
    piped = capsys.readouterr().out
    translate_main([*sample, "--input", str(source)])
    assert capsys.readouterr().out == piped
    translate_main([*sample, "--input", str(source), "--output", str(tmp_path / "out.txt"),
                    "--chunk-lines", "2"])
    assert (tmp_path / "out.txt").read_text(encoding="utf-8") == piped and len(piped.splitlines()) == 3

_COUNT_COMPILES = """
import collections, sys
import jax.monitoring
from jaxformer.decode import beam_search
from jaxformer.model import transformer as model
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
def counted(name, real):   # counts the Python traces of beam search and of the model's init
    def wrapper(*args, **kwargs):
        events[name] += 1
        return real(*args, **kwargs)
    return wrapper
beam_search.Beam.search = counted("beam_search_traces", beam_search.Beam.search)
model.Transformer.init = counted("init_traces", model.Transformer.init)
from jaxformer.cli.translate import main
main(["--engine", "jax", *sys.argv[1:]])
print(json.dumps({k.rsplit("/", 1)[-1]: v for k, v in events.items()}), file=sys.stderr)
""".replace("import collections, sys", "import collections, json, sys")


def test_second_translate_invocation_compiles_and_traces_nothing(run, tmp_path):
    """The second process loads the compiled decoder (JAX's compilation cache) and its
    exported program and the parameters' shapes (jaxformer.decode.exported): it neither
    compiles nor traces beam search or the model's init, and prints the same line."""
    workdir, _, _ = run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("jax_cache"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    counts, printed = [], []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _COUNT_COMPILES, "--workdir", str(copy),
                               "--beam-size", "4", SENTENCES[0]],   # the run's own default: greedy
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        counts.append(json.loads(done.stderr.strip().splitlines()[-1]))
        printed.append(done.stdout)
    first, second = counts
    assert first.get("cache_misses", 0) > 0 and (copy / "jax_cache").is_dir()
    assert second.get("cache_misses", 0) == 0, second
    assert 0 < second.get("cache_hits", 0) <= first["cache_misses"], (first, second)   # nothing more
    assert first["beam_search_traces"] == 1 and first["init_traces"] == 1, first
    assert "beam_search_traces" not in second and "init_traces" not in second, second
    translator = Translator(copy)
    assert translator.defaults["beam_size"] == 1   # what the run decoded its dev set with (beam_size: 1)
    assert printed[0] == printed[1] == f"{translator([SENTENCES[0]], beam_size=4)[0]}\n"   # as traced here
    assert len(list((copy / "jax_cache" / "exported").glob("*.jaxexport"))) == 1


def _package_files() -> list[str]:
    """The package's files as the repository holds them: git's tracked files in a
    checkout (an editor's or a build's stray file is not part of the package), every
    file but caches elsewhere (an unpacked source archive)."""
    if (REPO / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "-z", "jaxformer"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout
        return sorted(name for name in listed.split("\0") if name)
    return sorted(p.relative_to(REPO).as_posix() for p in (REPO / "jaxformer").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def _source_tree(tmp_path):
    """What a source distribution holds: the project files and the package, no caches."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", *_package_files()):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, source / name)
    return source


def test_the_wheel_holds_every_package_file_and_its_console_scripts_resolve(tmp_path):
    """The wheel ``pip install .`` builds holds every file of the package (each wing's
    modules, the shipped corpora and their licence), and its console scripts are the ones
    pyproject.toml names, each an existing function. The slow test below installs it and
    runs ``jaxformer-train`` and ``jaxformer-translate`` from the installed copy."""
    import configparser
    import importlib
    import tomllib
    import zipfile

    source = _source_tree(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "dist"), str(source)],
                   check=True, timeout=300, cwd=tmp_path)
    wheel, = (tmp_path / "dist").glob("jaxformer-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = configparser.ConfigParser()
        entry_points.read_string(archive.read(info).decode())
    packaged = {name for name in names if name.startswith("jaxformer/")}
    expected = set(_package_files())
    assert packaged == expected, (sorted(expected - packaged), sorted(packaged - expected))
    assert {"jaxformer/corpora/en-de.tsv.gz", "jaxformer/train/trainer.py"} <= packaged
    scripts = dict(entry_points["console_scripts"])
    assert scripts == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for target in scripts.values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target


@pytest.mark.slow
def test_console_scripts_from_a_wheel_install_train_and_translate(tmp_path, short_corpus, xla_flags):
    source = _source_tree(tmp_path)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, timeout=300, cwd=tmp_path)
    # One CPU device, as a user's machine; compiled as the rest of the suite is.
    env = {**os.environ, "PYTHONPATH": str(target), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    where = subprocess.run([sys.executable, "-c", "import jaxformer; print(jaxformer.__file__)"], env=env,
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert where.startswith(str(target)), where   # the installed copy, not the checkout
    workdir = tmp_path / "run"
    for name in ("dev", "test"):   # 4 sentences each: one decoder shape, little decoding
        (tmp_path / f"{name}.tsv").write_text("".join(short_corpus[name].read_text().splitlines(True)[:4]))
    train = [str(target / "bin" / "jaxformer-train"), "--workdir", str(workdir), "--train-file",
             str(short_corpus["train"]), "--dev-file", str(tmp_path / "dev.tsv"), "--test-file",
             str(tmp_path / "test.tsv"), "--preset", "tiny", "--vocab-size", "300", "--max-len", "32",
             "--batch-tokens", "256", "--max-steps", "2", "--eval-every", "2", "--checkpoint-every", "2",
             "--log-every", "1", "--beam-size", "1", "--no-progress"]
    done = subprocess.run(train, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (workdir / "results.json").exists() and (workdir / "train.log").exists()
    done = subprocess.run([str(target / "bin" / "jaxformer-translate"), "--workdir", str(workdir),
                           "--beam-size", "1", *SENTENCES[:2]], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2
    assert "checkpoint, step 2]" in done.stderr


def test_a_line_of_several_sentences_is_translated_sentence_by_sentence(run, tmp_path, capsys,
                                                                         killed_at_chunk):
    """Issue 53: a line of three sentences is translated as the three sentences on lines of their
    own (the same batch), joined with single spaces; --no-split-sentences decodes it whole. A
    bulk job's manifest records the rule, so a job an older jaxformer began line by line is
    refused."""
    workdir, _, _ = run
    three = [*SENTENCES[1:], "Click the button."]   # sentencex reads "OK." as an abbreviation
    source, alone, out = tmp_path / "in.txt", tmp_path / "alone.txt", tmp_path / "out.txt"
    source.write_text("  ".join(three) + "\n\n")
    alone.write_text("".join(f"{s}\n" for s in three))
    flags = ["--workdir", str(workdir), "--beam-size", "1", "--output", str(out)]
    translate_main([*flags, "--input", str(alone)])
    sentences = out.read_text().splitlines()
    translate_main([*flags, "--input", str(source)])
    assert out.read_text().split("\n") == [" ".join(sentences), "", ""]
    translate_main([*flags, "--input", str(source), "--no-split-sentences"])
    whole = out.read_text().split("\n")
    assert len(whole) == 3 and whole[0] not in ("", " ".join(sentences))   # decoded whole
    bulk = [*flags, "--input", str(source), "--chunk-lines", "1"]
    with killed_at_chunk(2):
        translate_main(bulk)
    manifest = Path(f"{out}.parts") / "manifest.json"
    record = json.loads(manifest.read_text())
    assert record["split_sentences"] is True
    del record["split_sentences"]   # as a jaxformer before this rule wrote it
    manifest.write_text(json.dumps(record))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        translate_main(bulk)
    assert stop.value.code == 2 and "split_sentences" in capsys.readouterr().err
