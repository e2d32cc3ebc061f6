"""The run directory: :class:`RunDir` owns the name of every file a run writes. Layout::

  config.json         model + run settings + tokenizer record (+ train_history)
  tokenizer/ prepared/   the sentencepiece model; the corpus as token ids + its fingerprint
  checkpoints/ best/ averaged/   orbax: last N train states + data positions; best dev
                      BLEU's parameters; the mean of the last N (--average-last), if better
  corrupt/            unreadable checkpoints moved aside (never deleted)
  metrics.jsonl tensorboard/ plots/   per logged step (metrics.redone.jsonl: set aside)
  samples.txt results.json test.src test.ref test.hyp   dev samples; test scores and text
  train.log jax_cache/   everything printed, with times; JAX's compilation cache
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from jaxformer.model.config import TransformerConfig
from jaxformer.run.logs import is_main_process, log


def _file(name: str) -> property:
    """A property: ``name`` in the run directory."""
    return property(lambda self: self.root / name, doc=f"``{name}`` in the run directory.")


@dataclasses.dataclass(frozen=True)
class RunDir:
    """The files of one run directory."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    # Every name a run writes; ``fresh`` moves exactly these.
    NAMES = ("checkpoints", "best", "averaged", "corrupt", "config.json", "tokenizer", "prepared",
             "metrics.jsonl", "metrics.redone.jsonl", "tensorboard", "plots", "samples.txt",
             "results.json", "test.src", "test.ref", "test.hyp", "train.log", "ct2")
    config, tokenizer_dir, prepared = _file("config.json"), _file("tokenizer"), _file("prepared")
    checkpoints, best, averaged = _file("checkpoints"), _file("best"), _file("averaged")
    corrupt = _file("corrupt")
    metrics, metrics_redone = _file("metrics.jsonl"), _file("metrics.redone.jsonl")
    tensorboard, plots, samples = _file("tensorboard"), _file("plots"), _file("samples.txt")
    results, log, jax_cache = _file("results.json"), _file("train.log"), _file("jax_cache")
    test_src, test_ref, test_hyp = _file("test.src"), _file("test.ref"), _file("test.hyp")

    def create(self, fresh: bool = False) -> Path | None:
        """Creates the directory; ``fresh`` moves the previous run's files into ``old-<time>/``
        (process 0) and returns it, else ``None``. Raises ``OSError`` naming an unwritable one."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe_writable(self.root)
        except OSError as e:
            why = "is a file, not a folder" if self.root.is_file() else f"cannot be written: {e}"
            raise OSError(f"--workdir {str(self.root)!r} {why}: choose another --workdir.") from e
        if fresh and is_main_process():
            present = [n for n in self.NAMES if (self.root / n).exists()]
            if present:
                old = Path(tempfile.mkdtemp(prefix=f"old-{time.strftime('%Y%m%d-%H%M%S')}-", dir=self.root))
                for name in present:
                    shutil.move(str(self.root / name), str(old / name))
                log(f"--fresh: moved the previous run's files to {old}")
                return old
        return None

    def remove_if_made_and_unprepared(self, made: Path | None) -> None:
        """After a failed start (process 0): removes :attr:`root` and its empty parents up to
        ``made`` (:func:`topmost_missing`), unless its data or tokenizer was prepared (reused next)."""
        if made is None or not self.root.exists() or not is_main_process():
            return
        if (self.prepared / "manifest.json").exists() or (self.tokenizer_dir / "spm.model").exists():
            return
        shutil.rmtree(self.root, ignore_errors=True)
        made, folder = made.absolute(), self.root.absolute().parent
        while folder != made.parent and folder.is_relative_to(made):
            try:
                folder.rmdir()   # only if empty
            except OSError:
                return
            folder = folder.parent

    def last_evaluated_step(self) -> int:
        """The latest step with a dev evaluation in ``metrics.jsonl`` (-1: none yet)."""
        if not self.metrics.exists():
            return -1
        rows = (json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip())
        return max((row["step"] for row in rows if "dev/bleu" in row), default=-1)

    def has_checkpoint(self, or_best: bool = False) -> bool:
        """Whether ``checkpoints/`` (or, ``or_best``, ``best/``) holds a complete (numbered) step."""
        folders = (self.checkpoints, self.best) if or_best else (self.checkpoints,)
        return any(p.name.isdigit() and p.is_dir() for folder in folders for p in folder.glob("*"))

    def read_config(self) -> dict[str, Any] | None:
        """``config.json``'s record, or ``None`` if there is none; raises as :meth:`read_run_record`."""
        return _read_record(self.config, need_model=False) if self.config.exists() else None

    def read_run_record(self) -> dict[str, Any]:
        """``config.json`` with its ``"model"`` section. Raises ``FileNotFoundError`` (not a run
        directory) or ``ValueError`` (damaged JSON, a Hugging Face folder, no ``"model"``, a
        section of the wrong JSON type), naming the fix."""
        return _read_record(self.config, need_model=True)


def set_aside_metrics_after(run_dir: RunDir, step: int) -> None:
    """On resume, moves ``metrics.jsonl`` rows after ``step`` (to be redone) to ``metrics.redone.jsonl``."""
    if not run_dir.metrics.exists():
        return
    lines = [line for line in run_dir.metrics.read_text().splitlines() if line.strip()]
    stale = [line for line in lines if json.loads(line)["step"] > step]
    if stale:
        with run_dir.metrics_redone.open("a") as f:
            f.write("\n".join(stale) + "\n")
        run_dir.metrics.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))


def check_resume_compatible(saved: dict[str, Any], model_config: TransformerConfig) -> None:
    """Raises ``ValueError`` naming every architecture field that differs from the saved run."""
    saved_model = saved.get("model", {})
    # How the weights are computed may change; a field missing from an older record has its default.
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    changeable = ("attention_backend", "remat", "scan_layers", "matmul_dtype")
    differing = {k: (saved_model.get(k, defaults[k]), v) for k, v in model_config.to_dict().items()
                 if k not in changeable and saved_model.get(k, defaults[k]) != v}
    if differing:
        fields = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in sorted(differing.items()))
        training_only = {"dropout_rate", "attention_dropout_rate", "dtype"}
        what = "another architecture" if set(differing) - training_only else "other model settings"
        tune = (" To train on with another --dropout-rate or --dtype, fine-tune from this run: "
                "jaxformer-train --init-from THIS_RUN --workdir NEW_RUN with the new flag."
                if set(differing) & training_only else "")
        raise ValueError(f"The run directory holds checkpoints of {what} ({fields}). "
                         f"Use the same flags to resume, another --workdir, or --fresh to start over.{tune}")


def _read_record(path: Path, need_model: bool) -> dict[str, Any]:
    """``config.json`` read and checked: the one reader of run records."""
    error, record = FileNotFoundError, None
    if not path.is_file():
        problem = (f"{path} not found: is {str(path.parent)!r} a jaxformer run directory? Train one with "
                   f"`jaxformer-train --workdir ...`, or convert a Hugging Face model with "
                   f"`jaxformer-convert --from-hf`.")
    else:
        error = ValueError
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            problem = _record_problem(path, record, need_model)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problem = (f"{path} is not readable JSON ({e}): the run record is damaged. Put back the file "
                       f"the run wrote (train.log also logs its model and run config), or, to train there "
                       f"anew, start over with jaxformer-train --fresh.")
    if problem:
        raise error(problem)
    return record


def _record_problem(path: Path, record: Any, need_model: bool) -> str | None:
    """What is wrong with a parsed run record, or ``None``."""
    if isinstance(record, dict) and "model_type" in record and "model" not in record:
        return (f"{path.parent} holds a Hugging Face model ({record['model_type']!r}), not a jaxformer "
                f"run: convert it with `jaxformer-convert --from-hf {path.parent} --workdir RUN` and use "
                f"RUN.")
    if not isinstance(record, dict) or (need_model and not isinstance(record.get("model"), dict)):
        return (f"{path} is not a jaxformer run record (a JSON object with a \"model\" section, written "
                f"by jaxformer-train or jaxformer-convert).")
    for key, kind in _RECORD_SECTIONS.items():
        if key in record and not isinstance(record[key], kind):
            return (f"{path}: its {key!r} section is {json.dumps(record[key])[:40]}, not a JSON "
                    f"{_JSON_NAMES[kind]}: the run record was edited or damaged. Put back the file the "
                    f"run wrote (train.log also logs its model and run config).")
    return None


# A run record's sections and their JSON types (``"train": null`` would fail far from the file).
_RECORD_SECTIONS = {"model": dict, "train": dict, "tokenizer": dict, "generation": dict,
                    "batch_rows": dict, "data": dict, "train_history": list, "target_language": str}
_JSON_NAMES = {dict: "object", list: "array", str: "string"}


def probe_writable(folder: str | os.PathLike) -> None:
    """Makes and removes a uniquely named file in ``folder``; ``OSError`` if none can be made."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".jaxformer-probe-"):
        pass


def topmost_missing(path: Path) -> Path | None:
    """The topmost missing folder of ``path`` (itself or an ancestor); ``None`` if it exists."""
    path = Path(path).absolute()
    try:
        return next((d for d in reversed([path, *path.parents]) if not d.exists()), None)
    except OSError:   # a parent that cannot be searched: RunDir.create names the problem
        return None


def resume_record(saved: dict[str, Any] | None, run_record: dict[str, Any], resumed: bool) -> dict[str, Any]:
    """The run record to write: on resume, earlier settings kept in a history, changes logged."""
    if not (resumed and saved):
        return run_record
    changed = {k: (saved.get("train", {}).get(k), v) for k, v in run_record["train"].items()
               if k != "progress" and saved.get("train", {}).get(k) != v}
    if changed:
        log("resuming with changed run settings: " +
            ", ".join(f"{k} {a!r} → {b!r}" for k, (a, b) in sorted(changed.items())))
    history = saved.get("train_history", []) + ([saved["train"]] if changed and "train" in saved else [])
    return {**run_record, "train_history": history} if history else run_record


def enable_compilation_cache(run_dir: RunDir, make: bool = True) -> bool:
    """JAX's persistent compilation cache in ``run_dir/jax_cache`` for every program, before the
    first compile; returns whether it is used. ``make``: made now (unwritable: no cache);
    else JAX makes it at the first compile and a cache folder chosen already is kept."""
    import jax  # here: reading a run directory (CTranslate2 serving) imports no JAX

    if make:
        try:
            run_dir.jax_cache.mkdir(exist_ok=True)
        except OSError:
            return False
        if not os.access(run_dir.jax_cache, os.W_OK):
            return False
    elif jax.config.jax_compilation_cache_dir:
        return False
    jax.config.update("jax_compilation_cache_dir", str(run_dir.jax_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return True


def keep_compilation_cache(run_dir: RunDir) -> bool:
    """:func:`enable_compilation_cache` for a training run (``make=False``)."""
    return enable_compilation_cache(run_dir, make=False)
