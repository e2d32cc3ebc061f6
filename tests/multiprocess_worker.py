"""One process of the two-process training test (``tests/test_multiprocess.py``).

``python multiprocess_worker.py PORT PROCESS_ID`` joins a 2-process JAX cluster on
localhost (CPU, gloo collectives), trains a few steps on a ``data=4,model=2`` mesh over
both processes' devices, feeding only this process's rows, and prints the losses as
JSON. :func:`train_losses` is also the single-process reference.

``python multiprocess_worker.py PORT PROCESS_ID CONFIG_JSON`` runs the whole trainer
(:func:`jaxformer.trainer.train`, as ``train.py`` does) as one of the two processes,
with the ``TrainConfig`` fields of ``CONFIG_JSON``, and prints its results as JSON
(or, when it was preempted, the step it stopped at). With ``SIGTERM_AT_STEP=N`` in
its environment the process sends itself SIGTERM before its N-th train step, as a
preempting scheduler would; with ``SIGTERM_AT_STEP=restore`` right after it restored a
checkpoint, still starting up. From then on every step takes 0.3 s longer, so the
preemption notice reaches the other process well before the run's last step.
"""

from __future__ import annotations

import json
import sys

import numpy as np

VOCAB, PAD, BOS, EOS = 16, 0, 2, 3


def global_batch(seed: int, rows: int = 8, length: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = np.full((rows, length), PAD, np.int32)
    tgt_in, tgt_out = src.copy(), src.copy()
    for r in range(rows):
        n = int(rng.integers(2, length))
        body = rng.integers(4, VOCAB, n)
        src[r, :n], tgt_in[r, :n + 1], tgt_out[r, :n + 1] = body, [BOS, *body], [*body, EOS]
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}


def train_losses(mesh_spec: str = "data=4,model=2", steps: int = 3) -> list[float]:
    """Losses of ``steps`` Adam steps; each process feeds its own block of rows."""
    import jax

    import jaxformer as jf
    from jaxformer import sharding, training

    config = jf.preset("tiny", src_vocab_size=VOCAB, max_len=16, num_encoder_layers=1,
                       num_decoder_layers=1)
    model = jf.Transformer(config)
    tx = training.make_optimizer(training.transformer_schedule(32, 10, scale=2.0))
    state, layout = training.create_sharded_train_state(model, jax.random.key(0), tx,
                                                        sharding.make_mesh(mesh_spec))
    step = training.jit_train_step(model, 0.1, layout=layout)
    losses = []
    for i in range(steps):
        batch = global_batch(i)
        rows = batch["src"].shape[0] // jax.process_count()
        start = jax.process_index() * rows
        local = {k: v[start:start + rows] for k, v in batch.items()}
        state, metrics = step(state, sharding.shard_batch(local, layout.batch), jax.random.key(1))
        losses.append(float(metrics["loss_sum"] / metrics["tokens"]))
    return losses


if __name__ == "__main__":
    import jax

    from jaxformer import sharding

    port, process_id = sys.argv[1], int(sys.argv[2])
    jax.config.update("jax_numpy_rank_promotion", "raise")
    if len(sys.argv) > 3:   # the trainer initialises jax.distributed itself, from the config
        import os
        import signal
        import time

        from jaxformer import trainer
        from jaxformer.run_config import TrainConfig

        signal_at = os.environ.get("SIGTERM_AT_STEP")
        signalled = [False]
        if signal_at == "restore":
            real_restore = trainer.RunCheckpoints.restore_latest

            def restore_latest(*args, **kwargs):
                restored = real_restore(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGTERM)
                signalled[0] = True
                return restored
            trainer.RunCheckpoints.restore_latest = restore_latest
        if signal_at is not None:
            real_jit_train_step = trainer.jit_train_step

            def jit_train_step(*args, **kwargs):
                step, calls = real_jit_train_step(*args, **kwargs), [0]

                def stepped(*a, **k):
                    calls[0] += 1
                    if signal_at.isdigit() and calls[0] == int(signal_at):
                        os.kill(os.getpid(), signal.SIGTERM)
                        signalled[0] = True
                    if signalled[0]:
                        time.sleep(0.3)
                    return step(*a, **k)
                return stepped
            trainer.jit_train_step = jit_train_step

        config = TrainConfig(**json.loads(sys.argv[3]), coordinator_address=f"localhost:{port}",
                             num_processes=2, process_id=process_id)
        try:
            output = {"results": trainer.train(config)}
        except trainer.Preempted as stop:
            output = {"preempted_at": stop.step, "signal": signal.Signals(stop.signum).name}
        print(json.dumps({"process": jax.process_index(), **output}), flush=True)
        sys.exit(0)
    sharding.initialize_distributed(f"localhost:{port}", num_processes=2, process_id=process_id)
    assert jax.process_count() == 2 and len(jax.devices()) == 8, jax.devices()
    print(json.dumps({"process": jax.process_index(), "losses": train_losses()}), flush=True)
