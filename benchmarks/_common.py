"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import argparse
import os
import statistics
import time


def usable_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def median_seconds(fn, repeats: int, warmup: bool = False) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls (after one untimed call if ``warmup``)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def alternating_median_seconds(fns, repeats: int) -> list[float]:
    """Median wall time of each ``fn()``, timed in turns (one untimed warm-up call each).

    Turns (a, b, a, b, ...) rather than all of ``a`` then all of ``b``: a drift of the
    machine's speed then hits every side of a ratio alike.
    """
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times):
            start = time.perf_counter()
            fn()
            fn_times.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def matmul_flops_per_s(n: int, repeats: int) -> float:
    """The machine's speed as the READMEs quote it: FLOP/s of a jitted float32 ``N×N`` by
    ``N×N`` ``jnp.dot`` (2·N³ FLOPs) on the default device, the median of ``repeats`` timed
    calls after one untimed one. About half a second on a 2-core CPU at N = 2048."""
    import jax
    import jax.numpy as jnp

    from jaxformer.run.platform import skip_absent_tpu

    skip_absent_tpu()   # libtpu installed on a CPU host: time the CPU, as the commands do
    a = jnp.full((n, n), 0.5, jnp.float32)   # the values do not change a float32 matmul's speed
    b = jnp.full((n, n), 0.25, jnp.float32)
    dot = jax.jit(jnp.dot)
    return 2 * n ** 3 / median_seconds(lambda: dot(a, b).block_until_ready(), repeats, warmup=True)


def add_model_arguments(parser: argparse.ArgumentParser, *, batch: int) -> None:
    """The model-size flags both comparisons share (the issue's config by default)."""
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3, help="encoder and decoder layers each")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--src-len", type=int, default=32)


def write_between_markers(path, markers: tuple[str, str], lines: list[str]) -> None:
    """Replaces what lies between ``markers`` (begin, end) in the text file ``path`` with ``lines``."""
    from pathlib import Path

    path = Path(path)
    text = path.read_text()
    start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    path.write_text(text[:start] + "\n" + "\n".join(lines) + "\n" + text[end:])


def publish(lines: list[str], path, markers: tuple[str, str]) -> None:
    """Prints a result table and, when ``path`` is given (a script's ``--write``), puts it
    between ``markers`` there."""
    print("\n" + "\n".join(lines))
    if path:
        write_between_markers(path, markers, lines)
        print(f"wrote the table into {path}")
