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
TUNABLE_FIELDS = ("dropout_rate", "attention_dropout_rate", "dtype", "attention_backend", "remat",
                  "scan_layers")


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


def check_fine_tune(cfg: TrainConfig, record: dict[str, Any], chosen: frozenset[str], run_dir: RunDir, *,
                    fresh: bool, starting: bool) -> None:
    """Refuses, before anything is written, a fine-tune with ``--fresh`` into the loaded run
    itself, a ``preset`` or ``vocab_size`` the user ``chosen`` (the loaded run's are kept), a
    model flag that would change the architecture of ``record`` (a resume's own, else the loaded
    run's), and, ``starting`` (no checkpoint of its own yet), a loaded run without one.

    Raises:
      ValueError: naming the flags and the fix; FileNotFoundError: no checkpoint, or not a run.
    """
    init_from, error, problem = cfg.run.init_from, ValueError, None
    ignored = sorted(chosen & {"preset", "vocab_size"})
    if starting and not RunDir(init_from).has_checkpoint(or_best=True):
        error, problem = FileNotFoundError, (
            f"--init-from {str(init_from)!r} has no checkpoint (its best/ and checkpoints/ "
            f"hold no step): train it first, or start from a run that has one.")
    elif fresh and Path(init_from).resolve() == run_dir.root.resolve():
        problem = (f"--init-from {str(init_from)!r} is this run's own --workdir, whose files "
                   f"--fresh would move aside before loading them: fine-tune into another "
                   f"--workdir (nothing was moved).")
    elif ignored:
        named = " and ".join("--" + name.replace("_", "-") for name in ignored)
        problem = (f"this run fine-tunes {init_from} (--init-from), whose architecture and tokenizer it "
                   f"keeps, so {named} would do nothing (given as a flag or in --config): drop "
                   f"{'them' if len(ignored) > 1 else 'it'}.")
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


def fine_tune_tokenizer(init_from: str | Path, record: dict[str, Any], run_dir: RunDir,
                        src_lang: str | None, tgt_lang: str | None) -> tuple[Any, dict[str, Any]]:
    """``(tokenizer, its config.json record)`` of fine-tune ``record`` (``--init-from RUN``'s, or a
    resumed fine-tune's own), RUN's tokenizer folder copied into this run's ``tokenizer/`` unless
    there; a multilingual one set to ``src_lang`` → ``tgt_lang`` (``None``: the record's), which
    the record keeps. Raises ``ValueError`` naming the nearest code for a language not the
    model's; as :func:`jaxformer.data.tokenizer.load_tokenizer`."""
    if is_main_process():
        copy_tokenizer(init_from, record, run_dir.tokenizer_dir)
    if jax.process_count() > 1:   # the others load the files process 0 copied
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("tokenizer")
    tokenizer, info = load_tokenizer(run_dir.root, record), record["tokenizer"]
    if hasattr(tokenizer, "with_languages"):   # M2M100/NLLB: the data's languages, kept in the record
        tokenizer = tokenizer.with_languages(src_lang, tgt_lang)
        languages = {"src_lang": tokenizer.src_lang, "tgt_lang": tokenizer.tgt_lang}
        info = {**info, **languages}
        if is_main_process():   # in the tokenizer folder's digest: data of other languages is encoded anew
            (run_dir.tokenizer_dir / "languages.json").write_text(json.dumps(languages) + "\n")
    return tokenizer, info
