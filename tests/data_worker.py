"""One process of the multi-process data test (``tests/test_prepare_processes.py``).

``python data_worker.py PORT PROCESS_ID NUM_PROCESSES PREPARED_DIR`` joins a CPU JAX
cluster on localhost, streams its own share of the prepared data (no model) for two
epochs, and prints, as JSON, the record ids its rows hold in each epoch and the ids
its collated batches were read from.
"""

from __future__ import annotations

import json
import sys

if __name__ == "__main__":
    import jax

    from jaxformer.data import streaming
    from jaxformer.data.prepared import PreparedCorpus
    from jaxformer.model import sharding

    port, process_id, num_processes, directory = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    sharding.initialize_distributed(f"localhost:{port}", num_processes=num_processes, process_id=process_id)
    assert jax.process_count() == num_processes
    corpus = PreparedCorpus.open(directory)
    read: set[int] = set()
    src_side = corpus.src

    class Recording:   # the corpus as collate sees it, recording which pairs are read
        src = type("Src", (), {"__getitem__": lambda self, i: (read.add(int(i)), src_side[i])[1]})()
        tgt = corpus.tgt

    plans = streaming.process_plans(corpus, max_len=24, batch_tokens=96, boundaries=(8, 16, 24), seed=5,
                                    row_multiple=4, block_pairs=300, process_index=jax.process_index(),
                                    process_count=jax.process_count())
    it = iter(plans)
    epochs: list[list[int]] = [[], [], []]
    while it.get_state()["epoch"] < 2:
        length, ids, _ = next(it)
        epoch = it.get_state()["epoch"]   # the state after a batch names the batch's epoch
        if epoch < 2:
            streaming.batching.collate_packed(Recording, length, ids, pad_id=0, bos_id=2, eos_id=3)
        epochs[epoch].extend(int(i) for i in ids.ravel() if i >= 0)
    print(json.dumps({"process": jax.process_index(), "epochs": epochs[:2], "read": sorted(read)}),
          flush=True)
