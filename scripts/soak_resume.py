"""Soak test of resume: SIGKILL the trainer at random moments, restart it, compare.

Run by hand (not in CI; a few minutes on 2 cores)::

    python scripts/soak_resume.py --kills 10

1. An uninterrupted reference run of ``train.py`` (tiny preset, dropout on, a
   checkpoint every few steps) on a slice of the shipped en-de corpus.
2. The same command in a second run directory, killed with SIGKILL at a random
   moment (start-up, a train step, or in the middle of an asynchronous checkpoint
   save), restarted, ``--kills`` times; then left to finish.
3. The final train states (step, parameters, Adam moments) must be bit-identical.

Each line of the log says when the kill landed, the newest complete checkpoint at
that moment, and whether the kill caught orbax mid-save (a temporary
``*.orbax-checkpoint-tmp*`` folder was left behind; the next start ignores and
removes it). Exit status 0 when the states match, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def write_corpus(root: Path) -> dict[str, Path]:
    from jaxformer.data import corpus

    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    short = [p for p in pairs if len(p[0]) < 60 and len(p[1]) < 60]
    files = {}
    for name, chunk in (("train", short[:3000]), ("dev", short[3000:3020]), ("test", short[3020:3040])):
        files[name] = root / f"{name}.tsv"
        files[name].write_text("".join(f"{s}\t{t}\n" for s, t in chunk))
    return files


def command(workdir: Path, files: dict[str, Path], steps: int, every: int) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), "--workdir", str(workdir),
            "--train-file", str(files["train"]), "--dev-file", str(files["dev"]),
            "--test-file", str(files["test"]), "--preset", "tiny", "--vocab-size", "300",
            "--max-len", "32", "--dropout-rate", "0.1", "--batch-tokens", "512",
            "--max-steps", str(steps), "--max-minutes", "1000", "--warmup-steps", "20",
            "--lr-scale", "1.0", "--eval-every", "100000", "--beam-size", "1",
            "--log-every", "5", "--checkpoint-every", str(every), "--no-progress"]


def newest_checkpoint(workdir: Path) -> tuple[int | None, set[str]]:
    """(newest complete step, names of half-written step folders)."""
    folder = workdir / "checkpoints"
    if not folder.exists():
        return None, set()
    names = [p.name for p in folder.iterdir()]
    steps = [int(n) for n in names if n.isdigit()]
    return (max(steps) if steps else None), {n for n in names if "orbax-checkpoint-tmp" in n}


def final_state(workdir: Path, step: int):
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(workdir.absolute() / "checkpoints" / str(step) / "state")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs before the run may finish")
    parser.add_argument("--steps", type=int, default=300, help="train steps of each run")
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="jaxformer-soak-"))
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    files = write_corpus(root)
    reference, soaked = root / "reference", root / "soaked"
    t0 = time.perf_counter()
    subprocess.run(command(reference, files, args.steps, args.checkpoint_every), env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"reference: {args.steps} steps uninterrupted in {time.perf_counter() - t0:.0f}s")
    shutil.copytree(reference / "tokenizer", soaked / "tokenizer")   # the same vocabulary

    # Kill moments by progress, not by the clock (start-up time varies with the load):
    # every 4th life dies during start-up; the others once a random number of new
    # steps is checkpointed, plus 0-300 ms, which lands in a train step or a save.
    rng = random.Random(args.seed)
    kills, mid_save = 0, 0
    budget = args.steps * 0.8 / args.kills   # new steps per life, on average
    while kills < args.kills:
        before, tmp_before = newest_checkpoint(soaked)
        during_startup = kills % 4 == 3
        target = (before or 0) + max(1, round(rng.uniform(0.2, 1.8) * budget))
        start = time.perf_counter()
        proc = subprocess.Popen(command(soaked, files, args.steps, args.checkpoint_every), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        while proc.poll() is None:
            newest, _ = newest_checkpoint(soaked)
            if during_startup and time.perf_counter() - start > rng.uniform(1.0, 4.0):
                break
            if not during_startup and newest is not None and newest >= target:
                time.sleep(rng.uniform(0.0, 0.3))
                break
            time.sleep(0.01)
        if proc.poll() is not None:
            if proc.returncode != 0:
                print(proc.stderr.read().decode()[-3000:])
                print(f"FAIL: a restart exited with status {proc.returncode}")
                return 1
            print("the run finished before its kill; stopping the kills here")
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        after, tmp_after = newest_checkpoint(soaked)
        tmp_left = bool(tmp_after - tmp_before)   # a save this life started and never finished
        mid_save += tmp_left
        moment = "during start-up" if during_startup else "while training"
        print(f"kill {kills:2d}: SIGKILL {moment}, {time.perf_counter() - start:5.1f}s after start; "
              f"newest complete checkpoint {before} -> {after}"
              f"{'; killed mid-save (temporary folder left)' if tmp_left else ''}")
    subprocess.run(command(soaked, files, args.steps, args.checkpoint_every), env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    import jax

    ref_state, soak_state = final_state(reference, args.steps), final_state(soaked, args.steps)
    ref_leaves, soak_leaves = jax.tree_util.tree_leaves(ref_state), jax.tree_util.tree_leaves(soak_state)
    same_tree = jax.tree_util.tree_structure(ref_state) == jax.tree_util.tree_structure(soak_state)
    equal = same_tree and all(np.array_equal(a, b) for a, b in zip(ref_leaves, soak_leaves))
    print(f"{kills} kills ({mid_save} mid-save); total {time.perf_counter() - t0:.0f}s")
    if equal:
        print(f"PASS: after {kills} SIGKILLs the final state at step {args.steps} equals the "
              f"uninterrupted run's bit for bit ({len(ref_leaves)} arrays: step, params, Adam moments)")
    else:
        diff = [i for i, (a, b) in enumerate(zip(ref_leaves, soak_leaves)) if not np.array_equal(a, b)]
        print(f"FAIL: {len(diff)} of {len(ref_leaves)} arrays differ (same tree structure: {same_tree})")
    if args.keep:
        print(f"files kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
