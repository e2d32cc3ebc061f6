"""Fine-tuning from another run (``--init-from RUN``, from the trainer or ``jaxformer-convert
--from-hf``): its architecture, tokenizer and parameters; a fresh optimizer and step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax

from jaxformer.data.tokenizer import load_tokenizer
from jaxformer.model.config import TransformerConfig
from jaxformer.run.checkpoints import RunCheckpoints
from jaxformer.run.config import TrainConfig
from jaxformer.run.directory import RunDir
from jaxformer.run.logs import is_main_process

# How the weights are computed or regularised may change when fine-tuning; the shapes may not.
TUNABLE_FIELDS = ("dropout_rate", "dtype", "attention_backend", "remat", "scan_layers")


def read_run(init_from: str | Path) -> dict[str, Any]:
    """The ``config.json`` record of run ``init_from``. Raises ``FileNotFoundError`` (not a run
    directory) or ``ValueError`` (a Hugging Face folder, a damaged record), naming the flag."""
    try:
        return RunDir(init_from).read_run_record()
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"--init-from {str(init_from)!r}: {e}") from e


def model_config(record: dict[str, Any], overrides: dict[str, Any]) -> TransformerConfig:
    """The run's architecture with the fine-tuning ``overrides`` in ``TUNABLE_FIELDS`` (the others
    :func:`check_fine_tune` refused)."""
    config = TransformerConfig.from_dict(record["model"])
    return config.replace(**{k: v for k, v in overrides.items() if k in TUNABLE_FIELDS})


def copy_tokenizer(init_from: str | Path, record: dict[str, Any], target: Path) -> None:
    """Copies the run's tokenizer folder to ``target`` (this run's ``tokenizer/``) unless there."""
    info = record.get("tokenizer", {})
    folder = info["dir"] if "dir" in info else str(Path(info.get("file", "tokenizer/spm.model")).parent)
    if not (target.exists() and any(target.iterdir())):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(Path(init_from) / folder, target, dirs_exist_ok=True)


def check_fine_tune(cfg: TrainConfig, run_dir: RunDir, *, fresh: bool, starting: bool,
                    saved: dict[str, Any] | None = None) -> None:
    """Refuses, before anything is written, a fine-tune with ``--fresh`` into the loaded run
    itself, a ``preset`` or ``vocab_size`` off their defaults (the loaded run's are kept), a
    model flag that would change the architecture (of ``saved``, a resume's record, else the
    loaded run's), and, ``starting`` (no checkpoint of its own yet), a loaded run without one.

    Raises:
      ValueError: naming the flags and the fix; FileNotFoundError: no checkpoint, or not a run.
    """
    defaults, settings = TrainConfig().settings(), cfg.settings()
    ignored = [name for name in ("preset", "vocab_size") if settings[name] != defaults[name]]
    error, problem = ValueError, None
    record = saved if saved and "model" in saved else read_run(cfg.run.init_from)   # damage first
    if starting and not RunDir(cfg.run.init_from).has_checkpoint(or_best=True):
        error, problem = FileNotFoundError, (
            f"--init-from {str(cfg.run.init_from)!r} has no checkpoint (its best/ and checkpoints/ "
            f"hold no step): train it first, or start from a run that has one.")
    elif fresh and Path(cfg.run.init_from).resolve() == run_dir.root.resolve():
        problem = (f"--init-from {str(cfg.run.init_from)!r} is this run's own --workdir, whose files "
                   f"--fresh would move aside before loading them: fine-tune into another "
                   f"--workdir (nothing was moved).")
    elif ignored:
        named = " and ".join(f"{name}={settings[name]!r}" for name in ignored)
        problem = (f"this run fine-tunes {str(cfg.run.init_from)!r} (init_from), whose architecture and "
                   f"tokenizer it keeps, so {named} would do nothing: leave "
                   f"{'them' if len(ignored) > 1 else 'it'} at the default.")
    elif fixed := sorted(k for k, v in cfg.model.overrides().items() if k not in TUNABLE_FIELDS
                         and getattr(TransformerConfig.from_dict(record["model"]), k) != v):
        flags = ", ".join("--" + k.replace("_", "-").replace("num-encoder-layers", "num-layers")
                          for k in fixed if k != "num_decoder_layers")
        tunable = ", ".join("--" + f.replace("_", "-") for f in TUNABLE_FIELDS)
        problem = (f"--init-from takes the architecture from the run it loads; drop {flags} "
                   f"(only {tunable} may change).")
    if problem:
        raise error(problem)


def load_params(init_from: str | Path, abstract_params: Any) -> Any:
    """The run's best (else latest) parameters, laid out as ``abstract_params``."""
    checkpoints = RunCheckpoints(init_from, read_only=True)
    try:
        params, _ = checkpoints.restore_params(abstract_params)
    finally:
        checkpoints.close()
    return params


def tokenizer_and_model_config(cfg: TrainConfig, run_dir: RunDir, *,
                               own_record: dict[str, Any] | None = None):
    """``(tokenizer, model_config, record)`` of ``--init-from RUN``, its tokenizer folder copied
    into this run's ``tokenizer/``; a multilingual one set to ``--src-lang``/``--tgt-lang`` (its
    codes; ``ValueError`` naming the nearest for another), which the record keeps. ``own_record``
    (a resume's ``config.json``) gives both without ``RUN``, which may be gone since. Raises as
    :func:`read_run` and :func:`model_config`."""
    resumed = own_record is not None and "model" in own_record and "tokenizer" in own_record
    record = own_record if resumed else read_run(cfg.run.init_from)
    config = model_config(record, cfg.model.overrides())
    if not resumed:   # this run's tokenizer/ is the loaded run's, copied once
        if is_main_process():
            copy_tokenizer(cfg.run.init_from, record, run_dir.tokenizer_dir)
        if jax.process_count() > 1:   # the others load the files process 0 copied
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("tokenizer")
    tokenizer = load_tokenizer(run_dir.root, record)
    if hasattr(tokenizer, "with_languages"):   # M2M100/NLLB: the data's languages, kept in the record
        kept = (tokenizer.src_lang, tokenizer.tgt_lang)
        asked = (cfg.decode.src_lang or kept[0], cfg.decode.tgt_lang or kept[1])
        if resumed and asked != kept:   # its prepared data holds the recorded languages' tokens
            raise ValueError(f"this run fine-tunes {kept[0]} → {kept[1]}, not {asked[0]} → {asked[1]}: "
                             f"resume it without --src-lang/--tgt-lang, or fine-tune into another "
                             f"--workdir.")
        tokenizer = tokenizer.with_languages(cfg.decode.src_lang, cfg.decode.tgt_lang)
        languages = {"src_lang": tokenizer.src_lang, "tgt_lang": tokenizer.tgt_lang}
        record = {**record, "tokenizer": {**record["tokenizer"], **languages}}
        if is_main_process():   # in the tokenizer folder's digest: data of other languages is encoded anew
            (run_dir.tokenizer_dir / "languages.json").write_text(json.dumps(languages) + "\n")
    return tokenizer, config, record


def with_saved_init_from(cfg: TrainConfig, run_dir: RunDir) -> TrainConfig:
    """``cfg`` with the ``--init-from`` its run directory was started with, when resumed without it."""
    saved = run_dir.read_config() or {}
    init_from = saved.get("train", {}).get("init_from")
    if cfg.run.init_from or not init_from:
        return cfg
    return cfg.replace(init_from=init_from)
