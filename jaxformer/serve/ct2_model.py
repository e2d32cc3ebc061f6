"""A run's CTranslate2 model, converted once per checkpoint, quantization and exporter version
and kept in ``RUN/ct2/<quantization>-<kind>-<step>-<fingerprint>-v<version>/``
(:func:`cached_model`), or, where the run folder cannot be written, in the user's cache
(``$XDG_CACHE_HOME/jaxformer/ct2/<the run's path hashed>/``, default ``~/.cache``).

The checkpoint is the run's choice (:attr:`jaxformer.decode.served_run.ServedRun.checkpoint`,
found from its files: no JAX, no orbax). Its fingerprint hashes the path, size and
modification time of every file of its parameters, so a checkpoint written again (a run
resumed, retrained, averaged anew) gets a new cache entry and the old one is removed. A
conversion works in a hidden folder of the cache named after its process, removed when it
ends (an error, ``SIGTERM`` or ``SIGHUP`` included); one left by a process killed outright is
removed by the next conversion.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxformer.decode.served_run import ServedRun
from jaxformer.interop.ct2 import EXPORTER_VERSION, check_quantization, write_ct2
from jaxformer.run.checkpoint_files import Checkpoint
from jaxformer.run.directory import probe_writable

CACHE = "ct2"   # the folder of a run that holds its CTranslate2 models


def cache_folder(run: ServedRun) -> Path:
    """``RUN/ct2`` (made now) where the run folder can be written, else the user's cache folder
    for this run (made now; said on stderr). Raises ``OSError`` when neither can be written."""
    inside = run.root / CACHE
    try:
        inside.mkdir(exist_ok=True)
        probe_writable(inside)
        return inside
    except OSError as e:
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        named = hashlib.sha256(str(run.root.resolve()).encode()).hexdigest()[:16]
        outside = home / "jaxformer" / CACHE / named
        outside.mkdir(parents=True, exist_ok=True)
        print(f"note: {inside} cannot be written ({e.strerror}); the CTranslate2 model is cached in "
              f"{outside}", file=sys.stderr)
        return outside


def _key(checkpoint: Checkpoint, quantization: str) -> str:
    fingerprint = checkpoint.fingerprint()[:16]
    return f"{quantization}-{checkpoint.kind}-{checkpoint.step}-{fingerprint}-v{EXPORTER_VERSION}"


def _stale_prefix(checkpoint: Checkpoint, quantization: str) -> str:
    """The names of this quantization and kind's older entries (and step, for a step by number)."""
    return f"{quantization}-{checkpoint.kind}-{f'{checkpoint.step}-' if checkpoint.kind == 'step' else ''}"


def _remove_abandoned(cache: Path) -> None:
    """Removes the work folders (``.<key>-<pid>-…``) of conversions whose process is gone."""
    for folder in cache.glob(".*-*-*"):
        pid = folder.name.rsplit("-", 2)[-2]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


def cached_model(run: ServedRun, quantization: str) -> tuple[Path, Checkpoint]:
    """``(model directory, checkpoint)``: the CTranslate2 model of ``run``'s checkpoint as
    ``quantization``, from the cache when its key matches, else converted now
    (:func:`jaxformer.interop.ct2.write_ct2`; this loads JAX, and falls back from an unreadable
    best checkpoint to the latest, whose model it caches) with the older entries of this
    quantization and kind removed. Errors: :func:`~jaxformer.interop.ct2.export_ct2`'s,
    ``OSError`` from :func:`cache_folder`."""
    cache, checkpoint = cache_folder(run), run.checkpoint
    if (cache / _key(checkpoint, quantization) / "model.bin").is_file():
        return cache / _key(checkpoint, quantization), checkpoint
    check_quantization(quantization)
    _remove_abandoned(cache)
    work = Path(tempfile.mkdtemp(prefix=f".{_key(checkpoint, quantization)}-{os.getpid()}-", dir=cache))
    with _removed_at_exit(work):
        params, checkpoint = run.restore_params()
        key = _key(checkpoint, quantization)
        print(f"converting {checkpoint.kind} checkpoint step {checkpoint.step} to CTranslate2 "
              f"({quantization}) into {cache / key}", file=sys.stderr)
        write_ct2(run, params, work / "model", quantization)
        for old in cache.glob(_stale_prefix(checkpoint, quantization) + "*"):
            shutil.rmtree(old, ignore_errors=True)
        try:
            (work / "model").rename(cache / key)
        except OSError:   # another process cached it first: theirs is the same
            pass
    return cache / key, checkpoint


@contextlib.contextmanager
def _removed_at_exit(folder: Path) -> Iterator[None]:
    """Removes ``folder`` when the block ends, an error included, and when ``SIGTERM`` or ``SIGHUP``
    stops the process inside it (in the main thread; the signal then goes on to the handler it
    had, so the process ends as it would have)."""
    previous: dict[int, Any] = {}

    def on_signal(signum: int, frame) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        signal.signal(signum, previous.pop(signum))
        os.kill(os.getpid(), signum)

    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
