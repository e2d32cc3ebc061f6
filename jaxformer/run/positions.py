"""A checkpoint's data position continued on another number of processes: each of ``n``
saves ``data/process_<i>-of-<n>.json``, all the same global position, so ``m`` processes
continue it exactly while the batches keep their rows (the trainer checks ``batch_rows``)."""

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
    """``(position, count)`` saved by another process count than this run's; ``None`` when this
    count saved it (grain restores it) or there are none. ``same_rows``: the batches keep
    their rows. Raises ``DataPositionError`` naming the fix (several counts, another count
    without ``same_rows``, a process's file missing, positions that disagree)."""
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
