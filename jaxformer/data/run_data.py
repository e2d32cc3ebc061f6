"""Which data a run belongs to: the data's description, its fingerprint, and the
decision to reuse, prepare or refuse.

A run directory's ``prepared/manifest.json`` records the fingerprint of the data the
run was prepared from (:meth:`DataSpec.fingerprint`: every input file's path, size
and SHA-256, and the settings that change the ids). On every start the fingerprint
of the flags' data is compared with it: equal, the prepared data is reused; different
in a run that has checkpoints, it is an error naming what differs and the fix;
different before any checkpoint, the data is prepared again.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxformer.data.prepare import finish_tokenizer_move, prepare
from jaxformer.data.prepared import (
    PreparedCorpus,
    read_manifest,
    tokenizer_digest,
)
from jaxformer.data.spec import DataSpec
from jaxformer.run.logs import log

if TYPE_CHECKING:
    from jaxformer.data.tokenizer import TextTokenizer
    from jaxformer.run.config import TrainConfig
    from jaxformer.run.directory import RunDir


def fingerprint_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Human-readable differences between two :meth:`DataSpec.fingerprint` s (empty if equal)."""
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
    """Whether two fingerprints describe the same data: equal but for the files' paths (a
    moved repository or corpus is the same data when its bytes are)."""
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
    """What :func:`ensure_prepared` must do: ``"reuse"``, ``"encode"`` (same data, another
    tokenizer), ``"prepare"`` (no prepared data yet) or ``"retrain"`` (the data changed
    and the run has no checkpoints: prepare it and train a new tokenizer).

    ``recorded``: the fingerprint the run record (``config.json``, ``"data"``) keeps,
    what a run with checkpoints is checked against when ``prepared/`` is gone (deleted
    to save space, or damaged).

    Returns:
      ``(the inputs' fingerprint, action)``.

    Raises:
      ValueError: the run has checkpoints of other data, or of data neither ``prepared/``
        nor the run record describes; the message names what differs and the fix.
    """
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
            f"{directory / 'manifest.json'} (missing or unreadable) nor its config.json (from before "
            f"jaxformer recorded it there) says which data they were trained on, so a resume could "
            f"continue on other data. Put back its prepared/ folder; or, if these flags name the data "
            f"it was started with (config.json's \"train\" and train.log list them), move its "
            f"checkpoints/ aside, run jaxformer-prepare with them, and move checkpoints/ back; or start "
            f"this run over on the flags' data ({fresh})." if trained_on is None else
            f"The run directory {str(directory.parent)!r} holds a run trained on other data "
            f"({'; '.join(fingerprint_differences(trained_on, fingerprint))}). Resume with the data flags "
            f"it was started with, choose another --workdir for the new data, or start this run over on "
            f"the new data ({fresh}).")
    return fingerprint, "prepare"   # prepared/ is gone: the same inputs and settings again


def _copy_back(previous: Path | None, fingerprint: dict[str, Any], directory: Path,
               tokenizer_file: Path) -> bool:
    """Copies the prepared data and tokenizer that ``--fresh`` moved to ``previous`` back
    when they were made from the same inputs and settings (what preparing again would
    write: the tokenizer sample and the encoding are deterministic) and the run's
    tokenizer, if it already has one, is the one they were encoded with."""
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
        if old_tokenizer.is_dir():
            shutil.copytree(old_tokenizer, tokenizer_file)
        else:
            shutil.copy2(old_tokenizer, tokenizer_file)
    shutil.copytree(old_prepared, directory, dirs_exist_ok=True)
    return True


def ensure_prepared(spec: DataSpec, directory: Path, tokenizer_file: Path, *, has_checkpoints: bool,
                    seed: int = 0, write: bool = True, tokenizer: TextTokenizer | None = None,
                    previous: Path | None = None, recorded: dict[str, Any] | None = None) -> None:
    """Makes ``directory`` hold ``spec``'s prepared data: reused when its manifest matches,
    copied back from ``previous`` (the folder ``--fresh`` moved the last run to) when that
    was prepared from the same inputs and settings, else prepared (again) — see
    :func:`check_prepared`. With ``write=False`` (the other processes of a multi-process
    run) only the check runs, so every process raises the same error.

    Raises:
      ValueError: the run has checkpoints of other data (see :func:`check_prepared`).
    """
    if write:   # a prepare killed after committing its data: its tokenizer moves in now
        finish_tokenizer_move(directory, tokenizer_file)
    fingerprint, action = check_prepared(spec, directory, tokenizer_file, has_checkpoints=has_checkpoints,
                                         recorded=recorded)
    if action == "reuse":
        log(f"prepared data: reusing {directory}")
        return
    if write and action != "encode" and _copy_back(previous, fingerprint, directory, tokenizer_file):
        log(f"prepared data: the same inputs and settings as the run --fresh moved to {previous}; "
            f"copied its prepared data and tokenizer back instead of preparing again")
        return
    if write:
        if action == "encode":
            log(f"prepared data: {tokenizer_file} is not the tokenizer {directory} was encoded with; "
                f"encoding again")
        prepare(spec, directory, tokenizer_file, retrain_tokenizer=action == "retrain" and tokenizer is None,
                seed=seed, tokenizer=tokenizer)


def prepare_run_data(cfg: TrainConfig, run_dir: RunDir, *, has_checkpoints: bool,
                     tokenizer: TextTokenizer | None = None, previous: Path | None = None
                     ) -> PreparedCorpus:
    """The prepared data of a run directory (``prepared/``, ``tokenizer/spm.model``),
    prepared first if missing or stale. In a multi-process run process 0 prepares and the
    others wait for it. ``tokenizer``: encode with this one (fine-tuning: the ``--init-from``
    run's, copied into ``tokenizer/``) instead of training or reading ``spm.model``.
    ``previous``: the folder ``--fresh`` just moved the run's files to (its prepared data
    is copied back when it matches; see :func:`ensure_prepared`).

    Raises:
      ValueError: bad corpus flags, an unusable corpus, or checkpoints of other data.
      PreparedDataError: a prepared file is truncated or corrupt.
    """
    import jax

    spec = DataSpec.from_config(cfg)
    directory = run_dir.prepared
    tokenizer_file = run_dir.tokenizer_dir if tokenizer is not None else run_dir.tokenizer_dir / "spm.model"
    recorded = (run_dir.read_config() or {}).get("data") if has_checkpoints else None
    ensure_prepared(spec, directory, tokenizer_file, has_checkpoints=has_checkpoints,
                    write=jax.process_index() == 0, tokenizer=tokenizer, previous=previous,
                    recorded=recorded)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("prepared data")
    return PreparedCorpus.open(directory)
