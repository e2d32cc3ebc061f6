"""Run messages: one place that decides where a line goes.

Lines are written above the progress bar (``tqdm.write``), and in a multi-process run
only process 0 speaks.
"""

from __future__ import annotations

import jax
from tqdm import tqdm


def is_main_process() -> bool:
    """Process 0 writes the run's logs and records; every process writes checkpoints."""
    return jax.process_index() == 0


def log(message: str) -> None:
    """Prints ``message`` above the progress bar; in a multi-process run only process 0 speaks."""
    if is_main_process():
        tqdm.write(message)
