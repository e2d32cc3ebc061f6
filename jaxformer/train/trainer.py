"""The main job: train a translator, evaluate BLEU, checkpoint, resume. :func:`train` reads as
its phases: :func:`setup` (:mod:`jaxformer.train.run_setup`), :func:`train_loop` and
:func:`final_test` (:mod:`jaxformer.train.run_eval`)."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Any

import jax

from jaxformer.model import sharding as sharding_lib
from jaxformer.model.validation import check_token_ids
from jaxformer.run.config import TrainConfig
from jaxformer.run.directory import RunDir, topmost_missing
from jaxformer.run.logs import Progress, RunLog, log
from jaxformer.train.preemption import Preempted, PreemptionGuard, past_deadline
from jaxformer.train.run_eval import evaluate, evaluate_nll, final_test
from jaxformer.train.run_setup import setup
from jaxformer.train.run_state import LoopState, Run, TrainingDiverged
from jaxformer.train.step import add_metrics

__all__ = ["Preempted", "TrainingDiverged", "train", "setup", "train_loop", "evaluate", "final_test"]


def train(cfg: TrainConfig, *, fresh: bool = False, chosen: frozenset[str] | None = None) -> dict[str, Any]:
    """Trains, evaluates and checkpoints one run; a workdir with a checkpoint resumes exactly
    (state and data position are saved, dropout keys are ``fold_in(key, step)``: N steps equal
    N/2 + N/2, bit for bit on CPU). ``chosen``: the settings the user gave (the command's flags
    and ``--config`` keys; ``None``: those off :class:`TrainConfig`'s defaults), which win over
    what a fine-tune inherits. Returns the results (also ``results.json``).

    Raises:
      ValueError / FileNotFoundError / OSError: bad corpus, paths or checkpoints, before any
        compile (a run directory this call made is removed unless its data was prepared).
      CheckpointError: checkpoints exist but none is readable (nothing is changed).
      Preempted: SIGTERM/SIGINT, after checkpointing the current step.
      TrainingDiverged: see :func:`train_loop`.
    """
    run_dir, made = RunDir(cfg.workdir), topmost_missing(Path(cfg.workdir))
    with RunLog(run_dir.log) as run_log:   # train.log: everything printed
        with contextlib.ExitStack() as undo:   # a failed setup removes a folder this call made (no data)
            undo.callback(run_dir.remove_if_made_and_unprepared, made)
            run, loop = setup(cfg, fresh=fresh, chosen=chosen)
            undo.pop_all()
        run_log.open()   # after --fresh moved the previous run's log aside
        with run.closer:   # also on Preempted / TrainingDiverged: pending saves finish, files close
            return final_test(run, train_loop(run, loop))


def train_loop(run: Run, loop: LoopState) -> LoopState:
    """Steps until ``--max-steps``, ``--max-minutes``, a signal, ``--patience`` or
    ``--stop-on-overfit``; logs every ``--log-every`` steps (the one host sync), evaluates every
    ``--eval-every`` steps, the dev NLL alone every ``--nll-every`` steps between, and
    checkpoints every ``--checkpoint-every`` steps and at the end.

    Raises:
      Preempted: after checkpointing the step at which the signal was honoured.
      TrainingDiverged: a whole logging window of non-finite updates (the last checkpoint is
        intact), or skipped updates at the end of a run without any checkpoint.
    """
    cfg, c = run.cfg, run.programs.model.config
    nll_every, stop_on_overfit = cfg.train.nll_interval(), cfg.train.stop_on_overfit
    loop.last_log_time = time.perf_counter()
    deadline = None if cfg.train.max_minutes is None else run.plan.t_start + 60 * cfg.train.max_minutes
    progress = Progress(enabled=cfg.run.progress, step=loop.step, max_steps=cfg.train.max_steps,
                        t_start=run.plan.t_start, deadline=deadline)
    diverged = None
    batches = run.data.iterator.records()   # the data-source protocol (jaxformer.data.sources)
    with PreemptionGuard(multi_process=jax.process_count() > 1) as guard, progress:
        while loop.step < cfg.train.max_steps:
            if guard.stop_requested():
                loop.stopped_by = signal.Signals(guard.received).name
                break
            if deadline is not None and past_deadline(deadline, loop.step, cfg.run.log_every):
                loop.stopped_by = "max_minutes"
                break
            batch = next(batches)
            # Before dispatch: jit would clamp bad ids silently (numpy, no sync).
            for name, vocab in (("src", c.src_vocab_size), ("tgt_in", c.tgt_vocab_size),
                                ("tgt_out", c.tgt_vocab_size)):
                check_token_ids(batch[name], name=name, vocab_size=vocab, max_len=c.max_len)
            loop.state, metrics = run.programs.train_step(
                loop.state, sharding_lib.shard_batch(batch, run.programs.layout.batch), run.dropout_key)
            loop.totals = add_metrics(loop.totals, metrics)
            loop.step += 1
            progress.step(loop.step)
            if loop.step % cfg.run.log_every == 0 and (diverged := _log_window(run, loop, progress)):
                break
            if loop.step % cfg.run.checkpoint_every == 0:
                _save_if_healthy(run, loop)
            if loop.step % cfg.train.eval_every == 0:
                if _evaluate_and_stop_early(run, loop):
                    loop.stopped_by = "early_stopping"
                    log(f"early stopping: no better dev BLEU in {cfg.train.patience} evaluations "
                        f"(best {loop.early_stopping.best:.2f})")
                    break
            elif nll_every and loop.step % nll_every == 0:
                evaluate_nll(run, loop)
            if stop_on_overfit and loop.overfit.rises >= stop_on_overfit:
                loop.stopped_by = "overfitting"
                log(f"stopping: the dev NLL rose in {loop.overfit.rises} evaluations in a row "
                    f"(--stop-on-overfit {stop_on_overfit})")
                break
    refused = (not diverged and run.checkpoints.latest_step() != loop.step
               and not _save_if_healthy(run, loop))
    run.checkpoints.wait()
    if guard.received is not None and not diverged:
        _stop_preempted(run, loop, guard.received)
    if refused and run.checkpoints.latest_step() is None and run.checkpoints.best_step() is None:
        diverged = (f"Training diverged: updates up to step {loop.step} were skipped as non-finite and "
                    f"no checkpoint was written, so there are no parameters to test. {_FIX} (--fresh).")
    if diverged:
        raise TrainingDiverged(diverged)
    return loop


_FIX = "Lower --lr-scale, set --grad-clip or use --dtype float32, then run again"


def _log_window(run: Run, loop: LoopState, progress: Progress) -> str | None:
    """Reads the window's sums back (the one host sync), writes the metrics record and shows
    it; ``train/steps`` counts the steps averaged (fewer in a resumed run's first window).
    Returns the divergence message when every update of the window was skipped."""
    values = jax.device_get(loop.totals)
    skipped, window = int(values["skipped"]), int(values["steps"])
    if skipped == window:
        last = run.checkpoints.latest_step()
        where = ("no checkpoint was written" if last is None
                 else f"the last checkpoint (step {last}) is intact")
        return (f"Training diverged: all {window} updates up to step {loop.step} had a non-finite loss or "
                f"gradient norm and were skipped; {where}. {_FIX} to resume from the last checkpoint "
                f"(or --fresh).")
    if skipped:
        log(f"step {loop.step}: skipped {skipped} of the last {window} updates (non-finite loss or "
            f"gradient norm); parameters were left unchanged for those steps")
    loop.recent_skips = float(skipped)
    tokens = max(float(values["tokens"]), 1.0)
    applied = max(window - skipped, 1)
    now = time.perf_counter()
    record = {"train/loss": float(values["loss_sum"]) / tokens,
              "train/nll": float(values["nll_sum"]) / tokens,
              "train/accuracy": float(values["correct"]) / tokens,
              "train/grad_norm": float(values["grad_norm"]) / applied,
              "train/skipped": float(skipped), "train/steps": window,
              "train/lr": float(run.programs.schedule(loop.step - 1)),
              "train/tokens_per_s": tokens / max(now - loop.last_log_time, 1e-9)}
    run.metrics_log.write(loop.step, record)
    loop.totals, loop.last_log_time = None, now
    progress.window(loop.step, record["train/loss"], record["train/tokens_per_s"], record["train/lr"])
    return None


def _save_if_healthy(run: Run, loop: LoopState) -> bool:
    """Checkpoints unless an update was skipped since the last clean window (a finite but
    ruinous update may precede it, and the rotation would push the last good one out)."""
    if loop.skips_pending() == 0:
        run.checkpoints.save(loop.step, loop.state, run.data.iterator)
        return True
    log(f"step {loop.step}: not checkpointing, updates were skipped as non-finite since the last "
        f"clean logging window; step {run.checkpoints.latest_step()} stays the newest checkpoint")
    return False


def _evaluate_and_stop_early(run: Run, loop: LoopState) -> bool:
    """Evaluates; whether early stopping ends the run. After skipped updates the score counts
    for neither (the parameters may be ruined)."""
    healthy = loop.skips_pending() == 0
    bleu = evaluate(run, loop, keep_best=healthy)
    return healthy and loop.early_stopping.update(bleu)


def _stop_preempted(run: Run, loop: LoopState, signum: int) -> None:
    """Raises :class:`Preempted` with the resume hint (the checkpoint is written)."""
    saved = run.checkpoints.latest_step()
    where = ("with a checkpoint" if saved == loop.step
             else f"(newest checkpoint: {'none' if saved is None else f'step {saved}'})")
    message = (f"{loop.stopped_by} received: stopped at step {loop.step} {where} in "
               f"{run.run_dir.checkpoints}. Run the same command again to resume from there.")
    log(message)
    raise Preempted(signum, loop.step, message)
