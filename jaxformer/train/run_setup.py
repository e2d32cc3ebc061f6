"""A run's start: mesh, run directory, data, tokenizer, model, programs and train state
(restored, loaded for a fine-tune, or initialised), and its ``config.json`` record.

:func:`setup` is the first of :func:`jaxformer.train.trainer.train`'s three phases.
Nothing compiles before the data and the checkpoint compatibility are checked, and
nothing is written before the flags that need no data are.
"""

from __future__ import annotations

import functools
import json
import math
import time
from typing import Any

import jax

from jaxformer.data.batching import bucket_boundaries, check_batch_rows, rows_per_batch, tokenize_pairs
from jaxformer.data.corpus import target_language_of
from jaxformer.data.prepared import PreparedCorpus
from jaxformer.data.run_data import prepare_run_data
from jaxformer.data.streaming import BatchStream, kept_records, stream_dataset
from jaxformer.data.tokenizer import Tokenizer
from jaxformer.decode.evaluation import Evaluator, make_bleu
from jaxformer.interop import pretrained
from jaxformer.model import sharding as sharding_lib
from jaxformer.model.config import TransformerConfig, preset
from jaxformer.run.checkpoints import RunCheckpoints
from jaxformer.run.config import TrainConfig, save_json
from jaxformer.run.directory import RunDir, check_resume_compatible, resume_record, set_aside_metrics_after
from jaxformer.run.logs import is_main_process, log
from jaxformer.run.metrics import MetricsLog
from jaxformer.run.platform import matmul_flop_rate
from jaxformer.train.programs import run_programs
from jaxformer.train.run_state import Run, TrainData

__all__ = ["setup", "build_train_data"]


def setup(cfg: TrainConfig, *, fresh: bool = False) -> Run:
    """Mesh, run directory, data, tokenizer, model and train state (restored if a
    checkpoint exists); writes ``config.json``. Nothing compiles before the data and
    the checkpoint compatibility are checked, and nothing is written before the flags
    that need no data (BLEU's tokenizer, the mesh) are."""
    t_start = time.perf_counter()
    # A BLEU tokenizer that cannot start (MeCab missing, an unknown name) fails before the
    # run directory and its data are made, not after minutes of preparing them.
    make_bleu(cfg.decode.tgt_lang or target_language_of(cfg), cfg.decode.sacrebleu_tokenize)
    sharding_lib.initialize_distributed(cfg.run.coordinator_address, cfg.run.num_processes, cfg.run.process_id,
                                        auto=cfg.run.distributed)
    # A bad --mesh or --devices fails here, before any data work.
    mesh = sharding_lib.make_mesh(cfg.run.mesh, sharding_lib.first_devices(cfg.run.devices))
    run_dir = RunDir(cfg.workdir)
    # A fine-tune: flagged, or a resume (without the flag) of a run started as one.
    fine_tune = cfg.run.init_from or (not fresh and pretrained.with_saved_init_from(cfg, run_dir).run.init_from)
    if not fine_tune:   # the model's widths are the flags': a mesh that cannot split them fails now
        sharding_lib.check_mesh_divides(mesh, preset(cfg.model.preset, src_vocab_size=cfg.data.vocab_size,
                                                     **cfg.model.overrides()))
    else:   # a start checks that run's weights and widths before anything is made or moved
        starting = fresh or not run_dir.config.exists()   # (a resume: at its load)
        if starting:
            pretrained.check_has_checkpoint(cfg.run.init_from)
        pretrained.check_takes_no_model_choice(cfg, fine_tune)
        if starting:
            pretrained.check_mesh_takes_loaded_run(cfg, mesh)
    if cfg.run.devices is not None:
        log(f"using {cfg.run.devices} of {len(jax.devices())} devices (--devices)")
    pretrained.check_not_moved_by_fresh(cfg.run.init_from, run_dir, fresh)
    previous = run_dir.create(fresh)   # --fresh: where the previous run's files went
    if jax.process_count() > 1:   # every process sees the directory after --fresh moved things
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("workdir")
    cfg = pretrained.with_saved_init_from(cfg, run_dir)
    checkpoints = RunCheckpoints(run_dir.root, keep=cfg.run.keep_checkpoints)
    try:
        return _setup_run(cfg, run_dir, checkpoints, mesh, previous, t_start)
    except BaseException:
        checkpoints.close()   # else orbax's cleanup thread prints a traceback at exit
        raise


def _setup_run(cfg: TrainConfig, run_dir: RunDir, checkpoints: RunCheckpoints, mesh: jax.sharding.Mesh,
               previous, t_start: float) -> Run:
    """:func:`setup` once the run directory and its checkpoints are open."""
    has_checkpoints = checkpoints.latest_step() is not None
    saved = run_dir.read_config()   # this run's record, if it was started before
    target_language = target_language_of(cfg)
    # Prepared once (jaxformer.data.prepare), reused on every resume; other data than the run's is an error.
    if cfg.run.init_from:   # fine-tuning: that run's architecture and tokenizer encode the data
        if not has_checkpoints:   # its weights are needed: no data work for a run that has none
            pretrained.check_has_checkpoint(cfg.run.init_from)
        tokenizer, model_config, pretrained_record = pretrained.tokenizer_and_model_config(
            cfg, run_dir, own_record=saved if has_checkpoints else None, mesh=mesh)
        prepared = prepare_run_data(cfg, run_dir, has_checkpoints=has_checkpoints, tokenizer=tokenizer,
                                    previous=previous)
    else:
        prepared = prepare_run_data(cfg, run_dir, has_checkpoints=has_checkpoints, previous=previous)
        tokenizer, pretrained_record = Tokenizer(run_dir.tokenizer_dir / "spm.model"), None
        model_config = preset(cfg.model.preset, src_vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                              **cfg.model.overrides())
    if checkpoints.latest_step() is not None and saved is not None:
        check_resume_compatible(saved, model_config)
    row_multiple = math.lcm(sharding_lib.batch_shards(mesh) * cfg.train.grad_accum_steps, jax.process_count())
    batch_rows = _batch_rows(cfg, model_config, row_multiple)
    if has_checkpoints and saved is not None:
        _check_same_batch_plan(saved, batch_rows, row_multiple, cfg)
        _check_same_seed(saved, cfg)
    data = build_train_data(cfg, prepared, target_language, tokenizer, model_config, row_multiple)

    programs = run_programs(cfg, model_config, mesh)   # kept from an earlier run of these settings
    init_key, dropout_key = jax.random.split(jax.random.key(cfg.run.seed))
    abstract = programs.abstract_state   # a resume and a fine-tune load into it; neither computes an init
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(abstract.params))
    source = f"the architecture of {cfg.run.init_from}" if cfg.run.init_from else f"preset {cfg.model.preset!r}"
    log(f"model: {num_params / 1e6:.2f}M parameters, {source}")
    if cfg.train.warmup_steps >= cfg.train.max_steps:   # legal (short test runs), but rarely what is meant
        log(f"note: --warmup-steps {cfg.train.warmup_steps} >= --max-steps {cfg.train.max_steps}: the learning rate "
            f"rises for the whole run and never reaches its peak or decays; lower --warmup-steps "
            f"(e.g. {max(1, cfg.train.max_steps // 10)}) for a full schedule")
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
        state = programs.start_from(pretrained.load_params(cfg.run.init_from, abstract.params))
        log(f"initialised from {cfg.run.init_from}")
    else:
        state = programs.init(init_key)
    data.iterator.start_prefetch()   # data workers (if any) start now, while the step compiles
    _write_run_record(run_dir, cfg, model_config, tokenizer, target_language, saved, batch_rows,
                      resumed=restored is not None, data=prepared.manifest["fingerprint"],
                      tokenizer_record=pretrained_record["tokenizer"] if pretrained_record else None)
    if restored is not None and is_main_process():
        set_aside_metrics_after(run_dir, start_step)
    evaluator = Evaluator(programs.model, tokenizer, batch_size=cfg.decode.eval_batch_size,
                          target_language=cfg.decode.tgt_lang or target_language, tokenize=cfg.decode.sacrebleu_tokenize,
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
    max_train_len = cfg.train.row_length(model_config.max_len)
    _, too_long = kept_records(prepared, max_train_len)
    log(f"train: {len(prepared)} prepared pairs, {len(prepared) - too_long} used, {too_long} longer "
        f"than {max_train_len} tokens left out ({prepared.manifest['name']}: "
        f"{json.dumps(prepared.manifest['counts'])})")
    splits = {name: prepared.held_out(name) for name in ("dev", "test")}
    dev_examples = tokenize_pairs(splits["dev"], tokenizer, model_config.max_len)
    note = check_batch_rows(cfg.train.batch_tokens, max_train_len, row_multiple)
    if note:
        log(note)
    build = functools.partial(
        stream_dataset, prepared, max_len=max_train_len, batch_tokens=cfg.train.batch_tokens,
        boundaries=bucket_boundaries(max_train_len), seed=cfg.run.seed, pad_id=tokenizer.pad_id,
        bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, row_multiple=row_multiple,
        process_index=jax.process_index(), process_count=jax.process_count(), pack=cfg.train.pack)
    workers = cfg.train.data_workers if cfg.train.data_workers is not None else (
        0 if jax.default_backend() == "cpu" else 2)
    return TrainData(splits=splits, target_language=target_language,
                     iterator=BatchStream(lambda start: build(start=start), workers=workers),
                     dev_examples=dev_examples)


def _batch_rows(cfg: TrainConfig, model_config: TransformerConfig, row_multiple: int) -> dict[str, int]:
    """Rows per batch for each row length the plan uses (packed: one): with the seed and
    the data, what the saved data position indexes into."""
    max_train_len = cfg.train.row_length(model_config.max_len)
    lengths = bucket_boundaries(max_train_len)
    return {str(length): rows_per_batch(cfg.train.batch_tokens, length, row_multiple)
            for length in (lengths[-1:] if cfg.train.pack else lengths)}


def _check_same_batch_plan(saved: dict[str, Any], batch_rows: dict[str, int], row_multiple: int,
                           cfg: TrainConfig) -> None:
    """A resumed run's batches must be the ones its saved data position counts through.

    Raises:
      ValueError: packing or the row length changed (the batches are other ones), or the
        devices, ``--grad-accum-steps`` or process count now round the batches to other
        row counts than the run's checkpoints were trained on.
    """
    before = saved.get("batch_rows")
    if before is None or before == batch_rows:   # a run from before the record: nothing to compare
        return
    train = saved.get("train", {})
    spelled = {"pack": lambda v: "--pack" if v else "--no-pack",
               "max_train_len": lambda v: "no --max-train-len" if v is None else f"--max-train-len {v}"}
    changed = [spell(train[k]) for k, spell in spelled.items() if k in train and train[k] != cfg.settings().get(k)
               and (k == "pack" or set(before) != set(batch_rows))]   # a limit that moved the row lengths
    if changed:
        raise ValueError(
            f"The run's checkpoints continue batches of {before} rows (by row length), made with "
            f"{' and '.join(changed)}; these settings make other batches ({batch_rows}), so the saved "
            f"data position would point into them. Resume with {' and '.join(changed)}, or start a new "
            f"run (--fresh, or --init-from this one).")
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


def _check_same_seed(saved: dict[str, Any], cfg: TrainConfig) -> None:
    """The seed orders each epoch's data (and draws dropout): a resume with another one
    would read the saved position in another order, repeating and skipping pairs.

    Raises:
      ValueError: ``cfg.run.seed`` is not the seed the run's checkpoints were trained with.
    """
    before = saved.get("train", {}).get("seed")
    if before is not None and before != cfg.run.seed:
        raise ValueError(f"The run's checkpoints continue the data order of --seed {before}; --seed "
                         f"{cfg.run.seed} would read their saved position in another order (pairs repeated "
                         f"and skipped). Resume with --seed {before}, or start a new run (--fresh, or "
                         f"--init-from this one).")


def _write_run_record(run_dir: RunDir, cfg: TrainConfig, model_config: TransformerConfig,
                      tokenizer: Tokenizer, target_language: str, saved: dict[str, Any] | None,
                      batch_rows: dict[str, int], resumed: bool, data: dict[str, Any],
                      tokenizer_record: dict[str, Any] | None = None) -> None:
    """``config.json``: the architecture, the run settings (with their history on resume),
    the tokenizer's special ids (``tokenizer_record``: an --init-from run's, kept
    as is) and the fingerprint of the data (``data``, what a resume is checked against
    when ``prepared/`` is gone); what :class:`jaxformer.decode.translator.Translator` reads."""
    record = {"model": model_config.to_dict(), "train": cfg.to_dict(),
              "tokenizer": tokenizer_record or {
                  "file": str(run_dir.tokenizer_dir.relative_to(run_dir.root) / "spm.model"),
                  "pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id,
                  "eos_id": tokenizer.eos_id, "unk_id": tokenizer.unk_id,
                  "vocab_size": tokenizer.vocab_size},
              "target_language": target_language, "batch_rows": batch_rows, "data": data}
    if is_main_process():
        save_json(run_dir.config, resume_record(saved, record, resumed))
    log("model config: " + json.dumps(record["model"]))
    log("run config: " + json.dumps({k: v for k, v in cfg.to_dict().items() if v is not None}))
