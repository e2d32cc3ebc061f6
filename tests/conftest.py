"""Test strictness, set before JAX initialises its backends.

* 8 fake CPU devices, so every sharding path runs on a laptop or CI.
* XLA's CPU backend at optimization level 0: the suite's tiny programs spend far
  more time compiling than running, and the tests check what they compute, not how
  fast (``tests/test_training.py`` and ``tests/test_packing.py``: 127 s → 86 s).
* XLA's CPU fusion emitters off where this jaxlib has the flag: its older elemental
  emitter compiles small programs ~1.5× faster, and the tests' eager operations and
  tiny models compile hundreds of them (``tests/test_scan.py`` and
  ``tests/test_decoding.py`` with a cold cache: 184 s → 124 s at ~100 GFLOP/s).
* ``jax_numpy_rank_promotion="raise"``: implicit rank broadcasting is an error.
* JAX's persistent compilation cache in ``.pytest_cache/jax-compilation-cache``: the
  suite compiles the same tiny-model programs again and again (every ``train()`` call,
  every subprocess, both xdist workers); from the cache each costs milliseconds, not
  seconds. Set through the environment, so subprocesses share it. Cache keys cover
  the program, the compile options and the JAX version, so a stale entry is never used.
"""

import mmap
import os
from pathlib import Path

import jaxlib


def _xla_has_flag(name: str) -> bool:
    """Whether this jaxlib's XLA defines ``--name`` (an unknown flag in XLA_FLAGS is fatal)."""
    library = Path(jaxlib.__file__).with_name("libjax_common.so")
    if not library.is_file():
        return False
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as image:
        return image.find(b"\0" + name.encode() + b"\0") >= 0   # the flag's registered name


# The compile settings of every program the tests build, subprocesses' included (the
# `xla_flags` fixture gives them with another device count).
COMPILE_FLAGS = " ".join(["--xla_backend_optimization_level=0"] + [
    "--xla_cpu_use_fusion_emitters=false"] * _xla_has_flag("xla_cpu_use_fusion_emitters"))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 "
                           + COMPILE_FLAGS).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax-compilation-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402

from jaxformer.data import corpus  # noqa: E402
from jaxformer.run.logs import console_logging  # noqa: E402

# What the command-line programs do first; the tests read train()'s console output.
console_logging()


@pytest.fixture(scope="session")
def xla_flags():
    """``xla_flags(devices)``: XLA_FLAGS for a test's subprocess with ``devices`` fake CPU
    devices (None: JAX's one), compiled as the rest of the suite is."""
    def flags(devices: int | None = None) -> str:
        return (f"--xla_force_host_platform_device_count={devices} " * (devices is not None)) + COMPILE_FLAGS
    return flags


@pytest.fixture(scope="session")
def short_corpus(tmp_path_factory):
    """Short pairs of the shipped en-de corpus as TSV files: 2,000 train, 12 dev, 12 test.

    Small enough that a tiny-preset run takes seconds; used by the resilience and the
    multi-process trainer tests. Returns ``{"train"|"dev"|"test": Path}``.
    """
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    short = [p for p in pairs if len(p[0]) < 60 and len(p[1]) < 60]
    root = tmp_path_factory.mktemp("corpus")
    out = {}
    for name, chunk in (("train", short[:2000]), ("dev", short[2000:2012]), ("test", short[2012:2024])):
        out[name] = root / f"{name}.tsv"
        out[name].write_text("".join(f"{s}\t{t}\n" for s, t in chunk))
    return out


# The longest modules first. Under --dist loadfile (pyproject.toml) each xdist worker takes
# the next module when it is about to finish one, in collection order (pyproject.toml also
# sets --no-loadscope-reorder: xdist's default orders the modules by their number of tests,
# which put the one-test, 1.5-minute test_multiprocess last in the queue). Started first, the
# long ones do not leave one worker running a long module alone at the end (longest-first
# scheduling). Seconds of each module on a clean clone with 2 workers (commit 59a2249,
# 68-71 GFLOP/s): compile 95, bulk_translate 86, sharding 85, multiprocess 83 (one test,
# so it starts first), hf_marian 82, train_e2e 76, resilience 71, training 65, cli 53,
# scan 52, decoding 49, model 48, packing 39; the rest 25 or less.
_LONGEST_FIRST = ("test_multiprocess.py", "test_compile.py", "test_bulk_translate.py", "test_serve.py",
                  "test_sharding.py", "test_hf_marian.py", "test_train_e2e.py", "test_resilience.py",
                  "test_training.py", "test_cli.py", "test_scan.py", "test_decoding.py", "test_model.py",
                  "test_packing.py")


@pytest.fixture
def killed_at_chunk(monkeypatch):
    """``with killed_at_chunk(n): translate(...)``: the translate tool's n-th chunk raises
    ``KeyboardInterrupt`` (a bulk job killed mid-file, its earlier chunks written), which the
    block expects; after it, the real chunk translator is back."""
    import contextlib

    from jaxformer.cli import translate as translate_lib

    @contextlib.contextmanager
    def kill(n: int):
        real, calls = translate_lib._translate_lines, []

        def interrupted(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(translate_lib, "_translate_lines", interrupted)
        try:
            with pytest.raises(KeyboardInterrupt):
                yield
        finally:
            monkeypatch.setattr(translate_lib, "_translate_lines", real)

    return kill


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable within a module
