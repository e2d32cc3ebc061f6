"""Bulk translation (issue #23): ``jaxformer-translate --input FILE --output FILE`` streams
a file in chunks, writes one line per line whatever the bytes, resumes a SIGKILL'd run
to the same file byte for byte, and decodes on several devices and processes; the
distillation recipe runs on it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest

from jaxformer.cli import translate as translate_lib
from jaxformer.cli.prepare import main as prepare_main
from jaxformer.cli.translate import main as translate_cli
from jaxformer.data import corpus
from jaxformer.data.distillation import write_training_sources
from jaxformer.decode import bulk
from jaxformer.run.config import TrainConfig
from jaxformer.train.trainer import train


def translate_main(argv):
    """``jaxformer-translate`` on the JAX engine (the CTranslate2 engine's: tests/test_ct2_serving.py)."""
    return translate_cli(["--engine", "jax", *argv])


TINY_RUN = dict(vocab_size=200, max_len=32, eval_every=1000, dev_bleu_sentences=4, beam_size=1,
                progress=False, devices=1,
                num_layers=1)   # one layer per stack: what is tested does not depend on depth
WORDS = "the house is small and we go home click ok choose format cells enter name table".split()


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny run of 2 steps on 200 short pairs of the shipped en-de corpus, its dev and test
    split off by hash (a quarter each): the distillation test's teacher."""
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    root = tmp_path_factory.mktemp("teacher")
    corpus_file = root / "corpus.tsv"
    corpus_file.write_text("".join(f"{s}\t{t}\n" for s, t in
                                   [p for p in pairs if len(p[0]) < 60 and len(p[1]) < 60][:200]))
    train(TrainConfig.flat(workdir=str(root / "run"), train_file=str(corpus_file), preset="tiny", max_steps=2,
                      warmup_steps=1, batch_tokens=256, **TINY_RUN))
    return root / "run"


@pytest.fixture(scope="module")
def workdir(teacher):
    """The run the bulk tests translate with: the teacher. What it translates does not
    matter there, only that the same input and settings give the same bytes."""
    return teacher


@pytest.fixture(autouse=True)
def no_process_wide_cache(monkeypatch):
    monkeypatch.setattr(translate_lib, "enable_compilation_cache", lambda run_dir: False)


def _input(path, lines=120):
    """Sentences of 1-5 words, every 17th line empty, every 29th over max_len (30 times as
    long), every 31st not UTF-8; a byte-order mark, Windows line ends, a bare \\r in a line."""
    rows = []
    for i in range(lines):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(1 + i % 5)]
        row = " ".join(words).encode()
        if i % 17 == 0:
            row = b""
        elif i % 29 == 0:
            row = b" ".join([row] * 30)
        elif i % 31 == 0:
            row = b"caf\xe9 " + row
        elif i % 37 == 0:
            row = row + b"\rmore"
        rows.append(row)
    path.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(rows) + b"\r\n")
    return rows


def test_one_line_out_per_line_in_whatever_the_bytes(workdir, tmp_path, capsys):
    rows = _input(tmp_path / "in.txt")
    flags = ["--workdir", str(workdir), "--input", str(tmp_path / "in.txt"), "--beam-size", "1"]
    with pytest.raises(SystemExit) as stop:   # strict: refused by line number, nothing decoded
        translate_main([*flags, "--output", str(tmp_path / "out.txt")])
    assert stop.value.code == 2 and "line 32, 63, 94" in capsys.readouterr().err
    assert not (tmp_path / "out.txt").exists() and not (tmp_path / "out.txt.parts").exists()

    long_rows = [i for i in range(len(rows)) if i % 29 == 0 and i % 17]
    for mode in ("truncate", "empty", "sentences"):   # lines decoded whole, or by sentence (the default)
        out = tmp_path / f"{mode}.txt"
        how = [] if mode == "sentences" else ["--no-split-sentences", "--long-lines", mode]
        translate_main([*flags, "--output", str(out), "--chunk-lines", "25", "--input-errors", "replace",
                        *how])
        report = capsys.readouterr().err
        long = 0 if mode == "sentences" else 4   # by sentence, a long sentence is translated in pieces
        assert (f"120 lines in 5 chunk(s), 0 found finished; decoded 120 lines (8 empty, {long} longer than "
                "max_len, 3 with bytes not UTF-8 replaced)") in report, report
        lines = out.read_text(encoding="utf-8").split("\n")
        assert len(lines) == 121 and lines[-1] == "" and not (tmp_path / f"{mode}.txt.parts").exists()
        assert all(lines[i] == "" for i, row in enumerate(rows) if not row)
        if mode == "empty":
            assert all(lines[i] == "" for i in long_rows)


def _command(workdir, source, out, *flags):
    return [sys.executable, "-m", "jaxformer.translate", "--engine", "jax", "--workdir", str(workdir),
            "--input", str(source),
            "--output", str(out), "--chunk-lines", "2", "--input-errors", "replace", *flags]


def test_a_sigkilled_run_resumes_to_the_same_file_and_other_settings_are_refused(workdir, tmp_path, capsys):
    """Sampling, so every chunk's random stream must be the same after the restart."""
    source = tmp_path / "in.txt"
    _input(source, lines=200)   # 100 chunks: the kill lands after 3, far from the end
    flags = ["--sample", "--seed", "3", "--top-k", "5"]
    out = tmp_path / "killed.txt"
    child = subprocess.Popen(_command(workdir, source, out, *flags), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    parts = tmp_path / "killed.txt.parts"
    deadline = time.monotonic() + 300
    while not (parts.is_dir() and len(list(parts.glob("*.txt"))) >= 3) and time.monotonic() < deadline:
        assert child.poll() is None, child.communicate()[1][-3000:]
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.communicate()
    assert child.returncode == -signal.SIGKILL and not out.exists()
    finished = len(list(parts.glob("*.txt")))
    assert 3 <= finished < 100

    argv = _command(workdir, source, out, *flags)[3:]
    with pytest.raises(SystemExit) as stop:   # other settings: refused, the chunks kept
        translate_main([*argv[:-len(flags)], "--sample", "--seed", "4", "--top-k", "5"])
    assert stop.value.code == 2 and "seed: then 3, now 4" in capsys.readouterr().err
    manifest = parts / "manifest.json"   # as if the run were retrained to the same step since
    record = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**record, "params_sha256": "0" * 64}))
    with pytest.raises(SystemExit) as stop:
        translate_main(argv)
    assert stop.value.code == 2 and "params_sha256: then '000" in capsys.readouterr().err
    manifest.write_text(json.dumps(record))
    translate_main(argv)
    assert f"{finished} found finished" in capsys.readouterr().err
    translate_main(_command(workdir, source, tmp_path / "straight.txt", *flags)[3:])
    assert out.read_bytes() == (tmp_path / "straight.txt").read_bytes()
    assert len(out.read_bytes().split(b"\n")) == 201


def test_a_beam_job_records_no_sampling_settings_so_another_seed_resumes_it(workdir, tmp_path):
    """Beam search ignores --seed: a resume with another one gives the same bytes and is
    not refused; with --sample the seed is part of the job."""
    from jaxformer.cli.bulk import job_record
    from jaxformer.cli.translate_flags import parse_translate_args
    from jaxformer.decode.translator import Translator

    translator = Translator(workdir)
    _input(tmp_path / "in.txt", lines=2)

    def record(*flags):
        args = parse_translate_args(["--workdir", str(workdir), "--input", str(tmp_path / "in.txt"),
                                     "--output", str(tmp_path / "out.txt"), *flags])
        return job_record(args, translator)

    beam = record("--seed", "3", "--beam-size", "2")
    assert beam == record("--seed", "4", "--beam-size", "2") and beam["seed"] is None
    assert beam["beam_size"] == 2 and beam["params_sha256"] == translator.params_digest()
    assert record("--sample", "--seed", "3")["seed"] == 3 != record("--sample", "--seed", "4")["seed"]


def test_bfloat16_matmuls_in_bulk_and_a_resume_with_other_matmuls_is_refused(workdir, tmp_path, capsys,
                                                                              killed_at_chunk):
    """``--matmul-dtype bfloat16``: the run's weight matrices are cast once, the file gets one
    line per line; the dtype is in the manifest, so finishing an interrupted bulk run with
    float32 matmuls (other bytes) is refused."""
    from jaxformer.decode.translator import Translator

    translator = Translator(workdir, matmul_dtype="bfloat16")
    assert translator.config.matmul_dtype == "bfloat16"
    leaves = jax.tree_util.tree_leaves_with_path(translator.params)
    assert {str(x.dtype) for p, x in leaves if jax.tree_util.keystr(p).endswith("kernel']")} == {"bfloat16"}
    assert {str(x.dtype) for p, x in leaves if jax.tree_util.keystr(p).endswith("scale']")} == {"float32"}

    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    _input(source, lines=40)
    flags = ["--workdir", str(workdir), "--input", str(source), "--output", str(out), "--beam-size", "2",
             "--chunk-lines", "8", "--input-errors", "replace", "--early-stopping"]
    with killed_at_chunk(3):
        translate_main([*flags, "--matmul-dtype", "bfloat16"])
    with pytest.raises(SystemExit) as stop:
        translate_main(flags)
    assert stop.value.code == 2 and "matmul_dtype: then 'bfloat16', now None" in capsys.readouterr().err
    translate_main([*flags, "--matmul-dtype", "bfloat16"])
    assert "5 chunk(s), 2 found finished" in capsys.readouterr().err
    assert len(out.read_text(encoding="utf-8").split("\n")) == 41


def test_data_parallel_on_eight_devices_gives_the_one_device_file(workdir, tmp_path):
    source = tmp_path / "in.txt"
    _input(source, lines=40)
    common = ["--workdir", str(workdir), "--input", str(source), "--input-errors", "replace",
              "--beam-size", "2", "--batch-size", "8", "--chunk-lines", "16", "--early-stopping"]
    translate_main([*common, "--output", str(tmp_path / "one.txt")])
    translate_main([*common, "--output", str(tmp_path / "eight.txt"), "--mesh", "data=8"])
    assert (tmp_path / "eight.txt").read_bytes() == (tmp_path / "one.txt").read_bytes()


def test_two_processes_on_localhost_give_the_one_process_file(workdir, tmp_path, xla_flags):
    """``jax.distributed`` on localhost: two processes of 2 CPU devices each, each on its
    own ``--mesh data=2``, split the chunks and process 0 joins them; the file equals one
    process's on one device, byte for byte."""
    source = tmp_path / "in.txt"
    _input(source, lines=60)
    flags = ["--beam-size", "2", "--batch-size", "4"]
    translate_main(_command(workdir, source, tmp_path / "one.txt", *flags)[3:])
    port = _free_port()
    # conftest.py's compile settings kept: process 1's programs never reach JAX's persistent
    # cache (only process 0 writes it; a key names the devices), so it compiles them every time.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(2)}
    workers = [subprocess.Popen(
        [*_command(workdir, source, tmp_path / "two.txt", *flags, "--mesh", "data=2"),
         "--coordinator-address", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        errors = [worker.communicate(timeout=240)[1] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    assert [w.returncode for w in workers] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    assert "60 lines in 30 chunk(s), 0 found finished; decoded 60 lines" in errors[0]
    assert "by 2 processes" in errors[0] and "sentences/s" not in errors[1]
    assert (tmp_path / "two.txt").read_bytes() == (tmp_path / "one.txt").read_bytes()
    assert not (tmp_path / "two.txt.parts").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_a_job_started_by_an_older_version_is_refused_naming_the_version_not_the_command(tmp_path):
    """A manifest without a setting later versions record (a sampled job of per-batch keys has
    no ``sampling_keys``) cannot be finished by this version: the fix says so."""
    bulk.BulkJob(tmp_path / "out.txt", {"input_sha256": "x", "mode": "sample"})
    with pytest.raises(bulk.BulkResumeError, match="started by an older jaxformer, whose manifest has no "
                                                   "sampling_keys: finish it with that version, or delete"):
        bulk.BulkJob(tmp_path / "out.txt", {"input_sha256": "x", "mode": "sample",
                                            "sampling_keys": "line index"})
    with pytest.raises(bulk.BulkResumeError, match="Run the command that started it"):
        bulk.BulkJob(tmp_path / "out.txt", {"input_sha256": "y", "mode": "sample"})


def test_scan_input_counts_hashes_and_finds_bad_lines(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"a\n\xff\nlast without newline")
    info = bulk.scan_input(path)
    assert (info.lines, info.bad_lines, info.size) == (3, (2,), path.stat().st_size)
    assert [len(c) for c in bulk.read_chunks(path, 2, "replace")] == [2, 1]
    with pytest.raises(bulk.BulkInputError, match="chunk_lines must be at least 1"):
        bulk.translate_file(lambda *a: ("", {}), path, tmp_path / "out.txt", record={}, chunk_lines=0)


def test_an_output_that_is_the_input_a_folder_or_gz_named_is_refused_before_loading(tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("Click OK.\n")
    (tmp_path / "folder").mkdir()
    for output, message in ((source, "is the --input file"), (tmp_path / "folder", "is a folder"),
                            (tmp_path / "out.txt.gz", "ends in .gz")):
        with pytest.raises(SystemExit) as stop:   # no run directory needed: refused first
            translate_main(["--workdir", str(tmp_path / "none"), "--input", str(source), "--output",
                            str(output)])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    assert source.read_text() == "Click OK.\n" and not list(tmp_path.glob("*.parts"))
    common = ["--workdir", str(tmp_path / "none"), "--input", str(source), "--coordinator-address", "host:1"]
    out = ["--output", str(tmp_path / "o.txt")]
    for flags, message in (([*out, "--num-processes", "0", "--process-id", "0"],
                            "--num-processes must be at least 1"),
                           ([*out, "--num-processes", "2"],
                            "need all of --coordinator-address, --num-processes and --process-id"),
                           (["--num-processes", "2", "--process-id", "0"], "are for bulk mode only")):
        with pytest.raises(SystemExit) as stop:   # refused before jax.distributed starts
            translate_main([*common, *flags])
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_distillation_a_student_trains_on_the_teachers_output_for_its_training_sources(
        teacher, tmp_path, capsys):
    """Sequence-level distillation (README, "Distillation"): the teacher translates the
    sources of its own training split (not its dev and test sources) in bulk, and a
    smaller student trains on the result through the normal path, scored on the teacher's
    real dev and test pairs.

    The recipe decodes with beam search; this test samples. A tiny teacher's beam ends
    every translation at once (end-of-sentence is its likeliest first token: measured,
    tiny runs of up to 400 steps on these pairs translate everything to an empty line,
    and a small-preset teacher that emits tokens costs 45-60 s to train here), which would
    leave the student no pair. Sampling draws from the same model through the same bulk
    path; beam search in bulk mode is tested above, and the real-size recipe with beam 4
    is measured in benchmarks/README.md ("Distillation")."""
    sources = tmp_path / "train.en"
    corpus_file = teacher.parent / "corpus.tsv"
    before = corpus_file.read_bytes()
    for output, message, more in ((corpus_file, "is the run's corpus file", []),
                                  (teacher / "config.json", "the run's own config.json", []),
                                  (sources, "from its own data flags: drop --train-file, --vocab-size",
                                   ["--train-file", str(corpus_file), "--vocab-size", "3"])):
        with pytest.raises(SystemExit) as stop:   # the recipe's own input is never cut to its sources
            prepare_main(["--workdir", str(teacher), "--write-train-sources", str(output), *more])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    assert corpus_file.read_bytes() == before
    prepare_main(["--workdir", str(teacher), "--write-train-sources", str(sources)])
    lines = sources.read_text().splitlines()
    held_out = {line.split("\t")[0] for name in ("dev", "test")
                for line in (teacher / "prepared" / f"{name}.tsv").read_text().splitlines()}
    counts = json.loads((teacher / "prepared" / "manifest.json").read_text())["counts"]
    assert len(lines) == counts["train"] + sum(counts["train_dropped"].values()) > 60
    assert not held_out & set(lines) and len(lines) + counts["dev"] + counts["test"] == 200

    hyps = tmp_path / "train.distilled.de"
    translate_main(["--workdir", str(teacher), "--input", str(sources), "--output", str(hyps),
                    "--sample", "--seed", "0", "--chunk-lines", "64"])
    outputs = hyps.read_text().split("\n")[:-1]
    # about half the tiny teacher's samples end at once (eos is its likeliest first token)
    assert len(outputs) == len(lines) and sum(map(bool, outputs)) > len(lines) // 4
    distilled = tmp_path / "distilled.tsv"
    distilled.write_text("".join(f"{s}\t{t}\n" for s, t in zip(lines, outputs)))

    student = tmp_path / "student"
    results = train(TrainConfig.flat(
        workdir=str(student), train_file=str(distilled), dev_file=str(teacher / "prepared" / "dev.tsv"),
        test_file=str(teacher / "prepared" / "test.tsv"), preset="tiny", d_model=16, d_ff=32, max_steps=2,
        **TINY_RUN))
    record = json.loads((student / "config.json").read_text())
    assert record["model"]["d_model"] == 16 and results["test_sentences"] == counts["test"]
    student_counts = json.loads((student / "prepared" / "manifest.json").read_text())["counts"]
    assert student_counts["train"] + sum(student_counts["train_dropped"].values()) == sum(map(bool, outputs))


def test_training_sources_need_a_prepared_run_and_a_file_to_write(teacher, tmp_path):
    with pytest.raises(FileNotFoundError, match="no run with prepared data"):
        write_training_sources(tmp_path, tmp_path / "out.txt")
    for output in (tmp_path, tmp_path / "missing" / "out.txt"):
        with pytest.raises(ValueError, match="is a folder, or its folder does not exist"):
            write_training_sources(teacher, output)
    with pytest.raises(ValueError, match="'/proc/x.txt' cannot be written"):   # Linux's /proc
        write_training_sources(teacher, "/proc/x.txt")
    assert not list(tmp_path.glob("*.tmp"))


def test_a_trained_run_exports_to_hugging_face_and_back_and_the_export_never_overwrites_a_run(
        teacher, tmp_path, capsys):
    """A run trained here (the teacher: its decoder starts from bos, not pad, so the export
    bans both) goes to a Marian folder and back with the same weights. ``--out`` naming a
    run (itself included) or a folder holding a model (an earlier export) is refused; other
    files stay beside the export. A Hugging Face folder given as a run directory is named
    as one, with the conversion to run."""
    import numpy as np

    from jaxformer.cli.convert import main as convert_main
    from jaxformer.decode.translator import Translator

    snapshot = {p: p.read_bytes() for p in teacher.rglob("*") if p.is_file() and "jax_cache" not in p.parts}
    hf = tmp_path / "hf"   # say, a clone of a Hub repository: its own files stay
    hf.mkdir()
    (hf / "README.md").write_text("mine")
    convert_main(["--to-hf", str(teacher), "--out", str(hf)])
    assert json.loads((hf / "generation_config.json").read_text())["bad_words_ids"] == [[0], [2]]
    assert (hf / "README.md").read_text() == "mine"
    for out, message in ((teacher, "holds a jaxformer run"),
                         (hf, "already holds a model (model.safetensors")):
        with pytest.raises(SystemExit) as stop:
            convert_main(["--to-hf", str(teacher), "--out", str(out)])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    assert {p: p.read_bytes() for p in snapshot} == snapshot
    # A damaged download is named at conversion, before anything is written.
    damages = {"model.safetensors": (lambda b: b[:5000], "is not a readable safetensors file"),
               "source.spm": (lambda b: b"garbage", "is not a readable sentencepiece model"),
               "vocab.json": (lambda b: b[:-20], "is not readable JSON"),
               "config.json": (lambda b: b[:-20], "config.json is not readable JSON")}
    for name, (damage, message) in damages.items():
        broken = tmp_path / f"broken-{name}"
        shutil.copytree(hf, broken)
        (broken / name).write_bytes(damage((hf / name).read_bytes()))
        with pytest.raises(SystemExit) as stop:
            convert_main(["--from-hf", str(broken), "--workdir", str(tmp_path / "not-made")])
        assert stop.value.code == 2 and message in capsys.readouterr().err, name
        assert not (tmp_path / "not-made").exists(), name
    convert_main(["--from-hf", str(hf), "--workdir", str(tmp_path / "back")])
    # The same function: the export permutes d_model into Marian's positional layout, and
    # Marian's LayerNorm epsilon (1e-5, ours 1e-6) moves the logits by round-off only.
    original, back = Translator(teacher), Translator(tmp_path / "back")
    src, tgt_in = jax.numpy.array([[5, 9, 14, 3]]), jax.numpy.array([[2, 5, 9]])
    logits = [t.model.apply({"params": t.params}, src, tgt_in) for t in (original, back)]
    np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(logits[0]), rtol=1e-3, atol=1e-3)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        translate_main(["--workdir", str(hf), "x"])
    assert stop.value.code == 2 and "holds a Hugging Face model ('marian')" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Hugging Face model.*jaxformer-convert --from-hf"):
        train(TrainConfig.flat(workdir=str(tmp_path / "tuned"), init_from=str(hf), max_steps=1, **TINY_RUN))
    (tmp_path / "back" / "config.json").write_text('{"model": {"d_mod')   # damaged
    with pytest.raises(SystemExit) as stop:
        translate_main(["--workdir", str(tmp_path / "back"), "x"])
    assert stop.value.code == 2 and "config.json is not readable JSON" in capsys.readouterr().err
