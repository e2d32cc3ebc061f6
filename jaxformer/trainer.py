"""The main job: train a translator, evaluate BLEU, checkpoint, resume.

:func:`train` reads as its three phases: :func:`setup` (mesh, run directory, data,
tokenizer, model, restored state), :func:`train_loop` (steps, logging, evaluation,
checkpoints, preemption) and :func:`final_test`. ``train.py`` is a thin entry point;
everything here is importable and tested.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from collections.abc import Iterator
from typing import Any

import grain
import jax
import optax

from jaxformer import pretrained
from jaxformer import sharding as sharding_lib
from jaxformer.batching import Examples, bucket_boundaries, tokenize_pairs, train_dataset
from jaxformer.checkpoints import RunCheckpoints
from jaxformer.config import TransformerConfig
from jaxformer.corpus import DataReport, Pair, load_splits
from jaxformer.evaluation import Evaluator
from jaxformer.logs import is_main_process, log
from jaxformer.model import Transformer
from jaxformer.preemption import Preempted, PreemptionGuard, past_deadline
from jaxformer.run_config import TrainConfig, save_json
from jaxformer.rundir import (
    MetricsLog,
    RunDir,
    check_resume_compatible,
    resume_record,
    set_aside_metrics_after,
    write_plots,
)
from jaxformer.tokenizer import Tokenizer
from jaxformer.training import (
    TrainState,
    add_metrics,
    create_sharded_train_state,
    jit_train_step,
    make_optimizer,
    transformer_schedule,
)
from jaxformer.validation import check_token_ids

__all__ = ["Preempted", "TrainingDiverged", "train", "setup", "train_loop", "final_test"]


class TrainingDiverged(RuntimeError):
    """Every update of a logging window had a non-finite loss or gradient norm."""


@dataclasses.dataclass
class TrainData:
    """The data of a run: splits (text), the training pipeline and the dev examples."""

    splits: dict[str, list[Pair]]
    target_language: str
    iterator: Iterator[dict[str, Any]]   # a grain iterator: get_state / set_state
    dev_examples: Examples


@dataclasses.dataclass
class Run:
    """Everything :func:`setup` builds and the later phases use."""

    cfg: TrainConfig
    run_dir: RunDir
    data: TrainData
    tokenizer: Tokenizer
    model: Transformer
    schedule: optax.Schedule
    state: TrainState
    layout: sharding_lib.Layout
    checkpoints: RunCheckpoints
    evaluator: Evaluator
    metrics_log: MetricsLog
    dropout_key: jax.Array
    num_params: int
    best_bleu: float   # -1 before the first evaluation
    t_start: float
    closed: bool = False

    def close(self) -> None:
        """Waits for pending checkpoint saves and closes the writers (idempotent)."""
        if not self.closed:
            self.closed = True
            self.checkpoints.wait()
            self.checkpoints.close()
            self.metrics_log.close()


@dataclasses.dataclass
class LoopState:
    """The host loop's state between steps."""

    step: int
    totals: dict[str, Any] | None = None   # device sums since the last logged step
    last_log_time: float = 0.0
    recent_skips: float = 0.0   # updates skipped as non-finite in the last logged window
    stopped_by: str = "max_steps"


def train(cfg: TrainConfig, *, fresh: bool = False) -> dict[str, Any]:
    """Trains, evaluates and checkpoints one run; resumes if the workdir has a checkpoint.

    Resume is exact: the checkpoint holds the step, parameters, optimizer state and
    the data iterator's position, and dropout keys are ``fold_in(seed key, step)``,
    so N steps in one go equal N/2 + N/2 across a restart, bit for bit on CPU.

    Returns:
      the final results (also written to ``workdir/results.json``).

    Raises:
      ValueError / FileNotFoundError / OSError: bad corpus, bad paths, or an
        incompatible checkpoint; all before any compile.
      CheckpointError: checkpoints exist but none is readable (nothing is changed).
      Preempted: SIGTERM/SIGINT; the current step was checkpointed first.
      TrainingDiverged: a whole logging window of non-finite updates (all skipped);
        the last checkpoint is intact.
    """
    run = setup(cfg, fresh=fresh)
    try:
        return final_test(run, train_loop(run))
    finally:   # also on Preempted / TrainingDiverged: pending saves finish, files are closed
        run.close()


# ---------------------------------------------------------------------- setup
def setup(cfg: TrainConfig, *, fresh: bool = False) -> Run:
    """Mesh, run directory, data, tokenizer, model and train state (restored if a
    checkpoint exists); writes ``config.json``. Nothing compiles before the data and
    the checkpoint compatibility are checked."""
    t_start = time.perf_counter()
    sharding_lib.initialize_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id,
                                        auto=cfg.distributed)
    mesh = sharding_lib.make_mesh(cfg.mesh)   # a bad --mesh fails here, before any data work
    run_dir = RunDir(cfg.workdir)
    run_dir.create(fresh)
    if jax.process_count() > 1:   # every process sees the directory after --fresh moved things
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("workdir")
    splits, target_language = load_splits(cfg)
    cfg = pretrained.with_saved_init_from(cfg, run_dir)
    tokenizer, model_config, pretrained_record = pretrained.tokenizer_and_model_config(cfg, run_dir, splits)
    checkpoints = RunCheckpoints(run_dir.root, keep=cfg.keep_checkpoints)
    saved = run_dir.read_config()
    if checkpoints.latest_step() is not None and saved is not None:
        check_resume_compatible(saved, model_config)
    row_multiple = math.lcm(mesh.shape["data"] * cfg.grad_accum_steps, jax.process_count())
    data = build_train_data(cfg, splits, target_language, tokenizer, model_config, row_multiple)

    model = Transformer(model_config)
    schedule = transformer_schedule(model_config.d_model, cfg.warmup_steps, cfg.lr_scale)
    init_key, dropout_key = jax.random.split(jax.random.key(cfg.seed))
    state, layout = create_sharded_train_state(model, init_key, make_optimizer(schedule, cfg.grad_clip),
                                               mesh)
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    log(f"model: {num_params / 1e6:.2f}M parameters, preset {cfg.preset!r}")
    # Restore before writing anything: if no checkpoint is readable, the run dir is untouched.
    restored = checkpoints.restore_latest(sharding_lib.abstract_state(state), data.iterator, report=log)
    if restored is not None:
        state, start_step = restored
        log(f"resumed from {run_dir.checkpoints} at step {int(state.step)}")
    elif pretrained_record is not None:   # fine-tuning: that run's weights, a fresh optimizer and step
        state = state.replace(params=pretrained.load_params(
            cfg.init_from, sharding_lib.abstract_state(state).params))
        log(f"initialised from {cfg.init_from}")
    _write_run_record(run_dir, cfg, model_config, tokenizer, target_language, saved,
                      resumed=restored is not None,
                      tokenizer_record=pretrained_record["tokenizer"] if pretrained_record else None)
    if restored is not None and is_main_process():
        set_aside_metrics_after(run_dir, start_step)
    evaluator = Evaluator(model, tokenizer, batch_size=cfg.eval_batch_size,
                          target_language=target_language, smoothing=cfg.label_smoothing, layout=layout)
    best_bleu = checkpoints.best_bleu()   # on resume, the score recorded with the best checkpoint
    return Run(cfg=cfg, run_dir=run_dir, data=data, tokenizer=tokenizer, model=model, schedule=schedule,
               state=state, layout=layout, checkpoints=checkpoints, evaluator=evaluator,
               metrics_log=MetricsLog(run_dir), dropout_key=dropout_key, num_params=num_params,
               best_bleu=-1.0 if best_bleu is None else best_bleu, t_start=t_start)


def build_train_data(cfg: TrainConfig, splits: dict[str, list[Pair]], target_language: str,
                     tokenizer: Tokenizer, model_config: TransformerConfig, row_multiple: int) -> TrainData:
    """Tokenizes the splits and builds the endless training pipeline (this process's rows).

    Raises:
      ValueError: no pair fits, or ``--batch-tokens`` is too small for one row per data shard.
    """
    report = DataReport(read=len(splits["train"]))
    max_train_len = min(cfg.max_train_len or model_config.max_len, model_config.max_len)
    train_examples = tokenize_pairs(splits["train"], tokenizer, max_train_len, report)
    log(report.summary("train tokens"))
    dev_examples = tokenize_pairs(splits["dev"], tokenizer, model_config.max_len)
    _check_batch_rows(cfg.batch_tokens, max_train_len, row_multiple)
    dataset: grain.IterDataset = train_dataset(
        train_examples, batch_tokens=cfg.batch_tokens, boundaries=bucket_boundaries(max_train_len),
        seed=cfg.seed, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
        row_multiple=row_multiple, process_index=jax.process_index(),
        process_count=jax.process_count(), pack=cfg.pack)
    return TrainData(splits=splits, target_language=target_language, iterator=iter(dataset),
                     dev_examples=dev_examples)


def _check_batch_rows(batch_tokens: int, row_length: int, row_multiple: int) -> None:
    """Rows of a full-length batch: ``batch_tokens // row_length``, rounded down to a multiple
    of ``row_multiple`` (data axis × grad-accumulation steps × processes). Too small a budget is
    an error; a rounded one is reported, so the batch is never silently another size."""
    rows = batch_tokens // row_length
    if rows < row_multiple:
        raise ValueError(f"--batch-tokens {batch_tokens} gives {rows} row(s) of {row_length} tokens, but "
                         f"a batch needs a multiple of {row_multiple} rows (data axis × "
                         f"--grad-accum-steps × processes); use --batch-tokens "
                         f"{row_length * row_multiple} or more.")
    if rows % row_multiple:
        log(f"note: a batch of {row_length}-token rows has {rows // row_multiple * row_multiple} rows, "
            f"not {rows}: rounded down to a multiple of {row_multiple} (data axis × "
            f"--grad-accum-steps × processes)")


def _write_run_record(run_dir: RunDir, cfg: TrainConfig, model_config: TransformerConfig,
                      tokenizer: Tokenizer, target_language: str, saved: dict[str, Any] | None,
                      resumed: bool, tokenizer_record: dict[str, Any] | None = None) -> None:
    """``config.json``: the architecture, the run settings (with their history on resume)
    and the tokenizer's special ids (``tokenizer_record``: an --init-from run's, kept
    as is); what :class:`jaxformer.translate.Translator` reads."""
    record = {"model": model_config.to_dict(), "train": cfg.to_dict(),
              "tokenizer": tokenizer_record or {
                  "file": str(run_dir.tokenizer_dir.relative_to(run_dir.root) / "spm.model"),
                  "pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id,
                  "eos_id": tokenizer.eos_id, "unk_id": tokenizer.unk_id,
                  "vocab_size": tokenizer.vocab_size},
              "target_language": target_language}
    if is_main_process():
        save_json(run_dir.config, resume_record(saved, record, resumed))
    log("model config: " + json.dumps(record["model"]))
    log("run config: " + json.dumps({k: v for k, v in cfg.to_dict().items() if v is not None}))


# ---------------------------------------------------------------------- the loop
def train_loop(run: Run) -> LoopState:
    """Steps until ``--max-steps``, ``--max-minutes`` or a signal; logs every ``--log-every``
    steps (the one host sync), evaluates every ``--eval-every`` and checkpoints every
    ``--checkpoint-every`` steps and at the end.

    Raises:
      Preempted: after checkpointing the step at which the signal was honoured.
      TrainingDiverged: a whole logging window of non-finite updates.
    """
    from tqdm import tqdm

    cfg, c = run.cfg, run.model.config
    loop = LoopState(step=int(run.state.step), last_log_time=time.perf_counter())
    deadline = None if cfg.max_minutes is None else run.t_start + 60 * cfg.max_minutes
    train_step = jit_train_step(run.model, cfg.label_smoothing, layout=run.layout,
                                grad_accum_steps=cfg.grad_accum_steps)
    bar = tqdm(total=cfg.max_steps, initial=loop.step, disable=not cfg.progress, dynamic_ncols=True,
               desc="train", unit="step")
    with PreemptionGuard(multi_process=jax.process_count() > 1) as guard, bar:
        while loop.step < cfg.max_steps:
            if guard.stop_requested():
                loop.stopped_by = signal.Signals(guard.received).name
                break
            if deadline is not None and past_deadline(deadline, loop.step, cfg.log_every):
                loop.stopped_by = "max_minutes"
                break
            batch = next(run.data.iterator)
            # Host-side id check before dispatch (jit would clamp bad ids silently); numpy, no sync.
            for name, vocab in (("src", c.src_vocab_size), ("tgt_in", c.tgt_vocab_size),
                                ("tgt_out", c.tgt_vocab_size)):
                check_token_ids(batch[name], name=name, vocab_size=vocab, max_len=c.max_len)
            run.state, metrics = train_step(run.state, sharding_lib.shard_batch(batch, run.layout.batch),
                                            run.dropout_key)
            loop.totals = add_metrics(loop.totals, metrics)
            loop.step += 1
            bar.update(1)
            if loop.step % cfg.log_every == 0:
                bar.set_postfix(_log_window(run, loop, deadline))
            if loop.step % cfg.eval_every == 0:
                evaluate(run, loop.step)
            if loop.step % cfg.checkpoint_every == 0:
                _save_if_healthy(run, loop)
    if run.checkpoints.latest_step() != loop.step:
        _save_if_healthy(run, loop)
    run.checkpoints.wait()
    if guard.received is not None:
        _stop_preempted(run, loop, guard.received)
    return loop


def _log_window(run: Run, loop: LoopState, deadline: float | None) -> dict[str, str]:
    """Reads the window's sums back (the one host sync every ``--log-every`` steps), writes
    the metrics record and returns the progress-bar postfix.

    Raises:
      TrainingDiverged: every update of the window was skipped as non-finite.
    """
    values = jax.device_get(loop.totals)
    diverged = _finite_report(values, loop.step, run.checkpoints.latest_step())
    if diverged:
        raise TrainingDiverged(diverged)
    loop.recent_skips = float(values["skipped"])
    tokens = max(float(values["tokens"]), 1.0)
    applied = max(float(values["steps"] - values["skipped"]), 1.0)
    now = time.perf_counter()
    record = {"train/loss": float(values["loss_sum"]) / tokens,
              "train/nll": float(values["nll_sum"]) / tokens,
              "train/accuracy": float(values["correct"]) / tokens,
              "train/grad_norm": float(values["grad_norm"]) / applied,
              "train/skipped": float(values["skipped"]),
              "train/lr": float(run.schedule(loop.step - 1)),
              "train/tokens_per_s": tokens / max(now - loop.last_log_time, 1e-9)}
    run.metrics_log.write(loop.step, record)
    loop.totals, loop.last_log_time = None, now
    postfix = dict(loss=f"{record['train/loss']:.3f}", tok_s=f"{record['train/tokens_per_s']:.0f}")
    if deadline is not None:   # the time budget, not max_steps, bounds this run
        postfix["left"] = f"{max(0.0, deadline - now) / 60:.1f}min"
    return postfix


def _save_if_healthy(run: Run, loop: LoopState) -> bool:
    """Checkpoints unless an update was skipped since the last clean logging window: a
    run about to diverge can have applied a finite but ruinous update just before, and
    the rotation (keep N) would then push the last good checkpoint out."""
    pending = 0.0 if loop.totals is None else float(jax.device_get(loop.totals["skipped"]))  # saves only
    if loop.recent_skips == 0 and pending == 0:
        run.checkpoints.save(loop.step, run.state, run.data.iterator)
        return True
    log(f"step {loop.step}: not checkpointing, updates were skipped as non-finite since the last "
        f"clean logging window; step {run.checkpoints.latest_step()} stays the newest checkpoint")
    return False


def _stop_preempted(run: Run, loop: LoopState, signum: int) -> None:
    """Raises :class:`Preempted` with the resume hint (the checkpoint is written)."""
    saved = run.checkpoints.latest_step()
    where = ("with a checkpoint" if saved == loop.step
             else f"(newest checkpoint: {'none' if saved is None else f'step {saved}'})")
    message = (f"{loop.stopped_by} received: stopped at step {loop.step} {where} in "
               f"{run.run_dir.checkpoints}. Run the same command again to resume from there.")
    log(message)
    raise Preempted(signum, loop.step, message)


def _finite_report(values: dict[str, Any], step: int, last_checkpoint: int | None) -> str | None:
    """Logs skipped non-finite updates; returns the error message when a whole logging
    window was skipped (the run cannot make progress), else ``None``."""
    skipped, window = int(values["skipped"]), int(values["steps"])
    if skipped == 0:
        return None
    if skipped < window:
        log(f"step {step}: skipped {skipped} of the last {window} updates (non-finite loss or "
            f"gradient norm); parameters were left unchanged for those steps")
        return None
    where = (f"the last checkpoint (step {last_checkpoint}) is intact" if last_checkpoint is not None
             else "no checkpoint was written")
    return (f"Training diverged: all {window} updates up to step {step} had a non-finite loss or "
            f"gradient norm and were skipped; {where}. Lower --lr-scale, set --grad-clip or use "
            f"--dtype float32, then run again to resume from the last checkpoint (or --fresh).")


# ---------------------------------------------------------------------- evaluation
def evaluate(run: Run, step: int) -> float:
    """Dev loss and dev BLEU (on ``--dev-bleu-sentences``) with samples; keeps the best
    parameters by dev BLEU. Returns the BLEU."""
    cfg, t0 = run.cfg, time.perf_counter()
    dev_subset = run.data.splits["dev"][: cfg.dev_bleu_sentences]
    dev_loss = run.evaluator.loss(run.state.params, run.data.dev_examples)
    hyps = run.evaluator.translate(run.state.params, [p[0] for p in dev_subset], beam_size=cfg.beam_size,
                                   alpha=cfg.alpha)
    bleu = run.evaluator.score(hyps, [p[1] for p in dev_subset])
    run.metrics_log.write(step, {"dev/loss": dev_loss["loss"], "dev/ppl": dev_loss["ppl"],
                                 "dev/accuracy": dev_loss["accuracy"], "dev/bleu": bleu})
    if is_main_process():
        with run.run_dir.samples.open("a") as f:
            f.write(f"== step {step} dev BLEU {bleu:.2f}\n")
            for (src, ref), hyp in list(zip(dev_subset, hyps))[: cfg.num_samples]:
                f.write(f"SRC: {src}\nREF: {ref}\nHYP: {hyp}\n\n")
    if bleu > run.best_bleu:
        run.best_bleu = bleu
        run.checkpoints.save_best(step, run.state.params, bleu)
    log(f"step {step}: dev loss {dev_loss['loss']:.3f} ppl {dev_loss['ppl']:.1f} "
        f"BLEU {bleu:.2f} ({len(dev_subset)} sentences, {time.perf_counter() - t0:.0f}s)")
    return bleu


def final_test(run: Run, loop: LoopState) -> dict[str, Any]:
    """A last dev evaluation (unless the last step had one), then test BLEU with the best
    parameters; writes ``results.json``, the test hypotheses and the plots."""
    cfg, step = run.cfg, loop.step
    if step % cfg.eval_every != 0 or run.best_bleu < 0:
        evaluate(run, step)
    run.checkpoints.wait()
    log(f"training stopped at step {step} ({loop.stopped_by}); best dev BLEU {run.best_bleu:.2f}")
    params, best_step, _ = run.checkpoints.restore_params(sharding_lib.abstract_state(run.state).params,
                                                          report=log)
    t0 = time.perf_counter()
    test = run.data.splits["test"]
    hyps = run.evaluator.translate(params, [p[0] for p in test], beam_size=cfg.beam_size, alpha=cfg.alpha)
    refs = [p[1] for p in test]
    test_bleu = run.evaluator.score(hyps, refs)
    signature = str(run.evaluator.bleu.get_signature())
    decoding = "greedy" if cfg.beam_size == 1 else f"beam {cfg.beam_size}, alpha {cfg.alpha}"
    results = {"test_bleu": test_bleu, "sacrebleu_signature": signature, "best_step": best_step,
               "decoding": decoding, "best_dev_bleu": run.best_bleu, "final_step": step,
               "stopped_by": loop.stopped_by, "test_sentences": len(refs),
               "num_params": int(run.num_params), "wall_minutes": (time.perf_counter() - run.t_start) / 60}
    if is_main_process():
        save_json(run.run_dir.results, results)
        run.run_dir.test_hypotheses.write_text("\n".join(hyps) + "\n")
    log(f"test BLEU {test_bleu:.2f} on {len(refs)} sentences ({decoding}, step {best_step}, "
        f"{time.perf_counter() - t0:.0f}s) {signature}")
    run.close()
    if is_main_process():
        write_plots(run.run_dir)
    for (source, reference), hypothesis in list(zip(test, hyps))[:3]:
        log(f"  {source}\n  → {hypothesis}\n  (reference: {reference})")
    log(f"total wall time {results['wall_minutes']:.1f} min; run directory {run.run_dir.root}")
    return results
