"""The main job: train a translator, evaluate BLEU, checkpoint, resume.

:func:`train` reads as its three phases: :func:`setup` (mesh, run directory, data,
tokenizer, model, restored state), :func:`train_loop` (steps, logging, evaluation,
checkpoints, preemption) and :func:`final_test`. ``train.py`` is a thin entry point;
everything here is importable and tested.
"""

from __future__ import annotations

import functools
import json
import math
import signal
import time
from pathlib import Path
from typing import Any

import jax

from jaxformer.data.batching import bucket_boundaries, rows_per_batch, tokenize_pairs
from jaxformer.data.corpus import target_language_of
from jaxformer.data.prepared import PreparedCorpus
from jaxformer.data.run_data import prepare_run_data
from jaxformer.data.streaming import BatchStream, kept_records, stream_dataset
from jaxformer.data.tokenizer import Tokenizer
from jaxformer.decode.evaluation import Evaluator, make_bleu
from jaxformer.interop import pretrained
from jaxformer.model import sharding as sharding_lib
from jaxformer.model.config import TransformerConfig, preset
from jaxformer.model.validation import check_token_ids
from jaxformer.run.checkpoints import RunCheckpoints
from jaxformer.run.config import TrainConfig, save_json
from jaxformer.run.directory import (
    MetricsLog,
    RunDir,
    check_resume_compatible,
    resume_record,
    set_aside_metrics_after,
    topmost_missing,
)
from jaxformer.run.logs import Progress, RunLog, is_main_process, log
from jaxformer.run.platform import matmul_flop_rate
from jaxformer.train.early_stopping import EarlyStopping
from jaxformer.train.preemption import Preempted, PreemptionGuard, past_deadline
from jaxformer.train.programs import run_programs
from jaxformer.train.run_eval import evaluate, final_test
from jaxformer.train.run_state import LoopState, Run, TrainData, TrainingDiverged
from jaxformer.train.step import add_metrics

__all__ = ["Preempted", "TrainingDiverged", "train", "setup", "train_loop", "evaluate", "final_test"]


def train(cfg: TrainConfig, *, fresh: bool = False) -> dict[str, Any]:
    """Trains, evaluates and checkpoints one run; resumes if the workdir has a checkpoint.

    Resume is exact: the checkpoint holds the step, parameters, optimizer state and
    the data iterator's position, and dropout keys are ``fold_in(seed key, step)``,
    so N steps in one go equal N/2 + N/2 across a restart, bit for bit on CPU.

    Returns:
      the final results (also written to ``workdir/results.json``).

    Raises:
      ValueError / FileNotFoundError / OSError: bad corpus, bad paths, or an
        incompatible checkpoint; all before any compile. A run directory this call
        made is removed again, unless its data was prepared or its tokenizer trained
        (the next attempt reuses them).
      CheckpointError: checkpoints exist but none is readable (nothing is changed).
      Preempted: SIGTERM/SIGINT; the current step was checkpointed first.
      TrainingDiverged: a whole logging window of non-finite updates (all skipped);
        the last checkpoint is intact.
    """
    run_dir, made = RunDir(cfg.workdir), topmost_missing(Path(cfg.workdir))
    with RunLog(run_dir.log) as run_log:   # train.log: everything printed
        try:
            run = setup(cfg, fresh=fresh)
        except Exception:   # a folder this call made, holding no prepared data, is removed
            run_dir.remove_if_made_and_unprepared(made)
            raise
        run_log.open()   # after --fresh moved the previous run's log aside
        try:
            return final_test(run, train_loop(run))
        finally:   # also on Preempted / TrainingDiverged: pending saves finish, files are closed
            run.close()


# ---------------------------------------------------------------------- setup
def setup(cfg: TrainConfig, *, fresh: bool = False) -> Run:
    """Mesh, run directory, data, tokenizer, model and train state (restored if a
    checkpoint exists); writes ``config.json``. Nothing compiles before the data and
    the checkpoint compatibility are checked, and nothing is written before the flags
    that need no data (BLEU's tokenizer, the mesh) are."""
    t_start = time.perf_counter()
    # A BLEU tokenizer that cannot start (MeCab missing, an unknown name) fails before the
    # run directory and its data are made, not after minutes of preparing them.
    make_bleu(cfg.tgt_lang or target_language_of(cfg), cfg.sacrebleu_tokenize)
    sharding_lib.initialize_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id,
                                        auto=cfg.distributed)
    # A bad --mesh or --devices fails here, before any data work.
    mesh = sharding_lib.make_mesh(cfg.mesh, sharding_lib.first_devices(cfg.devices))
    if not cfg.init_from:   # the model's widths are the flags': a mesh that cannot split them fails now
        sharding_lib.check_mesh_divides(mesh, preset(cfg.preset, src_vocab_size=cfg.vocab_size,
                                                     **cfg.model_overrides()))
    if cfg.devices is not None:
        log(f"using {cfg.devices} of {len(jax.devices())} devices (--devices)")
    run_dir = RunDir(cfg.workdir)
    pretrained.check_not_moved_by_fresh(cfg.init_from, run_dir, fresh)
    previous = run_dir.create(fresh)   # --fresh: where the previous run's files went
    if jax.process_count() > 1:   # every process sees the directory after --fresh moved things
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("workdir")
    cfg = pretrained.with_saved_init_from(cfg, run_dir)
    checkpoints = RunCheckpoints(run_dir.root, keep=cfg.keep_checkpoints)
    try:
        return _setup_run(cfg, run_dir, checkpoints, mesh, previous, t_start)
    except BaseException:
        checkpoints.close()   # else orbax's cleanup thread prints a traceback at exit
        raise


def _setup_run(cfg: TrainConfig, run_dir: RunDir, checkpoints: RunCheckpoints, mesh: jax.sharding.Mesh,
               previous, t_start: float) -> Run:
    """:func:`setup` once the run directory and its checkpoints are open."""
    has_checkpoints = checkpoints.latest_step() is not None
    target_language = target_language_of(cfg)
    # Prepared once (jaxformer.data.prepare), reused on every resume; other data than the run's is an error.
    if cfg.init_from:   # fine-tuning: that run's architecture and tokenizer encode the data
        if not has_checkpoints:   # its weights are needed: no data work for a run that has none
            pretrained.check_has_checkpoint(cfg.init_from)
        tokenizer, model_config, pretrained_record = pretrained.tokenizer_and_model_config(
            cfg, run_dir, resuming=has_checkpoints)
        prepared = prepare_run_data(cfg, run_dir, has_checkpoints=has_checkpoints, tokenizer=tokenizer,
                                    previous=previous)
    else:
        prepared = prepare_run_data(cfg, run_dir, has_checkpoints=has_checkpoints, previous=previous)
        tokenizer, pretrained_record = Tokenizer(run_dir.tokenizer_dir / "spm.model"), None
        model_config = preset(cfg.preset, src_vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                              **cfg.model_overrides())
    saved = run_dir.read_config()
    if checkpoints.latest_step() is not None and saved is not None:
        check_resume_compatible(saved, model_config)
    row_multiple = math.lcm(sharding_lib.batch_shards(mesh) * cfg.grad_accum_steps, jax.process_count())
    batch_rows = _batch_rows(cfg, model_config, row_multiple)
    if has_checkpoints and saved is not None:
        _check_same_batch_plan(saved, batch_rows, row_multiple)
    data = build_train_data(cfg, prepared, target_language, tokenizer, model_config, row_multiple)

    programs = run_programs(cfg, model_config, mesh)   # kept from an earlier run of these settings
    init_key, dropout_key = jax.random.split(jax.random.key(cfg.seed))
    abstract = programs.abstract_state   # a resume and a fine-tune load into it; neither computes an init
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(abstract.params))
    source = f"the architecture of {cfg.init_from}" if cfg.init_from else f"preset {cfg.preset!r}"
    log(f"model: {num_params / 1e6:.2f}M parameters, {source}")
    matmul = matmul_flop_rate(repeats=2)   # ~0.4 s on 2 cores
    log(f"machine: a float32 2048³ matmul runs at {matmul / 1e9:.0f} GFLOP/s on "
        f"{jax.devices()[0].platform} (the README's times say the rate they were measured at)")
    # Restore before writing anything: if no checkpoint is readable, the run dir is untouched.
    restored = checkpoints.restore_latest(abstract, data.iterator, report=log,
                                          same_rows=saved is not None and "batch_rows" in saved)
    if restored is not None:
        state, start_step = restored
        log(f"resumed from {run_dir.checkpoints} at step {int(state.step)}")
    elif pretrained_record is not None:   # fine-tuning: that run's weights, a fresh optimizer and step
        state = programs.start_from(pretrained.load_params(cfg.init_from, abstract.params))
        log(f"initialised from {cfg.init_from}")
    else:
        state = programs.init(init_key)
    data.iterator.start_prefetch()   # data workers (if any) start now, while the step compiles
    _write_run_record(run_dir, cfg, model_config, tokenizer, target_language, saved, batch_rows,
                      resumed=restored is not None,
                      tokenizer_record=pretrained_record["tokenizer"] if pretrained_record else None)
    if restored is not None and is_main_process():
        set_aside_metrics_after(run_dir, start_step)
    evaluator = Evaluator(programs.model, tokenizer, batch_size=cfg.eval_batch_size,
                          target_language=cfg.tgt_lang or target_language, tokenize=cfg.sacrebleu_tokenize,
                          layout=programs.layout, decoders=programs.decoders)
    best_bleu = checkpoints.best_bleu()   # on resume, the score recorded with the best checkpoint
    return Run(cfg=cfg, run_dir=run_dir, data=data, tokenizer=tokenizer, programs=programs, state=state,
               checkpoints=checkpoints, evaluator=evaluator,
               metrics_log=MetricsLog(run_dir), dropout_key=dropout_key, num_params=num_params,
               best_bleu=-1.0 if best_bleu is None else best_bleu, t_start=t_start,
               matmul_flop_rate=matmul)


def build_train_data(cfg: TrainConfig, prepared: PreparedCorpus, target_language: str,
                     tokenizer: Tokenizer, model_config: TransformerConfig, row_multiple: int) -> TrainData:
    """The endless training pipeline over the prepared data (this process's rows, streamed
    from disk) and the dev/test pairs.

    Raises:
      ValueError: no pair fits, or ``--batch-tokens`` is too small for one row per data shard.
    """
    max_train_len = cfg.row_length(model_config.max_len)
    _, too_long = kept_records(prepared, max_train_len)
    log(f"train: {len(prepared)} prepared pairs, {len(prepared) - too_long} used, {too_long} longer "
        f"than {max_train_len} tokens left out ({prepared.manifest['name']}: "
        f"{json.dumps(prepared.manifest['counts'])})")
    splits = {name: prepared.held_out(name) for name in ("dev", "test")}
    dev_examples = tokenize_pairs(splits["dev"], tokenizer, model_config.max_len)
    _check_batch_rows(cfg.batch_tokens, max_train_len, row_multiple)
    build = functools.partial(
        stream_dataset, prepared, max_len=max_train_len, batch_tokens=cfg.batch_tokens,
        boundaries=bucket_boundaries(max_train_len), seed=cfg.seed, pad_id=tokenizer.pad_id,
        bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, row_multiple=row_multiple,
        process_index=jax.process_index(), process_count=jax.process_count(), pack=cfg.pack)
    workers = cfg.data_workers if cfg.data_workers is not None else (
        0 if jax.default_backend() == "cpu" else 2)
    return TrainData(splits=splits, target_language=target_language,
                     iterator=BatchStream(lambda start: build(start=start), workers=workers),
                     dev_examples=dev_examples)


def _batch_rows(cfg: TrainConfig, model_config: TransformerConfig, row_multiple: int) -> dict[str, int]:
    """Rows per batch for each row length the plan uses (packed: one): with the seed and
    the data, what the saved data position indexes into."""
    max_train_len = cfg.row_length(model_config.max_len)
    lengths = bucket_boundaries(max_train_len)
    return {str(length): rows_per_batch(cfg.batch_tokens, length, row_multiple)
            for length in (lengths[-1:] if cfg.pack else lengths)}


def _check_same_batch_plan(saved: dict[str, Any], batch_rows: dict[str, int], row_multiple: int) -> None:
    """A resumed run's batches must be the ones its saved data position counts through.

    Raises:
      ValueError: the devices, ``--grad-accum-steps`` or process count now round the
        batches to other row counts than the run's checkpoints were trained on.
    """
    before = saved.get("batch_rows")
    if before is None or before == batch_rows:   # a run from before the record: nothing to compare
        return
    train = saved.get("train", {})
    used = " ".join(f"--{name.replace('_', '-')} {train[name]}"
                    for name in ("devices", "mesh", "grad_accum_steps") if train.get(name) is not None)
    unset = [f"--{name}" for name in ("devices", "mesh") if train.get(name) is None]
    raise ValueError(
        f"The run's checkpoints continue batches of {before} rows (by row length); these settings "
        f"give {batch_rows} (rounded to multiples of {row_multiple} = data axis × --grad-accum-steps "
        f"× processes), so the saved data position would point into other batches. Resume with the "
        f"settings the run used ({used}" + (f"; no {' or '.join(unset)}" if unset else "") + f", on "
        f"{train.get('num_processes') or 1} process(es)), or a --batch-tokens whose rows divide by "
        f"both, or start a new run (--fresh, or --init-from this one).")


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
                      batch_rows: dict[str, int], resumed: bool,
                      tokenizer_record: dict[str, Any] | None = None) -> None:
    """``config.json``: the architecture, the run settings (with their history on resume)
    and the tokenizer's special ids (``tokenizer_record``: an --init-from run's, kept
    as is); what :class:`jaxformer.decode.translator.Translator` reads."""
    record = {"model": model_config.to_dict(), "train": cfg.to_dict(),
              "tokenizer": tokenizer_record or {
                  "file": str(run_dir.tokenizer_dir.relative_to(run_dir.root) / "spm.model"),
                  "pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id,
                  "eos_id": tokenizer.eos_id, "unk_id": tokenizer.unk_id,
                  "vocab_size": tokenizer.vocab_size},
              "target_language": target_language, "batch_rows": batch_rows}
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
    cfg, c = run.cfg, run.model.config
    loop = LoopState(step=int(run.state.step), last_log_time=time.perf_counter())
    deadline = None if cfg.max_minutes is None else run.t_start + 60 * cfg.max_minutes
    train_step = run.programs.train_step
    run.early_stopping = EarlyStopping(cfg.patience, best=run.best_bleu if run.best_bleu >= 0 else -math.inf)
    progress = Progress(enabled=cfg.progress, step=loop.step, max_steps=cfg.max_steps, t_start=run.t_start,
                        deadline=deadline)
    with PreemptionGuard(multi_process=jax.process_count() > 1) as guard, progress:
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
            progress.step(loop.step)
            if loop.step % cfg.log_every == 0:
                _log_window(run, loop, progress)
            if loop.step % cfg.checkpoint_every == 0:
                _save_if_healthy(run, loop)
            if loop.step % cfg.eval_every == 0 and run.early_stopping.update(evaluate(run, loop.step)):
                loop.stopped_by = "early_stopping"
                log(f"early stopping: no better dev BLEU in {cfg.patience} evaluations "
                    f"(best {run.early_stopping.best:.2f})")
                break
    if run.checkpoints.latest_step() != loop.step:
        _save_if_healthy(run, loop)
    run.checkpoints.wait()
    if guard.received is not None:
        _stop_preempted(run, loop, guard.received)
    return loop


def _log_window(run: Run, loop: LoopState, progress: Progress) -> None:
    """Reads the window's sums back (the one host sync every ``--log-every`` steps), writes
    the metrics record and reports it to the progress bar / log line. ``train/steps`` is
    the number of steps the record averages: ``--log-every``, except in the first window
    of a run resumed between two logged steps, which starts at the restored step.

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
              "train/steps": int(values["steps"]),
              "train/lr": float(run.schedule(loop.step - 1)),
              "train/tokens_per_s": tokens / max(now - loop.last_log_time, 1e-9)}
    run.metrics_log.write(loop.step, record)
    loop.totals, loop.last_log_time = None, now
    progress.window(loop.step, record["train/loss"], record["train/tokens_per_s"], record["train/lr"])


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
