"""The training data's position in a checkpoint step, and continuing it on another number
of processes.

Each process saves its own position, ``data/process_<i>-of-<n>.json`` (grain's
checkpoint handler), and on a resume grain reads the file of the same index and count.
jaxformer's positions are global, not per process: every process plans the same global
batches and takes its own block of rows (:func:`jaxformer.data.streaming.process_plans`),
so all ``n`` files hold the same ``{"epoch", "block", "batch"}``. A run saved by ``n``
processes therefore continues exactly on ``m``, from that one position, as long as the
batches keep their rows: the trainer refuses a resume whose devices, accumulation steps
or process count change them, before any checkpoint is read, and a run whose rows were
not recorded (``config.json`` from before ``batch_rows``) only continues on ``n``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax

from jaxformer.model.validation import DataPositionError

_NAME = re.compile(r"process_(\d+)-of-(\d+)\.json")


def position_for_other_process_count(data_dir: Path, same_rows: bool = True
                                     ) -> tuple[dict[str, Any], int] | None:
    """The position a step saved with another number of processes than this run's, and
    that number; ``None`` when this number saved it (grain restores it) or when its files
    are not grain's ``process_<i>-of-<n>.json`` (left to the restore, which reports them).

    Args:
      same_rows: whether the caller checked that this run's batches have the rows the
        saved run's had (else another process count is refused).

    Raises:
      DataPositionError: files of several process counts (one run writes one count), or
        another number of processes saved it and ``same_rows`` is false, or one of their
        files is missing, or they disagree, so no one position can be continued (the
        message names the fix; a missing file is refused, not read as an unreadable
        step, since every step of the run would lack it).
    """
    saved: dict[int, set[int]] = {}
    for path in data_dir.glob("process_*-of-*.json"):
        if match := _NAME.fullmatch(path.name):
            saved.setdefault(int(match.group(2)), set()).add(int(match.group(1)))
    count = next(iter(saved)) if len(saved) == 1 else None
    if not saved or count == jax.process_count():
        return None
    fix = (f"Resume it with {count} process(es) (the --num-processes it ran with), or start a new "
           f"run from its weights in another --workdir (--init-from this run).")
    positions = [json.loads((data_dir / f"process_{i}-of-{count}.json").read_text())
                 for i in range(count)] if same_rows and count and saved[count] == set(range(count)) else []
    if len(saved) > 1:   # a stray file: grain would read this count's, maybe another run's
        problem = (f"it holds data positions saved by {sorted(saved)} processes, which one run never "
                   f"writes; remove the files of the count the run did not have, or start a new run from "
                   f"its weights in another --workdir (--init-from this run).")
    elif not same_rows:
        problem = (f"its data positions were saved by {count} process(es) and this run has "
                   f"{jax.process_count()}; its config.json does not record the rows of its batches, so "
                   f"another count may plan other batches. {fix}")
    elif not positions:
        problem = (f"its data positions were saved by {count} process(es), but only those of processes "
                   f"{sorted(saved[count])} are there. {fix}")
    elif any(position != positions[0] for position in positions):
        problem = (f"its {count} processes saved different data positions ({positions}), so it cannot "
                   f"continue on {jax.process_count()}. {fix}")
    else:
        return positions[0], count
    raise DataPositionError(problem)
