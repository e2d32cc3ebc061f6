"""Nothing lost (issue #6): exact resume, preemption, unreadable checkpoints, the
non-finite guard, and bad input caught before any compile.

The runs are tiny (tiny preset with one layer per stack, 12 steps, explicit 12-sentence
dev/test files), share one tokenizer, and compare checkpoints bit for bit.
"""

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.experimental import multihost_utils

from jaxformer.data import batching, streaming
from jaxformer.model.validation import DataPositionError
from jaxformer.run.checkpoints import CheckpointError, RunCheckpoints
from jaxformer.run.config import TrainConfig
from jaxformer.train import run_setup, trainer
from jaxformer.train.preemption import PreemptionGuard
from jaxformer.train.trainer import TrainingDiverged, train

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(short_corpus):
    return short_corpus


def _config(workdir, files, max_steps, **overrides):
    return TrainConfig.flat(**{**dict(
        workdir=str(workdir), train_file=str(files["train"]), dev_file=str(files["dev"]),
        test_file=str(files["test"]), preset="tiny", vocab_size=300, max_len=32, dropout_rate=0.1,
        num_layers=1,   # one layer per stack: what is tested does not depend on depth
        batch_tokens=512, max_steps=max_steps, warmup_steps=10, lr_scale=1.0, eval_every=1000,
        dev_bleu_sentences=12, eval_batch_size=16, beam_size=1, log_every=2, checkpoint_every=4,
        progress=False, devices=1), **overrides})


def _state_at(workdir, step):
    """The raw saved train state (step, params, opt_state) as NumPy arrays."""
    return ocp.StandardCheckpointer().restore(Path(workdir).absolute() / "checkpoints" / str(step) / "state")


def _new_workdir(tmp_path, reference):
    """A run directory that starts with the reference run's tokenizer (same vocabulary)."""
    workdir = tmp_path / "run"
    shutil.copytree(reference / "tokenizer", workdir / "tokenizer")
    return workdir


def _snapshot(workdir):
    return {str(p.relative_to(workdir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(workdir).rglob("*")) if p.is_file()}


def _train_log_steps(workdir):
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "train/loss" in r]


def _corrupt_step(workdir, step):
    """A torn write: every data file of the step cut to 100 bytes.

    Not just one file: OCDBT leaves superseded files in ``d/`` that the manifest no
    longer references, so cutting one file does not make a step unreadable for sure.
    (Cutting only the largest left a step readable once in CI; not reproduced here.)
    """
    files = [p for p in (Path(workdir) / "checkpoints" / str(step) / "state").rglob("*")
             if p.is_file() and p.parent.name == "d"]
    assert files, f"no data files in step {step}"
    for path in files:
        path.write_bytes(path.read_bytes()[:100])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, files):
    """12 uninterrupted steps with dropout on; checkpoints at 4, 8, 12."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    result = train(_config(workdir, files, 12))
    assert result["final_step"] == 12
    return workdir


_CHILD = """
import dataclasses, os, runpy, signal, sys
from jaxformer.train import run_setup
real = run_setup.run_programs
def run_programs(*args, **kwargs):
    programs, calls = real(*args, **kwargs), [0]
    def stepped(*a, **k):
        calls[0] += 1
        if calls[0] == int(os.environ["SIGNAL_AT_STEP"]):
            os.kill(os.getpid(), signal.SIGTERM)   # as a preempting scheduler would
        return programs.train_step(*a, **k)
    return dataclasses.replace(programs, train_step=stepped)
run_setup.run_programs = run_programs
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path(os.path.join(os.environ["REPO"], "train.py"), run_name="__main__")
"""


def _argv(cfg):
    out = []
    for key, value in cfg.to_dict().items():
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            out += [flag, str(value)]
    return out


def test_sigterm_checkpoints_and_the_resumed_run_equals_an_uninterrupted_one(
        tmp_path, files, reference, monkeypatch, caplog):
    """SIGTERM before step 6, as a preempting scheduler sends it: ``train()`` finishes the
    step, checkpoints it (not a --checkpoint-every step) and raises ``Preempted``;
    ``train()`` again continues from the batch step 6 took and ends bit for bit where the
    uninterrupted run did, every step logged once. The slow test below does the same
    through ``train.py`` in child processes (exit status, grain workers, RUN/jax_cache)."""
    import threading

    assert threading.current_thread() is threading.main_thread(), "the guard's handler needs it"
    workdir = _new_workdir(tmp_path, reference)
    real = run_setup.run_programs

    def run_programs(*args, **kwargs):
        programs, calls = real(*args, **kwargs), [0]

        def stepped(*a, **k):
            calls[0] += 1
            if calls[0] == 6:
                os.kill(os.getpid(), signal.SIGTERM)
            return programs.train_step(*a, **k)
        return dataclasses.replace(programs, train_step=stepped)

    monkeypatch.setattr(run_setup, "run_programs", run_programs)
    with pytest.raises(trainer.Preempted) as stop:
        train(_config(workdir, files, 12))
    assert (stop.value.step, stop.value.signum) == (6, signal.SIGTERM)
    assert "Run the same command again to resume" in str(stop.value)
    assert RunCheckpoints(workdir, read_only=True).latest_step() == 6
    monkeypatch.setattr(run_setup, "run_programs", real)
    # The resume asks the stop question as a multi-process run would, through a stand-in
    # for JAX's preemption sync point: once per step, with ids counted from 0 in this
    # launch, not from the restored step (a notice JAX gets during a resumed run's
    # start-up is set to id 1; with ids 6, 7, ... it would never be met).
    asked = []
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", lambda i: asked.append(i) or False)
    monkeypatch.setattr(trainer, "PreemptionGuard", lambda multi_process: PreemptionGuard(multi_process=True))
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        assert train(_config(workdir, files, 12))["final_step"] == 12
    assert asked == [0, 1, 2, 3, 4, 5], asked
    # The programs are the run's own: the resume traced its train step once (never again
    # per step) and never the init (it restored into the abstract state).
    traced = [name for r in caplog.records if r.getMessage().startswith("Finished tracing")
              for name in ("init_train_state", "train_step") if f" {name} " in r.getMessage()]
    assert traced == ["train_step"], traced
    chex.assert_trees_all_equal(_state_at(workdir, 12), _state_at(reference, 12))
    assert _train_log_steps(workdir) == [2, 4, 6, 8, 10, 12], "every step is logged once"


@pytest.mark.slow
def test_sigterm_checkpoints_exits_and_the_resumed_run_equals_an_uninterrupted_one(
        tmp_path, files, reference):
    """``train.py`` in a child that collates in 2 grain worker processes gets SIGTERM at
    step 6; ``train.py`` again (--data-workers 0 on CPU) continues from the batch the
    child's step 6 took. Both keep JAX's persistent cache in RUN/jax_cache (train.py does,
    not the library), and the resume compiles no train step the first run had not."""
    workdir = _new_workdir(tmp_path, reference)
    cfg = _config(workdir, files, 12)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(SIGNAL_AT_STEP="6", REPO=str(REPO))
    child = subprocess.run([sys.executable, "-c", _CHILD, *_argv(cfg), "--data-workers", "2"],
                           capture_output=True, text=True, env=env, timeout=600)
    assert child.returncode == 128 + signal.SIGTERM, child.stderr[-2000:]
    assert "SIGTERM received: stopped at step 6" in child.stdout + child.stderr
    assert "Run the same command again to resume" in child.stdout + child.stderr
    assert RunCheckpoints(workdir, read_only=True).latest_step() == 6   # not a checkpoint_every step

    def train_steps():
        return sorted(p.name for p in (workdir / "jax_cache").glob("jit_train_step-*"))

    compiled = train_steps()
    assert compiled, "train.py keeps the compiled train step in RUN/jax_cache"
    env["SIGNAL_AT_STEP"] = "0"   # never
    child = subprocess.run([sys.executable, "-c", _CHILD, *_argv(cfg)], capture_output=True, text=True,
                           env=env, timeout=600)
    assert child.returncode == 0, child.stderr[-2000:]
    assert train_steps() == compiled, "the resume compiled a train step the first run had not"
    chex.assert_trees_all_equal(_state_at(workdir, 12), _state_at(reference, 12))
    assert _train_log_steps(workdir) == [2, 4, 6, 8, 10, 12], "every step is logged once"


def test_a_finished_run_started_again_is_not_evaluated_twice(tmp_path, files, reference, monkeypatch):
    """The reference run ended at step 12, off the --eval-every grid, with a final dev
    evaluation there; the same command again tests again but records no second one. The
    resume restores into the abstract state: it never computes an initial one."""
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    real, inits = run_setup.run_programs, []

    def run_programs(*args, **kwargs):
        programs = real(*args, **kwargs)
        return dataclasses.replace(programs, init=lambda key: inits.append(key) or programs.init(key))
    monkeypatch.setattr(run_setup, "run_programs", run_programs)
    assert train(_config(workdir, files, 12))["final_step"] == 12
    assert inits == [], "a resumed run computed an initial train state"
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "dev/bleu" in r] == [12]


def test_the_first_window_after_a_resume_between_logged_steps_says_how_many_steps_it_averages(
        tmp_path, files, reference):
    """Resumed at step 8 with --log-every 3, the first record (step 9) averages one step,
    not three, and says so (``train/steps``); the next averages three. The state at step 12
    is the reference's: the logging rhythm changes nothing of the training. The run's
    prepared/ is deleted first: the data fingerprint in config.json refuses other data
    (the train and dev files swapped) and prepares the same data again for the resume."""
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    shutil.rmtree(workdir / "checkpoints" / "12")
    shutil.rmtree(workdir / "prepared")
    with pytest.raises(ValueError, match=r"trained on other data \(corpus: .*--fresh"):
        train(_config(workdir, {**files, "train": files["dev"], "dev": files["train"]}, 12))
    assert not (workdir / "prepared").exists()
    train(_config(workdir, files, 12, log_every=3))
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    windows = [(r["step"], r["train/steps"]) for r in rows if "train/loss" in r]
    assert windows == [(2, 2), (4, 2), (6, 2), (8, 2), (9, 1), (12, 3)]
    chex.assert_trees_all_equal(_state_at(workdir, 12), _state_at(reference, 12))


def test_resuming_with_another_batch_plan_is_refused_and_the_same_plan_resumes(tmp_path, files, reference):
    """Rows per batch decide the plan the saved data position counts through: 16 rows
    (512 tokens / 32) with --grad-accum-steps 3 become 15, which is refused before
    anything compiles, as is --no-pack (length buckets: other batches altogether), each
    naming the flag to resume with; --grad-accum-steps 2 keeps 16 rows, the same batches,
    and resumes."""
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    assert json.loads((workdir / "config.json").read_text())["batch_rows"] == {"32": 16}
    with pytest.raises(ValueError, match=r"batches of \{'32': 16\} rows.*give \{'32': 15\}.*"
                                         r"--devices 1 --grad-accum-steps 1; no --mesh"):
        train(_config(workdir, files, 14, grad_accum_steps=3))
    with pytest.raises(ValueError, match=r"made with --pack; these settings make other batches.*"
                                         r"Resume with --pack"):
        train(_config(workdir, files, 14, pack=False))   # length buckets instead of packed rows
    with pytest.raises(ValueError, match=r"data order of --seed 0; --seed 5 would.*Resume with --seed 0"):
        train(_config(workdir, files, 14, seed=5))
    assert train(_config(workdir, files, 14, grad_accum_steps=2))["final_step"] == 14


def test_a_setup_that_fails_after_opening_checkpoints_exits_without_a_traceback(tmp_path, files):
    """A run whose data check fails once the checkpoints are open (a missing dev file)
    closes them: no orbax cleanup traceback at interpreter exit."""
    cfg = _config(tmp_path / "run", files, 4)
    code = (f"from jaxformer.run.config import TrainConfig\nfrom jaxformer.train.trainer import train\n"
            "try:\n    train(TrainConfig.flat(**"
            f"{dict(cfg.to_dict(), dev_file=str(tmp_path / 'nope.tsv'))!r}))\n"
            f"except FileNotFoundError as e:\n    print('refused:', e)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert child.returncode == 0 and "refused:" in child.stdout, child.stderr[-2000:]
    assert "Traceback" not in child.stderr, child.stderr[-3000:]


def test_unreadable_latest_checkpoint_is_reported_and_the_previous_one_used(
        tmp_path, files, reference, capsys):
    workdir = _new_workdir(tmp_path, reference)
    train(_config(workdir, files, 8))
    _corrupt_step(workdir, 8)
    capsys.readouterr()
    result = train(_config(workdir, files, 12))
    out = capsys.readouterr().out
    assert "checkpoint step 8 is unreadable" in out and "at step 4" in out
    assert [p.name.split("-")[0] for p in (workdir / "corrupt").iterdir()] == ["8"]   # kept, not deleted
    assert result["final_step"] == 12
    chex.assert_trees_all_equal(_state_at(workdir, 12), _state_at(reference, 12))
    # Metrics of the redone steps 5-8 moved aside; the log never repeats a step.
    assert _train_log_steps(workdir) == [2, 4, 6, 8, 10, 12]
    redone = [json.loads(line)["step"]
              for line in (workdir / "metrics.redone.jsonl").read_text().splitlines()]
    assert set(redone) >= {6, 8}

    # No readable checkpoint at all: a clear error, and not one file changes.
    for step in RunCheckpoints(workdir, read_only=True).latest.all_steps():
        _corrupt_step(workdir, step)
    before = _snapshot(workdir)
    with pytest.raises(CheckpointError, match="No readable checkpoint.*--fresh"):
        train(_config(workdir, files, 16))
    assert _snapshot(workdir) == before


def test_a_checkpoint_from_before_streamed_data_is_refused_with_the_fix(tmp_path, files, reference):
    """A data position of another format (the in-memory pipeline's, before prepared data)
    cannot be continued exactly: the error says why and gives --fresh; nothing changes."""
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    saved = list(workdir.glob("checkpoints/*/data/process_0-of-1.json"))
    assert len(saved) == 3
    for path in saved:
        path.write_text(json.dumps({"next_index": 96}))
    before = _snapshot(workdir)
    with pytest.raises(DataPositionError, match="older jaxformer.*--fresh"):
        train(_config(workdir, files, 16))
    assert _snapshot(workdir) == before
    oldest = min(saved, key=lambda path: int(path.parts[-3]))   # the newest of another format, an older one
    oldest.write_text(json.dumps({"epoch": 0, "block": 0, "batch": int(oldest.parts[-3])}))   # readable:
    before = _snapshot(workdir)
    with pytest.raises(DataPositionError, match="older jaxformer.*--fresh"):   # refused, not set aside
        train(_config(workdir, files, 16))
    assert _snapshot(workdir) == before


def test_a_run_saved_by_two_processes_continues_exactly_on_one(tmp_path, files, reference, capsys):
    """Each process saves its own data position (``process_<i>-of-<n>.json``), and they are
    all the same global position. A run saved by two processes resumes on one from it,
    says so, and trains exactly what the one-process run trains from the same step
    (``tests/test_multiprocess.py`` resumes a real two-process checkpoint on one).
    Positions that disagree, or a missing process's file, are refused with the fix, and
    nothing changes."""
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(reference, one)
    shutil.copytree(reference, two)
    for data in two.glob("checkpoints/*/data"):   # as two processes leave them
        (data / "process_0-of-1.json").rename(data / "process_0-of-2.json")
        shutil.copy(data / "process_0-of-2.json", data / "process_1-of-2.json")
    second = two / "checkpoints" / "12" / "data" / "process_1-of-2.json"
    position = json.loads(second.read_text())
    stray = second.with_name("process_0-of-1.json")   # a file of this run's count: grain would read it
    resume = r".*Resume it with 2 process\(es\)"
    for change, message in ((dict(position, batch=position["batch"] + 1),
                             r"saved different data positions" + resume),
                            (None, r"only those of processes \[0\] are there" + resume),
                            ("stray", r"saved by \[1, 2\] processes, which one run never writes")):
        if change == "stray":
            second.write_text(json.dumps(position))
            stray.write_text(json.dumps(dict(position, batch=position["batch"] + 7)))
        elif change is None:
            second.unlink()
        else:
            second.write_text(json.dumps(change))
        before = _snapshot(two)
        with pytest.raises(DataPositionError, match=r"step 12 .*" + message + r".*Nothing was changed"):
            train(_config(two, files, 16))
        assert _snapshot(two) == before and not (two / "corrupt").exists()
    stray.unlink()
    second.write_text(json.dumps(position))
    config = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "batch_rows"}))
    with pytest.raises(DataPositionError, match=r"does not record the rows of its batches.*Resume it with "
                                                r"2 process\(es\)"):   # a run from before the record
        train(_config(two, files, 16))
    (two / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert train(_config(two, files, 16))["final_step"] == 16
    assert "its data position, saved by 2 process(es), continues on 1" in capsys.readouterr().out
    assert train(_config(one, files, 16))["final_step"] == 16
    chex.assert_trees_all_equal(_state_at(two, 16), _state_at(one, 16))
    assert (two / "checkpoints" / "16" / "data" / "process_0-of-1.json").is_file()


def test_a_data_axis_that_does_not_divide_the_eval_batch_evaluates(tmp_path, files, capsys):
    """--devices 3: training rounds its rows to 15; the dev loss pads its batches of 16 to 18
    rows (a multiple of the data axis) instead of failing at the first evaluation. (Its 10
    warm-up steps outlast its 2 steps: said, not refused.)"""
    result = train(_config(tmp_path / "run", files, 2, devices=3, eval_every=2, checkpoint_every=2))
    assert result["final_step"] == 2 and "test_bleu" in result
    assert "note: --warmup-steps 10 >= --max-steps 2: the learning rate rises" in capsys.readouterr().out


def test_diverging_run_stops_with_a_clear_error_and_keeps_the_last_checkpoint(
        tmp_path, files, reference, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    checkpoint_12 = {k: v for k, v in _snapshot(workdir).items() if k.startswith("checkpoints/12/")}
    # Resume with an absurd learning rate: update 13 is finite but blows the weights up,
    # then every loss is NaN and each update is skipped. The window 13-16 (3 of 4 skipped)
    # must not checkpoint those ruined weights; the window 17-20 (all skipped) stops.
    with pytest.raises(TrainingDiverged, match="non-finite.*last checkpoint \\(step 12\\) is intact"):
        train(_config(workdir, files, 40, lr_scale=1e30, log_every=4))
    out = capsys.readouterr().out
    assert "changed run settings:" in out and "lr_scale 1.0 → 1e+30" in out
    assert "step 16: not checkpointing" in out
    assert RunCheckpoints(workdir, read_only=True).latest_step() == 12
    assert {k: v for k, v in _snapshot(workdir).items() if k.startswith("checkpoints/12/")} == checkpoint_12
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)


def test_a_run_ruined_before_its_first_log_keeps_no_best_and_fails(tmp_path, files, reference, capsys):
    """Update 1 is finite but ruinous (lr 1e30), 2 and 3 are skipped: the evaluation at step
    3 must not keep those weights as the best, and with no checkpoint to test the run fails
    instead of reporting a test score of ruined weights."""
    workdir = _new_workdir(tmp_path, reference)
    with pytest.raises(TrainingDiverged, match="skipped as non-finite and no checkpoint was written"):
        train(_config(workdir, files, 3, lr_scale=1e30, warmup_steps=1, eval_every=3, log_every=100))
    assert "step 3: not keeping these parameters as the best" in capsys.readouterr().out
    checkpoints = RunCheckpoints(workdir, read_only=True)
    assert checkpoints.latest_step() is None and checkpoints.best_step() is None
    assert not (workdir / "results.json").exists()
    with pytest.raises(ValueError, match="--lr-scale must be a positive finite number, got inf"):
        _config(workdir, files, 3, lr_scale=math.inf)


def test_the_final_evaluation_after_skipped_updates_keeps_no_best(tmp_path, files, reference, capsys):
    """Step 1 is checkpointed, then updates are ruined and skipped: the last evaluation
    (after the loop) must not keep step 4 as the best; the test uses step 1's checkpoint."""
    workdir = _new_workdir(tmp_path, reference)
    result = train(_config(workdir, files, 4, lr_scale=1e30, warmup_steps=1, checkpoint_every=1,
                           log_every=100, eval_every=1000))
    assert "step 4: not keeping these parameters as the best" in capsys.readouterr().out
    assert RunCheckpoints(workdir, read_only=True).best_step() is None
    assert (result["checkpoint"], result["best_step"]) == ("latest", 1)


def test_half_written_step_is_ignored_and_cleaned_up(tmp_path):
    """What SIGKILL during an async save leaves: orbax's temporary folder, never a step."""
    checkpoints = RunCheckpoints(tmp_path)
    iterator = streaming.BatchStream(lambda start: streaming.stream_dataset(
        batching.Examples([[5, 6]] * 4, [[7]] * 4), max_len=4, batch_tokens=8, boundaries=(4,), seed=0,
        pad_id=0, bos_id=2, eos_id=3, pack=False, start=start))
    state = {"w": jnp.arange(4.0)}
    for step in (1, 2):
        next(iterator)
        checkpoints.save(step, {"w": state["w"] + step}, iterator)
    checkpoints.wait()
    checkpoints.close()
    shutil.copytree(tmp_path / "checkpoints" / "2", tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-17")
    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-17" / "state" / "_METADATA").unlink()

    reopened = RunCheckpoints(tmp_path)
    assert reopened.latest_step() == 2
    restored, step = reopened.restore_latest({"w": jnp.zeros(4)}, iterator)
    assert step == 2 and np.array_equal(restored["w"], np.arange(4.0) + 2)
    reopened.wait()
    reopened.close()
    assert not list((tmp_path / "checkpoints").glob("*tmp*"))


def test_checkpoints_and_tokenizer_are_data_not_pickle(reference):
    # A pickle starts with the PROTO opcode 0x80 and a protocol number 2-5.
    pickled = [str(p) for p in reference.rglob("*")
               if p.is_file() and p.read_bytes()[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")]
    assert not pickled
    sources = "".join(p.read_text() for p in (REPO / "jaxformer").rglob("*.py"))
    assert not re.search(r"import (c?pickle|dill|cloudpickle)|pickle\.loads?\(|allow_pickle=True", sources)


@pytest.mark.parametrize("problem", ["missing train file", "workdir is a file", "empty dev file",
                                     "corrupt tokenizer", "malformed test file", "zero accumulation",
                                     "negative budget", "batch below one row", "more devices than there are",
                                     "fsdp that does not divide d_model"])
def test_bad_paths_and_files_fail_before_any_compile(tmp_path, files, monkeypatch, capsys, problem):
    import runpy

    def no_compile(*args, **kwargs):
        raise AssertionError("built the model's programs before reporting the problem")

    monkeypatch.setattr(run_setup, "run_programs", no_compile)
    cfg = _config(tmp_path / "run", files, 4)
    if problem == "missing train file":
        cfg = TrainConfig.flat(**{**cfg.to_dict(), "train_file": str(tmp_path / "nope.tsv")})
        expected = "does not exist"
    elif problem == "workdir is a file":
        (tmp_path / "file").write_text("x")
        cfg = TrainConfig.flat(**{**cfg.to_dict(), "workdir": str(tmp_path / "file")})
        expected = "is a file, not a folder: choose another --workdir"
    elif problem == "empty dev file":
        (tmp_path / "dev.tsv").write_text("")
        cfg = TrainConfig.flat(**{**cfg.to_dict(), "dev_file": str(tmp_path / "dev.tsv")})
        expected = "No usable sentence pair"
    elif problem == "corrupt tokenizer":
        (tmp_path / "run" / "tokenizer").mkdir(parents=True)
        (tmp_path / "run" / "tokenizer" / "spm.model").write_bytes(b"not a model")
        expected = "spm.model' is unreadable"
    elif problem == "malformed test file":
        (tmp_path / "test.tsv").write_bytes(b"no tab\n\xff\xfe\tbroken\n")
        cfg = TrainConfig.flat(**{**cfg.to_dict(), "test_file": str(tmp_path / "test.tsv")})
        expected = "No usable sentence pair.*1 invalid UTF-8, 1 no tab"
    extra = {"zero accumulation": (["--grad-accum-steps", "0"], "--grad-accum-steps must be at least 1"),
             "negative budget": (["--max-minutes", "-1"], "--max-minutes must be a positive finite number"),
             "batch below one row": (["--batch-tokens", "10"], "--batch-tokens 10 gives 0 row"),
             "more devices than there are": (["--devices", "9"], "--devices 9: this process has 8 cpu"),
             "fsdp that does not divide d_model": (
                 ["--devices", "8", "--mesh", "fsdp=8", "--d-model", "36"],
                 "d_model 36 is not a multiple of the mesh's fsdp axis"),
             }.get(problem, ([], None))
    expected = extra[1] or expected
    monkeypatch.setattr(sys, "argv", ["train.py", *_argv(cfg), *extra[0]])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(expected, err), err
    if problem == "fsdp that does not divide d_model":   # refused before the run directory is made
        assert not (tmp_path / "run").exists()


def test_translator_falls_back_to_the_latest_checkpoint_when_best_is_unreadable(
        tmp_path, reference, capsys):
    from jaxformer.decode.translator import Translator

    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    assert Translator(workdir).kind == "best"
    for path in (workdir / "best").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"")
    translator = Translator(workdir)
    assert (translator.kind, translator.step) == ("latest", 12)
    assert "best checkpoint step 12 is unreadable" in capsys.readouterr().err
