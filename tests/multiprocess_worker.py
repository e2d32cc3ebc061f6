"""One process of the two-process trainer test (``tests/test_multiprocess.py``).

``python multiprocess_worker.py PORT PROCESS_ID CONFIG_JSON`` runs the whole trainer
(:func:`jaxformer.train.trainer.train`, as ``train.py`` does) as one of two processes of a
JAX cluster on localhost (CPU, gloo collectives), with the ``TrainConfig`` fields of
``CONFIG_JSON``, and prints its results as JSON (or, when it was preempted, the step
it stopped at). With ``SIGTERM_AT_STEP=N`` in its environment the process sends itself
SIGTERM before its N-th train step, as a preempting scheduler would; with
``SIGTERM_AT_STEP=restore`` right after it restored a checkpoint, still starting up.
From then on every step takes 0.3 s longer, so the preemption notice reaches the other
process well before the run's last step.

(The train step alone across processes was tested here too until the trainer test
covered it: equal losses and weights to one process over every step.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time


def _let_every_process_write_the_compilation_cache() -> None:
    """JAX writes persistent cache entries from process 0 only (for shared file systems;
    ``jax._src.compiler._cache_write``), and process 1's cache keys differ from process
    0's (its train step missed the entry process 0 had written). So process 1 compiled its ~60
    programs again at every launch of the test, the train step included (a launch took
    38 s, now 25 s). On one machine with one cache folder, each process writes its own
    keys. Only a speed-up: where JAX's internals differ, nothing is changed."""
    from jax._src import compiler, distributed

    write = getattr(compiler, "_cache_write", None)
    if write is None or not hasattr(distributed.global_state, "process_id"):
        return

    def cache_write(*args, **kwargs):
        process_id = distributed.global_state.process_id
        distributed.global_state.process_id = 0
        try:
            return write(*args, **kwargs)
        finally:
            distributed.global_state.process_id = process_id
    compiler._cache_write = cache_write


def main(port: str, process_id: int, config_json: str) -> None:
    import jax

    _let_every_process_write_the_compilation_cache()

    from jaxformer.run.config import TrainConfig
    from jaxformer.run.logs import console_logging
    from jaxformer.train import run_setup, trainer

    jax.config.update("jax_numpy_rank_promotion", "raise")
    console_logging()   # as train.py does
    signal_at = os.environ.get("SIGTERM_AT_STEP")
    signalled = [False]
    if signal_at == "restore":
        real_restore = run_setup.RunCheckpoints.restore_latest

        def restore_latest(*args, **kwargs):
            restored = real_restore(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)
            signalled[0] = True
            return restored
        run_setup.RunCheckpoints.restore_latest = restore_latest
    if signal_at is not None:
        real_run_programs = run_setup.run_programs

        def run_programs(*args, **kwargs):
            programs, calls = real_run_programs(*args, **kwargs), [0]

            def stepped(*a, **k):
                calls[0] += 1
                if signal_at.isdigit() and calls[0] == int(signal_at):
                    os.kill(os.getpid(), signal.SIGTERM)
                    signalled[0] = True
                if signalled[0]:
                    time.sleep(0.3)
                return programs.train_step(*a, **k)
            return dataclasses.replace(programs, train_step=stepped)
        run_setup.run_programs = run_programs

    # The trainer initialises jax.distributed itself, from the config.
    config = TrainConfig.flat(**json.loads(config_json), coordinator_address=f"localhost:{port}",
                         num_processes=2, process_id=process_id)
    try:
        output = {"results": trainer.train(config)}
    except trainer.Preempted as stop:
        output = {"preempted_at": stop.step, "signal": signal.Signals(stop.signum).name}
    print(json.dumps({"process": jax.process_index(), **output}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
