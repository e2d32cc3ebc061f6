"""Whether a run's data (:class:`jaxformer.data.prepare.DataSpec`) is reused, prepared or
refused: every start compares its fingerprint with the one ``prepared/manifest.json``
records; equal, the prepared data is reused; different in a run with checkpoints, an error
naming what differs and the fix; different before any checkpoint, prepared again.
:func:`corpus_shape` is what the recipe rule reads of the corpus before any of that.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxformer.data.prepare import DataSpec, FirstPass, finish_tokenizer_move, first_pass, prepare
from jaxformer.data.prepared import PreparedCorpus, read_manifest, tokenizer_digest
from jaxformer.run.logs import log
from jaxformer.run.recipe import CorpusShape

if TYPE_CHECKING:
    from jaxformer.data.tokenizer import TextTokenizer
    from jaxformer.run.config import TrainConfig
    from jaxformer.run.directory import RunDir


def fingerprint_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The differences between two fingerprints, one line each (none if equal)."""
    def brief(value):
        if isinstance(value, list):
            return [brief(v) for v in value]
        if isinstance(value, dict) and "path" in value:
            return f"{value['path']} ({value['size']} bytes, sha256 {value['sha256'][:12]})"
        return value

    def differences(prefix: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
        out = []
        for key in sorted(set(a) | set(b)):
            old, new = a.get(key), b.get(key)
            if old == new:
                continue
            if isinstance(old, dict) and isinstance(new, dict) and "path" not in old and "path" not in new:
                out += differences(f"{prefix}{key}.", old, new)   # name the field inside, not the whole
            else:
                out.append(f"{prefix}{key}: {brief(old)!r} before, {brief(new)!r} now")
        return out

    return differences("", saved, now)


def same_data(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether two fingerprints are equal but for the files' paths (a moved corpus is the same data)."""
    def content(value):
        if isinstance(value, dict):
            return {k: content(v) for k, v in value.items() if k != "path"}
        if isinstance(value, list):
            return [content(v) for v in value]
        return value

    return content(saved) == content(now)


def check_prepared(spec: DataSpec, directory: Path, tokenizer_file: Path, *,
                   has_checkpoints: bool, recorded: dict[str, Any] | None = None
                   ) -> tuple[dict[str, Any], str]:
    """``(the inputs' fingerprint, action)``: ``"reuse"``, ``"encode"`` (same data, another
    tokenizer), ``"prepare"`` (none yet, or ``prepared/`` gone from a run whose record says the
    same data) or ``"retrain"`` (the data changed and there are no checkpoints). ``recorded``:
    the run record's fingerprint (``config.json``'s ``"data"``). Raises ValueError: checkpoints
    of other data, or of data nothing describes; names the fix."""
    fingerprint = spec.fingerprint()
    manifest = read_manifest(directory)
    if manifest is not None and same_data(manifest.get("fingerprint", {}), fingerprint):
        same_tokenizer = (tokenizer_file.exists()
                          and tokenizer_digest(tokenizer_file) == manifest["tokenizer"]["sha256"])
        return fingerprint, "reuse" if same_tokenizer else "encode"
    if not has_checkpoints:
        return fingerprint, "prepare" if manifest is None else "retrain"
    trained_on = manifest.get("fingerprint", {}) if manifest is not None else recorded
    if trained_on is None or not same_data(trained_on, fingerprint):
        fresh = "--fresh of train.py / jaxformer-train moves the old run aside"
        raise ValueError(
            f"The run directory {str(directory.parent)!r} holds checkpoints, but neither "
            f"{directory / 'manifest.json'} (missing or unreadable) nor its config.json says which data "
            f"they were trained on. "
            f"Put back its prepared/ folder; or, if these flags name its data (config.json's \"train\" "
            f"and train.log list them), move its checkpoints/ aside, run jaxformer-prepare with them, "
            f"and move checkpoints/ back; or start this run over on the flags' data ({fresh})."
            if trained_on is None else
            f"The run directory {str(directory.parent)!r} holds a run trained on other data "
            f"({'; '.join(fingerprint_differences(trained_on, fingerprint))}). Resume with the data flags "
            f"it was started with, choose another --workdir for the new data, or start this run over on "
            f"the new data ({fresh}).")
    return fingerprint, "prepare"   # prepared/ is gone: the same inputs and settings again


def _copy_back(previous: Path | None, fingerprint: dict[str, Any], directory: Path,
               tokenizer_file: Path) -> bool:
    """Copies back the prepared data and tokenizer ``--fresh`` moved to ``previous`` when they
    were made from the same inputs and settings (preparing is deterministic) and with the
    run's tokenizer, if it has one; returns whether it did."""
    if previous is None:
        return False
    old_prepared = previous / directory.name
    old_tokenizer = previous / tokenizer_file.relative_to(directory.parent)
    manifest = read_manifest(old_prepared)
    if manifest is None or not same_data(manifest.get("fingerprint", {}), fingerprint) \
            or not old_tokenizer.exists():
        return False
    wanted = manifest["tokenizer"]["sha256"]
    if tokenizer_digest(old_tokenizer) != wanted or (
            tokenizer_file.exists() and tokenizer_digest(tokenizer_file) != wanted):
        return False
    if not tokenizer_file.exists():
        tokenizer_file.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if old_tokenizer.is_dir() else shutil.copy2)(old_tokenizer, tokenizer_file)
    shutil.copytree(old_prepared, directory, dirs_exist_ok=True)
    return True


def ensure_prepared(spec: DataSpec, directory: Path, tokenizer_file: Path, *, has_checkpoints: bool,
                    seed: int = 0, write: bool = True, tokenizer: TextTokenizer | None = None,
                    previous: Path | None = None, recorded: dict[str, Any] | None = None,
                    first: FirstPass | None = None) -> None:
    """Makes ``directory`` hold ``spec``'s prepared data: reused, copied back from ``previous``
    (:func:`_copy_back`) or prepared (:func:`check_prepared`; ``first``: the corpus's first
    pass, if read already). ``write=False`` (a multi-process run's other processes): only the
    check, so every process raises the same error.
    """
    if write:   # a prepare killed after committing its data: its tokenizer moves in now
        finish_tokenizer_move(directory, tokenizer_file)
    fingerprint, action = check_prepared(spec, directory, tokenizer_file, has_checkpoints=has_checkpoints,
                                         recorded=recorded)
    if action == "reuse":
        log(f"prepared data: reusing {directory}")
    elif write and action != "encode" and _copy_back(previous, fingerprint, directory, tokenizer_file):
        log(f"prepared data: the same inputs and settings as the run --fresh moved to {previous}; "
            f"copied its prepared data and tokenizer back instead of preparing again")
    elif write:
        if action == "encode":
            log(f"prepared data: {tokenizer_file} is not the tokenizer {directory} was encoded with; "
                f"encoding again")
        prepare(spec, directory, tokenizer_file, retrain_tokenizer=action == "retrain" and tokenizer is None,
                seed=seed, tokenizer=tokenizer, first=first)


def prepare_run_data(cfg: TrainConfig, run_dir: RunDir, *, has_checkpoints: bool,
                     tokenizer: TextTokenizer | None = None, previous: Path | None = None,
                     first: FirstPass | None = None) -> PreparedCorpus:
    """A run directory's prepared data, prepared first (by process 0) if missing or stale.
    ``tokenizer``: encode with this one (the ``--init-from`` run's) instead of ``spm.model``;
    ``previous``: the folder ``--fresh`` moved the run's files to; ``first``: the corpus's
    first pass, read for the recipe (:func:`corpus_shape`). Raises ValueError: bad corpus
    flags or corpus, or checkpoints of other data. PreparedDataError: a prepared file is
    truncated or corrupt."""
    import jax

    spec = DataSpec.from_config(cfg)
    directory = run_dir.prepared
    tokenizer_file = run_dir.tokenizer_dir if tokenizer is not None else run_dir.tokenizer_dir / "spm.model"
    recorded = (run_dir.read_config() or {}).get("data") if has_checkpoints else None
    ensure_prepared(spec, directory, tokenizer_file, has_checkpoints=has_checkpoints,
                    write=jax.process_index() == 0, tokenizer=tokenizer, previous=previous,
                    recorded=recorded, first=first)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("prepared data")
    return PreparedCorpus.open(directory)


# The fingerprint's parts that decide which pairs are read and which of them train.
_SHAPE_INPUTS = ("format_version", "corpus", "aligned", "dev_file", "test_file")


def corpus_shape(cfg: TrainConfig, directory: Path) -> tuple[CorpusShape, FirstPass | None]:
    """The :class:`CorpusShape` of the training pairs ``cfg`` names, and the first pass read for
    it (to hand to the prepare, which then reads the corpus once more, not twice): the shape
    ``directory/manifest.json`` records when its data came from the same files and splits
    (``None``: nothing read), else one streamed pass (:func:`jaxformer.data.prepare.first_pass`).
    Raises ValueError / FileNotFoundError: bad corpus flags or files; OSError: unreadable."""
    spec = DataSpec.from_config(cfg)
    now = spec.fingerprint()   # every input file checked, as the prepare would
    manifest = read_manifest(directory) or {}
    shape, before = manifest.get("corpus_shape"), manifest.get("fingerprint", {})
    fields = {f.name for f in dataclasses.fields(CorpusShape)}
    if isinstance(shape, dict) and set(shape) == fields and same_data(
            {k: before.get(k) for k in _SHAPE_INPUTS}, {k: now.get(k) for k in _SHAPE_INPUTS}):
        return CorpusShape(**shape), None
    first = first_pass(spec)
    return first.shape, first
