"""Which checkpoint of a run serves, found from its files alone (no JAX, no orbax): the one
checkpoint picker of translating, serving, exporting and fine-tuning (:func:`candidates`).

A run keeps ``checkpoints/<step>/state`` (the train state, its parameters under ``params``),
``best/<step>/params`` (the best dev BLEU's parameters; orbax keeps one) and
``averaged/<step>/params``. Orbax renames a step into place when it is complete, so a folder
named by digits alone is a finished one. Whether its files can be read only a restore tells
(:meth:`jaxformer.run.checkpoints.RunCheckpoints.restore_params` falls back along the list).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

KINDS = ("auto", "best", "latest", "averaged")   # besides a training step's number


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a run: ``kind`` (``"best"``, ``"latest"``, ``"averaged"`` or ``"step"``),
    its training ``step``, the orbax item folder of its parameters (``path``) and the key they
    sit under in it (``"params"`` in a train state; ``None``: the item is the parameters)."""

    kind: str
    step: int
    path: Path
    key: str | None = None

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the kind, step, and each file's relative path, size and mtime (ns):
        a checkpoint written again (a run resumed, retrained, averaged anew) gets another."""
        digest = hashlib.sha256(f"{self.kind} {self.step}".encode())
        for path in sorted(p for p in self.path.rglob("*") if p.is_file()):
            info = path.stat()
            digest.update(f"\n{path.relative_to(self.path)} {info.st_size} {info.st_mtime_ns}".encode())
        return digest.hexdigest()

    @property
    def name(self) -> str:
        """``"best checkpoint step 12"``, ``"checkpoint step 8"``: how messages name it."""
        return f"{'best checkpoint' if self.kind == 'best' else 'checkpoint'} step {self.step}"


def steps_in(folder: Path) -> list[int]:
    """The finished checkpoints' steps in ``folder``, oldest first (orbax's unfinished ones carry
    a suffix)."""
    return sorted(int(p.name) for p in folder.glob("*") if p.name.isdigit() and p.is_dir())


def _bleu(run: Path, step: int) -> float:
    """The dev BLEU saved with ``best/<step>`` (orbax's metrics file), or -inf."""
    try:
        return float(json.loads((run / "best" / str(step) / "metrics" / "metrics").read_text())["bleu"])
    except (OSError, ValueError, KeyError, TypeError):
        return float("-inf")


def candidates(workdir: str | Path, which: str | int = "auto") -> list[Checkpoint]:
    """The checkpoints that can serve ``which``, preferred first: ``"auto"`` the best by dev BLEU,
    then the training checkpoints newest first (a restore falls back along them); ``"best"``,
    ``"latest"``, ``"averaged"``: that one; a step number (an int or its digits): that
    training step. Raises ``FileNotFoundError`` when there is none; the message lists what the
    run has."""
    run = Path(workdir)
    steps, best, averaged = (steps_in(run / name) for name in ("checkpoints", "best", "averaged"))
    best = sorted(best, key=lambda step: _bleu(run, step))[-1:]   # orbax keeps one; the best last

    def trained(step: int, kind: str = "latest") -> Checkpoint:
        return Checkpoint(kind, step, run / "checkpoints" / str(step) / "state", "params")

    found = {"best": [Checkpoint("best", s, run / "best" / str(s) / "params") for s in best],
             "averaged": [Checkpoint("averaged", s, run / "averaged" / str(s) / "params")
                          for s in averaged[-1:]],
             "latest": [trained(s) for s in steps[-1:]]}
    found["auto"] = found["best"] + [trained(s) for s in steps[::-1]]
    step = int(which) if str(which).isdigit() else None
    chosen = found.get(str(which), [trained(step, "step")] if step in steps else [])
    if not chosen:
        what = ("checkpoint" if which == "auto" else f"checkpoint of step {which}" if step is not None
                else f"{which!r} checkpoint")
        has = ", ".join(filter(None, (steps and f"training steps {steps}", best and "best",
                                      averaged and "averaged"))) or "no checkpoint"
        raise FileNotFoundError(f"No {what} in {run}; it has {has}.")
    return chosen
