"""Serving through CTranslate2 (jaxformer.serve, ``jaxformer-translate --engine``): tiny runs
of both norm positions trained here, decoded by both engines token for token alike under
rules both honour; the cached model, the command's engine choice, bulk mode and refusals."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ctranslate2")

from jaxformer.cli.translate import main as translate_main  # noqa: E402
from jaxformer.data import corpus  # noqa: E402
from jaxformer.decode.engine import Request  # noqa: E402
from jaxformer.decode.penalties import penalties  # noqa: E402
from jaxformer.decode.served_run import ServedRun  # noqa: E402
from jaxformer.decode.strategies import Beam, Greedy  # noqa: E402
from jaxformer.decode.translator import Translator  # noqa: E402
from jaxformer.run.config import TrainConfig  # noqa: E402
from jaxformer.serve.ct2_engine import CT2Engine  # noqa: E402
from jaxformer.train.trainer import train  # noqa: E402

PAIRS = [p for p in corpus.read_tsv(corpus.builtin_corpus_path("en-de"))[0]
         if len(p[0]) < 50 and len(p[1]) < 50]
SOURCES = [s for s, _ in PAIRS[:24]]
LIMIT = 24   # one fixed output limit (a = 0, b = LIMIT) for the parity tests


@pytest.fixture(scope="module", params=["pre", "post"])
def run(request, tmp_path_factory):
    """A tiny run of 120 steps on 300 short pairs of the shipped en-de corpus, with ``norm_position``."""
    root = tmp_path_factory.mktemp(f"run-{request.param}")
    (root / "corpus.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS[:300]))
    train(TrainConfig.flat(workdir=str(root / "run"), train_file=str(root / "corpus.tsv"), preset="tiny",
                           norm_position=request.param, max_steps=120, warmup_steps=20, lr_scale=0.3,
                           batch_tokens=512,
                           vocab_size=300, max_len=32, eval_every=1000, dev_bleu_sentences=4, beam_size=1,
                           progress=False, devices=1))
    return root / "run"


@pytest.mark.parametrize("beam_size, repetition_penalty, no_repeat_ngram_size",
                         [(1, 1.0, 0), (1, 1.3, 2), (4, 1.0, 0), (4, 1.3, 2)])
def test_both_engines_give_the_same_tokens_under_shared_rules(run, beam_size, repetition_penalty,
                                                              no_repeat_ngram_size):
    """float32, one length limit, a hypothesis cut there without eos, |Y|^α, the k-finished stop,
    the repetition rules applied as CTranslate2 applies them (to the logits, then renormalized, in
    beam search)."""
    # one loaded run for both engines; a hypothesis at the limit is cut there, without eos (CT2's
    # rule; generate's without forced_eos_token_id)
    served = dataclasses.replace(ServedRun.load(run, max_len_a=0, max_len_b=LIMIT), forced_eos=False)
    engine, translator = CT2Engine(served, batch_size=8), Translator(served, batch_size=8)
    processors = penalties(no_repeat_ngram_size, repetition_penalty)
    strategy = (Greedy(False, processors) if beam_size == 1 else
                Beam(beam_size, 0.6, "hf", True, processors, penalize_logits=True, forced_eos=False))
    ours = translator.decode(SOURCES, strategy)
    theirs = engine.translate(SOURCES, Request(beam_size, 0.6, "hf", True, no_repeat_ngram_size,
                                               repetition_penalty))
    assert [translation.text for translation in theirs] == [n_best[0][0] for n_best in ours]
    assert len({n_best[0][0] for n_best in ours}) > len(SOURCES) // 2   # the model tells them apart


def test_the_model_is_cached_per_checkpoint_and_rebuilt_when_the_checkpoint_changes(run, tmp_path, capsys):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("ct2"))
    argv = ["--workdir", str(copy), "--engine", "ct2", SOURCES[0], SOURCES[1]]
    translate_main(argv)
    first = capsys.readouterr()
    assert "converting best checkpoint" in first.err and "engine ct2 (--engine)" in first.err
    [entry] = (copy / "ct2").iterdir()
    assert entry.name.startswith("float32-best-") and (entry / "model.bin").is_file()
    translate_main(argv)
    again = capsys.readouterr()
    assert "converting" not in again.err and again.out == first.out
    checkpoint = ServedRun.load(copy).checkpoint
    for path in checkpoint.path.rglob("*"):   # the checkpoint written anew: same bytes, new files
        if path.is_file():
            os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    translate_main(argv)
    assert "converting" in capsys.readouterr().err
    assert [p.name for p in (copy / "ct2").iterdir()] != [entry.name] and not entry.exists()
    translate_main([*argv, "--quantization", "int8"])   # its own entry beside float32's
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert sorted(p.name.split("-")[0] for p in (copy / "ct2").iterdir()) == ["float32", "int8"]


def test_the_ct2_path_imports_no_jax(run):
    CT2Engine(run)   # the model cached
    code = ("import sys\nfrom jaxformer.cli.translate import main\n"
            f"main(['--workdir', {str(run)!r}, '--engine', 'ct2', {SOURCES[0]!r}])\n"
            "print('jax' in sys.modules, 'flax' in sys.modules, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "False False" and len(done.stdout.splitlines()) == 1


def test_bulk_mode_records_the_engine_resumes_byte_for_byte_and_never_mixes_engines(run, tmp_path, capsys,
                                                                                 killed_at_chunk):
    source, whole, out = tmp_path / "in.txt", tmp_path / "whole.txt", tmp_path / "out.txt"
    source.write_text("\n".join(SOURCES[:10] + ["", *SOURCES[10:20]]) + "\n")
    flags = ["--workdir", str(run), "--input", str(source), "--chunk-lines", "4", "--sample", "--seed", "3",
             "--top-k", "8"]
    translate_main([*flags, "--output", str(whole)])
    assert "engine ct2 (a CPU, ctranslate2 installed)" in capsys.readouterr().err
    with killed_at_chunk(3):
        translate_main([*flags, "--output", str(out)])
    manifest = json.loads((tmp_path / "out.txt.parts" / "manifest.json").read_text())
    assert manifest["engine"] == "ct2" and manifest["quantization"] == "float32"
    with pytest.raises(SystemExit) as stop:   # the other engine never finishes it
        translate_main([*flags, "--output", str(out), "--engine", "jax"])
    assert stop.value.code == 2 and "engine: then 'ct2', now 'jax'" in capsys.readouterr().err
    translate_main([*flags, "--output", str(out)])
    assert "6 chunk(s), 2 found finished" in capsys.readouterr().err
    assert out.read_bytes() == whole.read_bytes() and out.read_text().split("\n")[10] == ""
    translate_main(["--workdir", str(run), "--input", str(source), "--output", str(tmp_path / "n.txt"),
                    "--n-best", "2", "--beam-size", "2"])
    rows = (tmp_path / "n.txt").read_text().splitlines()
    assert len(rows) == 2 * 21 and rows[0].split("\t")[0] == "0" and rows[-1].split("\t")[0] == "20"


@pytest.mark.parametrize("flags, message", [
    (["--engine", "ct2", "--mesh", "data=1"], "--engine ct2 cannot honour --mesh"),
    (["--engine", "ct2", "--length-normalization", "gnmt"], "cannot honour --length-normalization gnmt"),
    (["--engine", "ct2", "--no-early-stopping"], "cannot honour --no-early-stopping"),
    (["--engine", "jax", "--quantization", "int8"], "--quantization is for --engine ct2"),
    (["--matmul-dtype", "bfloat16", "--inter-threads", "2"], "--inter-threads is for --engine ct2, and "
                                                             "--matmul-dtype for jax"),
])
def test_flags_one_engine_cannot_honour_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        translate_main(["--workdir", "unused", *flags, "x"])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_auto_says_why_it_picks_jax(run, capsys, monkeypatch):
    translate_main(["--workdir", str(run), "--matmul-dtype", "float32", "--beam-size", "1", "x"])
    assert "engine jax (--matmul-dtype needs it)" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ctranslate2", None)   # as Python has it when the import failed
    translate_main(["--workdir", str(run), "--beam-size", "1", "x"])
    assert "not installed; for CPU serving: pip install -e '.[serve]'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        translate_main(["--workdir", str(run), "--engine", "ct2", "x"])
    assert "--engine ct2 needs the ctranslate2 package, which is not installed" in capsys.readouterr().err


@pytest.mark.parametrize("failure", ["ImportError('libctranslate2.so.4: cannot open shared object file')",
                                     "OSError('libiomp5.so: wrong ELF class')"])
def test_a_broken_ctranslate2_falls_back_to_jax_and_is_reported_as_broken(run, tmp_path, failure):
    """Issue 51, item 2: ctranslate2 present but its import failing (a missing shared library, a
    build for other CPUs): the default command translates with JAX and says why; ``--engine
    ct2`` names the import error, not a missing package."""
    broken = tmp_path / "site" / "ctranslate2"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(f"raise {failure}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *sys.path])}
    command = [sys.executable, "-m", "jaxformer.translate", "--workdir", str(run), "--beam-size", "1"]
    done = subprocess.run([*command, SOURCES[0]], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 1, done.stderr
    assert "engine jax (ctranslate2 is installed but cannot be imported here (" in done.stderr
    assert failure.split("'")[1] in done.stderr and "not installed" not in done.stderr
    done = subprocess.run([*command, "--engine", "ct2", SOURCES[0]], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "ctranslate2 is installed but cannot be imported here" in done.stderr
    assert "--engine jax" in done.stderr


def test_a_read_only_run_caches_its_model_in_the_user_cache(run, tmp_path, capsys, monkeypatch):
    """Issue 51, item 3: a run folder that cannot be written gets its model converted once into the
    user's cache (keyed by the run and its checkpoint's fingerprint), not into a temporary folder
    per call."""
    import shutil

    from jaxformer.serve import ct2_model

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("ct2", "jax_cache"))
    real = ct2_model.probe_writable

    def read_only(folder):   # as a read-only mount answers (chmod does not stop root)
        if Path(folder).is_relative_to(copy):
            raise PermissionError(13, "Permission denied")
        real(folder)

    monkeypatch.setattr(ct2_model, "probe_writable", read_only)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv = ["--workdir", str(copy), "--engine", "ct2", SOURCES[0]]
    translate_main(argv)
    first = capsys.readouterr()
    assert "cannot be written (Permission denied)" in first.err and "converting" in first.err
    translate_main(argv)
    again = capsys.readouterr()
    assert "converting" not in again.err and again.out == first.out
    [model] = (tmp_path / "cache").rglob("model.bin")
    assert model.parent.name.startswith("float32-best-") and not list((tmp_path / "cache").rglob(".*"))


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_a_stopped_conversion_leaves_no_work_folder(run, tmp_path, signum):
    """Issue 51, item 3: a conversion stopped by SIGTERM removes its work folder as it exits; one
    killed outright (SIGKILL) leaves it, and the next conversion removes it."""
    import shutil
    import signal
    import time

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("ct2", "jax_cache"))
    command = [sys.executable, "-m", "jaxformer.translate", "--workdir", str(copy), "--engine", "ct2",
               SOURCES[0]]
    child = subprocess.Popen(command, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    while not list((copy / "ct2").glob(".*")) and child.poll() is None:   # the work folder is made
        time.sleep(0.02)
    child.send_signal(getattr(signal, signum))
    assert child.wait(timeout=120) == -getattr(signal, signum)   # ended by the signal, as without us
    left = [p.name for p in (copy / "ct2").iterdir()]
    assert left == [] if signum == "SIGTERM" else len(left) == 1 and left[0].startswith(".")
    subprocess.run(command, capture_output=True, timeout=300, check=True)
    assert not [p.name for p in (copy / "ct2").iterdir() if p.name.startswith(".")]
