"""A run's CTranslate2 model, converted once per checkpoint and quantization and kept in
``RUN/ct2/<quantization>-<kind>-<step>-<fingerprint>/`` (:func:`cached_model`).

The checkpoint is found from the run's files alone (no JAX, no orbax), as
:meth:`~jaxformer.run.checkpoints.RunCheckpoints.restore_params` chooses it: ``"auto"`` the
best by dev BLEU, else the newest training checkpoint. Its fingerprint hashes the path, size
and modification time of every file of its parameters, so a checkpoint written again (a run
resumed, retrained, averaged anew) gets a new cache entry and the old one is never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

from jaxformer.interop.ct2 import EXPORTER_VERSION

CACHE = "ct2"   # the folder of a run that holds its CTranslate2 models


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a run: ``kind`` (``"best"``, ``"latest"``, ``"averaged"``, ``"step"``),
    its training ``step``, and the folder of its parameter files."""

    kind: str
    step: int
    files: Path

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the kind, step, and each file's relative path, size and mtime (ns)."""
        digest = hashlib.sha256(f"{self.kind} {self.step}".encode())
        for path in sorted(p for p in self.files.rglob("*") if p.is_file()):
            info = path.stat()
            digest.update(f"\n{path.relative_to(self.files)} {info.st_size} {info.st_mtime_ns}".encode())
        return digest.hexdigest()

    @property
    def which(self) -> str | int:
        """How :func:`jaxformer.interop.ct2.export_ct2` names it (a kind, never ``"auto"``)."""
        return self.step if self.kind in ("latest", "step") else self.kind


def _steps(folder: Path) -> list[int]:
    """The finished checkpoints' steps in ``folder`` (orbax's unfinished ones carry a suffix)."""
    return sorted(int(p.name) for p in folder.glob("*") if p.name.isdigit() and p.is_dir())


def _bleu(run: Path, step: int) -> float:
    try:
        return float(json.loads((run / "best" / str(step) / "metrics" / "metrics").read_text())["bleu"])
    except (OSError, ValueError, KeyError, TypeError):
        return float("-inf")


def find_checkpoint(workdir: str | Path, which: str | int = "auto") -> Checkpoint:
    """Checkpoint ``which`` (``"auto"``, ``"best"``, ``"latest"``, ``"averaged"`` or a step) of
    run ``workdir``. ``FileNotFoundError``: the run has none such; the message lists what it has."""
    run = Path(workdir)
    steps, best, averaged = (_steps(run / name) for name in ("checkpoints", "best", "averaged"))
    best = sorted(best, key=lambda step: _bleu(run, step))   # orbax keeps one; the best last
    found = {"best": ("best", best[-1:]), "averaged": ("averaged", averaged[-1:]),
             "latest": ("latest", steps[-1:])}
    found["auto"] = found["best"] if best else found["latest"]
    kind, chosen = found.get(str(which), ("step", [int(which)] if str(which).isdigit()
                                          and int(which) in steps else []))
    if not chosen:
        has = ", ".join(filter(None, (steps and f"training steps {steps}", best and "best",
                                      averaged and "averaged"))) or "no checkpoint"
        raise FileNotFoundError(f"No {which!r} checkpoint in {run}; it has {has}.")
    folder = {"best": "best", "averaged": "averaged"}.get(kind, "checkpoints")
    part = "state" if folder == "checkpoints" else "params"
    return Checkpoint(kind, chosen[0], run / folder / str(chosen[0]) / part)


def cached_model(workdir: str | Path, checkpoint: Checkpoint, quantization: str) -> Path:
    """The CTranslate2 model directory of ``checkpoint`` as ``quantization``: from the run's
    cache when its fingerprint matches, else converted now by
    :func:`jaxformer.interop.ct2.export_ct2` (this loads JAX) and cached, the run's older
    entries of this quantization removed. A run folder that cannot be written gets a temporary
    conversion, said on stderr. Errors: :func:`~jaxformer.interop.ct2.export_ct2`'s."""
    cache = Path(workdir) / CACHE
    # one entry per quantization and kind (and step, for a step asked by number): the older go
    stale = f"{quantization}-{checkpoint.kind}-{f'{checkpoint.step}-' if checkpoint.kind == 'step' else ''}"
    key = (f"{quantization}-{checkpoint.kind}-{checkpoint.step}-{checkpoint.fingerprint()[:16]}"
           f"-v{EXPORTER_VERSION}")   # a newer exporter's model is converted again
    if (cache / key / "model.bin").is_file():
        return cache / key
    from jaxformer.interop.ct2 import export_ct2  # a miss: JAX, and the quantization checked there

    try:
        cache.mkdir(exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache))
    except OSError as e:
        work = Path(tempfile.mkdtemp(prefix="jaxformer-ct2-"))
        print(f"note: {cache} cannot be written ({e.strerror}); the CTranslate2 model is converted into "
              f"{work} for this command only", file=sys.stderr)
        return export_ct2(workdir, work / "model", quantization=quantization, checkpoint=checkpoint.which)
    print(f"converting {checkpoint.kind} checkpoint step {checkpoint.step} to CTranslate2 ({quantization}) "
          f"into {cache / key}", file=sys.stderr)
    export_ct2(workdir, work / "model", quantization=quantization, checkpoint=checkpoint.which)
    for old in cache.glob(stale + "*"):
        shutil.rmtree(old, ignore_errors=True)
    try:
        (work / "model").rename(cache / key)
    except OSError:   # another process cached it first: theirs is the same
        pass
    shutil.rmtree(work, ignore_errors=True)
    return cache / key
