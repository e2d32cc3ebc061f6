"""A run's start: the plan, then the run directory, data, tokenizer, programs, train state and
``config.json``. Nothing compiles before the data and the resume are checked."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

import jax

from jaxformer.data.batching import bucket_boundaries, check_batch_rows, rows_per_batch, tokenize_pairs
from jaxformer.data.prepared import PreparedCorpus
from jaxformer.data.run_data import prepare_run_data
from jaxformer.data.streaming import BatchStream, kept_records, stream_dataset
from jaxformer.data.tokenizer import Tokenizer
from jaxformer.decode.evaluation import Evaluator
from jaxformer.interop import pretrained
from jaxformer.model.config import TransformerConfig
from jaxformer.run.checkpoints import RunCheckpoints
from jaxformer.run.config import TrainConfig, save_json
from jaxformer.run.directory import check_resume_compatible, resume_record, set_aside_metrics_after
from jaxformer.run.logs import is_main_process, log
from jaxformer.run.metrics import MetricsLog
from jaxformer.train.plan import RunPlan, plan_run
from jaxformer.train.programs import RunPrograms, run_programs
from jaxformer.train.run_eval import resumed_overfit_watch
from jaxformer.train.run_state import EarlyStopping, LoopState, Run, TrainData
from jaxformer.train.step import TrainState

__all__ = ["setup", "build_train_data"]


def setup(cfg: TrainConfig, *, fresh: bool = False, chosen: frozenset[str] | None = None
          ) -> tuple[Run, LoopState]:
    """Plans the run (:func:`plan_run`, with the settings the user ``chosen``), makes its
    directory (``fresh``: the previous run's files moved aside), prepares data and tokenizer,
    restores, loads or initialises the train state and writes ``config.json``. Returns
    ``(run, loop state at the start step)``."""
    plan = plan_run(cfg, fresh, chosen)
    cfg, run_dir = plan.cfg, plan.run_dir
    previous = run_dir.create(fresh)   # --fresh: where the previous run's files went
    if jax.process_count() > 1:   # every process sees the directory after --fresh moved things
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("workdir")
    with contextlib.ExitStack() as closer:   # what is opened is closed again if a check fails
        checkpoints = RunCheckpoints(run_dir.root, keep=cfg.run.keep_checkpoints)
        closer.callback(checkpoints.close)   # else orbax's cleanup thread prints a traceback at exit
        closer.callback(checkpoints.wait)
        prepared, tokenizer, tokenizer_record = _data_and_tokenizer(plan, previous)
        plan = dataclasses.replace(plan, first_pass=None)   # its sample read, not kept for the run
        model_config = plan.model_config(tokenizer)
        batch_rows = _batch_rows(cfg, model_config, plan.row_multiple)
        if plan.saved is not None:
            check_resume_compatible(plan.saved, model_config)
            _check_same_batches(plan, batch_rows)
        data = build_train_data(cfg, prepared, tokenizer, model_config, plan.row_multiple,
                                workers=plan.data_workers)
        closer.callback(data.iterator.close)   # stops the data worker processes, if any
        programs = run_programs(cfg, model_config, plan.mesh)
        source = (f"the architecture of {cfg.run.init_from}" if cfg.run.init_from
                  else f"preset {cfg.model.preset!r}")
        log(f"model: {programs.num_params / 1e6:.2f}M parameters, {source}")
        init_key, dropout_key = jax.random.split(jax.random.key(cfg.run.seed))
        state, step = _start_state(plan, programs, checkpoints, data, init_key)
        data.iterator.start_prefetch()   # data workers (if any) start now, while the step compiles
        _write_run_record(plan, model_config, tokenizer, batch_rows, data=data.iterator.fingerprint(),
                          tokenizer_record=tokenizer_record)
        metrics_log = MetricsLog(run_dir)
        closer.callback(metrics_log.close)
        evaluator = Evaluator(programs.model, tokenizer, batch_size=cfg.decode.eval_batch_size,
                              bleu=plan.bleu, layout=programs.layout, decoders=programs.decoders)
        run = Run(plan=plan, programs=programs, data=data, tokenizer=tokenizer, checkpoints=checkpoints,
                  evaluator=evaluator, metrics_log=metrics_log, dropout_key=dropout_key,
                  closer=closer.pop_all())
    best = checkpoints.best_bleu()   # on resume, the score recorded with the best checkpoint
    return run, LoopState(step=step, state=state, best_bleu=-1.0 if best is None else best,
                          early_stopping=EarlyStopping(cfg.train.patience,
                                                       -math.inf if best is None else best),
                          overfit=resumed_overfit_watch(run_dir, step))


def _data_and_tokenizer(plan: RunPlan, previous: Path | None
                        ) -> tuple[PreparedCorpus, Tokenizer, dict[str, Any] | None]:
    """The prepared data, its tokenizer and a fine-tune's tokenizer record."""
    cfg, run_dir, tokenizer, record = plan.cfg, plan.run_dir, None, None
    if plan.source is not None:
        tokenizer, record = pretrained.fine_tune_tokenizer(cfg.run.init_from, plan.source, run_dir,
                                                           plan.src_lang, plan.tgt_lang)
    prepared = prepare_run_data(cfg, run_dir, has_checkpoints=plan.resuming, tokenizer=tokenizer,
                                previous=previous, first=plan.first_pass)
    return prepared, tokenizer or Tokenizer(run_dir.tokenizer_dir / "spm.model"), record


def _start_state(plan: RunPlan, programs: RunPrograms, checkpoints: RunCheckpoints, data: TrainData,
                 init_key: jax.Array) -> tuple[TrainState, int]:
    """The start state and step: the newest readable checkpoint, a fine-tune's loaded
    parameters, or a new state from ``init_key``."""
    cfg, abstract = plan.cfg, programs.abstract_state
    if plan.resuming:   # before anything is written: if no checkpoint is readable, nothing changes
        same_rows = plan.saved is not None and "batch_rows" in plan.saved   # rows recorded: checked
        state, step = checkpoints.restore_latest(abstract, data.iterator, report=log, same_rows=same_rows)
        log(f"resumed from {plan.run_dir.checkpoints} at step {step}")
        if is_main_process():
            set_aside_metrics_after(plan.run_dir, step)
        return state, step
    if plan.start == "fine-tune":
        log(f"initialised from {cfg.run.init_from}")
        return programs.start_from(pretrained.load_params(cfg.run.init_from, abstract.params)), 0
    return programs.init(init_key), 0


def build_train_data(cfg: TrainConfig, prepared: PreparedCorpus, tokenizer: Tokenizer,
                     model_config: TransformerConfig, row_multiple: int,
                     workers: int = 0) -> TrainData:
    """The endless pipeline of this process's rows (collated in ``workers`` processes) and the
    dev/test pairs."""
    max_train_len = cfg.train.row_length(model_config.max_len)
    _, too_long = kept_records(prepared, max_train_len)
    log(f"train: {len(prepared)} prepared pairs, {len(prepared) - too_long} used, {too_long} longer "
        f"than {max_train_len} tokens left out ({prepared.manifest['name']}: "
        f"{json.dumps(prepared.manifest['counts'])})")
    splits = {name: prepared.held_out(name) for name in ("dev", "test")}
    note = check_batch_rows(cfg.train.batch_tokens, max_train_len, row_multiple)
    if note:
        log(note)
    build = functools.partial(
        stream_dataset, prepared, max_len=max_train_len, batch_tokens=cfg.train.batch_tokens,
        boundaries=bucket_boundaries(max_train_len), seed=cfg.run.seed, pad_id=tokenizer.pad_id,
        bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, row_multiple=row_multiple,
        process_index=jax.process_index(), process_count=jax.process_count(), pack=cfg.train.pack)
    return TrainData(splits=splits,
                     iterator=BatchStream(lambda start: build(start=start), workers=workers,
                                          fingerprint=prepared.manifest["fingerprint"]),
                     dev_examples=tokenize_pairs(splits["dev"], tokenizer, model_config.max_len))


def _batch_rows(cfg: TrainConfig, model_config: TransformerConfig, row_multiple: int) -> dict[str, int]:
    """Rows per batch by row length (packed: one length): what a data position indexes into."""
    lengths = bucket_boundaries(cfg.train.row_length(model_config.max_len))
    return {str(length): rows_per_batch(cfg.train.batch_tokens, length, row_multiple)
            for length in (lengths[-1:] if cfg.train.pack else lengths)}


def _check_same_batches(plan: RunPlan, batch_rows: dict[str, int]) -> None:
    """Raises ``ValueError`` naming the flags to resume with when a resume's batches are not the
    ones its data position counts through (other rows per batch, another ``--seed``)."""
    cfg, before, train = plan.cfg, plan.saved.get("batch_rows"), plan.saved.get("train", {})
    fix = "start a new run (--fresh, or --init-from this one)."
    problem = None
    if before is not None and before != batch_rows:
        spelled = {"pack": lambda v: "--pack" if v else "--no-pack",
                   "max_train_len": lambda v: "no --max-train-len" if v is None else f"--max-train-len {v}"}
        moved = set(before) != set(batch_rows)   # a --max-train-len that moved the row lengths
        changed = [spell(train[k]) for k, spell in spelled.items()
                   if k in train and train[k] != cfg.settings().get(k) and (k == "pack" or moved)]
        used = " ".join(f"--{name.replace('_', '-')} {train[name]}"
                        for name in ("devices", "mesh", "grad_accum_steps") if train.get(name) is not None)
        unset = [f"--{name}" for name in ("devices", "mesh") if train.get(name) is None]
        problem = (
            f"The run's checkpoints continue batches of {before} rows (by row length), made with "
            f"{' and '.join(changed)}; these settings make other batches ({batch_rows}), so the saved data "
            f"position would point into them. Resume with {' and '.join(changed)}, or {fix}" if changed else
            f"The run's checkpoints continue batches of {before} rows (by row length); these settings give "
            f"{batch_rows} (rounded to multiples of {plan.row_multiple} = data axis × --grad-accum-steps × "
            f"processes), so the saved data position would point into other batches. Resume with the "
            f"settings the run used ({used}" + (f"; no {' or '.join(unset)}" if unset else "") + f", on "
            f"{train.get('num_processes') or 1} process(es)), or a --batch-tokens whose rows divide by both, "
            f"or {fix}")
    elif train.get("seed") not in (None, cfg.run.seed):   # the seed orders each epoch's data
        problem = (f"The run's checkpoints continue the data order of --seed {train['seed']}; --seed "
                   f"{cfg.run.seed} would read their saved position in another order (pairs repeated and "
                   f"skipped). Resume with --seed {train['seed']}, or {fix}")
    if problem:
        raise ValueError(problem)


def _write_run_record(plan: RunPlan, model_config: TransformerConfig, tokenizer: Tokenizer,
                      batch_rows: dict[str, int], data: dict[str, Any],
                      tokenizer_record: dict[str, Any] | None = None) -> None:
    """Writes ``config.json``: architecture, settings (their history on resume), tokenizer ids
    (``tokenizer_record``: an --init-from run's), languages, a fine-tune's generation rules and
    the data's fingerprint."""
    cfg, run_dir = plan.cfg, plan.run_dir
    record = {"model": model_config.to_dict(), "train": cfg.to_dict(),
              "tokenizer": tokenizer_record or {
                  "file": str(run_dir.tokenizer_dir.relative_to(run_dir.root) / "spm.model"),
                  "pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id,
                  "eos_id": tokenizer.eos_id, "unk_id": tokenizer.unk_id,
                  "vocab_size": tokenizer.vocab_size},
              **plan.languages(), "batch_rows": batch_rows, "data": data}
    if plan.generation is not None:
        record["generation"] = plan.generation
    if is_main_process():
        save_json(run_dir.config, resume_record(plan.saved, record, plan.resuming))
    log("model config: " + json.dumps(record["model"]))
    log("run config: " + json.dumps({k: v for k, v in cfg.to_dict().items() if v is not None}))
