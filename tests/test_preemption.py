"""Stopping without losing work (issue #6), the parts that need no trained run: the
signal guard (one Ctrl-C checkpoints, a second stops at once), the multi-process stop
agreed through JAX's preemption sync point, ``jaxformer-train``'s exit statuses, and
its compilation cache folder, and a hand-edited run record. The runs that are stopped and resumed are in
``tests/test_resilience.py``.
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from jax.experimental import multihost_utils
from test_resilience import _argv, _config

from jaxformer.run import directory
from jaxformer.train import preemption, trainer
from jaxformer.train.preemption import PreemptionGuard
from jaxformer.train.trainer import TrainingDiverged


def test_multi_process_stop_comes_when_jax_agrees_and_without_its_service_is_turned_off(monkeypatch):
    """With several processes the guard asks JAX's sync point (ids 0, 1, ... of this
    launch) and stops when it says so; without JAX's preemption service it says so in the
    log, stops asking and keeps training (signals are then not caught)."""
    asked = []
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", lambda i: asked.append(i) or i == 2)
    guard = PreemptionGuard(multi_process=True)
    assert [guard.stop_requested() for _ in range(3)] == [False, False, True]
    assert guard.received == signal.SIGTERM and asked == [0, 1, 2]
    assert guard.stop_requested() and asked == [0, 1, 2], "an agreed stop is not asked again"

    def no_service(i):
        raise RuntimeError("Preemption sync manager has not been initialized.\nmore")

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", no_service)
    logged = []
    monkeypatch.setattr(preemption, "log", logged.append)
    guard = PreemptionGuard(multi_process=True)
    assert not guard.stop_requested() and not guard.stop_requested()
    assert not guard.multi_process and guard.received is None
    assert logged == ["multi-process run without JAX's preemption service (Preemption sync manager has "
                      "not been initialized.); SIGTERM and Ctrl-C will not checkpoint"], logged


@pytest.mark.parametrize("stop,status", [("SIGTERM", 128 + signal.SIGTERM), ("SIGINT", 128 + signal.SIGINT),
                                         ("diverged", 1), ("bad data", 2)])
def test_train_command_exit_status_says_how_the_run_ended(tmp_path, short_corpus, monkeypatch, capsys, stop,
                                                           status):
    """``jaxformer-train``'s documented exit status for each way ``train()`` can end (the
    run itself: the tests above; the same through ``train.py`` children: the slow test)."""
    from jaxformer.cli.train import main as train_main

    def ended(cfg, fresh=False, chosen=None):
        if stop.startswith("SIG"):
            raise trainer.Preempted(signal.Signals[stop], 6, "stopped at step 6 with a checkpoint")
        if stop == "diverged":
            raise TrainingDiverged("non-finite updates; the last checkpoint (step 12) is intact")
        raise ValueError("No usable sentence pair in the dev file")

    cached_in = []
    monkeypatch.setattr(trainer, "train", ended)
    monkeypatch.setattr(directory, "keep_compilation_cache", lambda run_dir: cached_in.append(run_dir.root))
    with pytest.raises(SystemExit) as exit_info:
        train_main(_argv(_config(tmp_path / "run", short_corpus, 12)))
    assert exit_info.value.code == status
    assert cached_in == [Path(tmp_path / "run")], "the command keeps its compiles in RUN/jax_cache"
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if status in (1, 2):
        assert "error:" in err and ("non-finite" in err or "No usable" in err), err


def test_a_training_run_keeps_its_compiles_in_its_folder_unless_a_cache_is_chosen(tmp_path):
    """``keep_compilation_cache``: JAX's persistent cache (which a resumed run reads) goes to
    RUN/jax_cache, made at the first compile (not before, so a run failing its checks writes
    nothing); a cache folder the user chose is left alone. Child processes, since JAX reads
    its cache setting once per process (``tests/test_resilience.py``'s slow test finds the
    train step in RUN/jax_cache after ``train.py``; the exit-status test above, that the
    command asks for it)."""
    child = """
import sys, jax, jax.numpy as jnp
from jaxformer.run.directory import RunDir, keep_compilation_cache
run = RunDir(sys.argv[1])
kept = keep_compilation_cache(run)
made_early = run.jax_cache.exists()
jax.jit(lambda x: x * 2 + 1)(jnp.arange(3.0)).block_until_ready()
print(kept, made_early, len(list(run.jax_cache.glob("jit_*"))))
"""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    run = tmp_path / "run"

    def launch(**extra):
        out = subprocess.run([sys.executable, "-c", child, str(run)], env={**env, **extra},
                             capture_output=True, text=True, timeout=300, check=True)
        return out.stdout.split()

    kept, made_early, programs = launch()
    assert (kept, made_early) == ("True", "False") and int(programs) > 0
    chosen = tmp_path / "chosen"
    shutil.rmtree(run / "jax_cache")
    assert launch(JAX_COMPILATION_CACHE_DIR=str(chosen)) == ["False", "False", "0"]
    assert list(chosen.glob("jit__lambda-*")), "JAX's cache is where the user chose"


def test_signal_guard_sets_a_flag_and_a_second_ctrl_c_stops_at_once():
    child = subprocess.run([sys.executable, "-c", """
import os, signal, time
from jaxformer.train.preemption import PreemptionGuard

previous = signal.getsignal(signal.SIGINT)
with PreemptionGuard() as guard:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)
    assert guard.received == signal.SIGINT       # the loop would finish its step, then save
    print("flag set", flush=True)
assert signal.getsignal(signal.SIGINT) is previous
with PreemptionGuard() as guard:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGINT)          # impatient user: stop now
    time.sleep(5)
print("not reached")
"""], capture_output=True, text=True, timeout=120)
    assert child.returncode == 128 + signal.SIGINT
    assert child.stdout.split() == ["flag", "set"]
    assert child.stderr.strip().endswith("run the same command again to resume from the newest "
                                         "complete checkpoint")
    assert "Traceback" not in child.stderr


@pytest.mark.parametrize("section, value, kind", [("train", None, "object"), ("tokenizer", [1], "object"),
                                                  ("train_history", {}, "array"),
                                                  ("target_language", 7, "string")])
def test_an_edited_run_record_with_a_section_of_the_wrong_type_is_named(tmp_path, section, value, kind):
    """``"train": null`` in config.json (a hand edit) once failed as an AttributeError
    in the resume's ``--init-from`` lookup: every reader of the record names the section."""
    import json

    from jaxformer.run.config import TrainConfig
    from jaxformer.train.plan import plan_run

    run = directory.RunDir(tmp_path)
    run.config.write_text(json.dumps({"model": {"d_model": 8}, "train": {"init_from": "teacher"},
                                      section: value}))
    message = f"its {section!r} section is .*, not a JSON {kind}: .*edited or damaged"
    for read in (run.read_config, run.read_run_record,
                 lambda: plan_run(TrainConfig.flat(workdir=str(tmp_path)))):
        with pytest.raises(ValueError, match=message):
            read()
