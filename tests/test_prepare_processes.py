"""Two and four processes (CPU, ``jax.distributed`` on localhost, no model) stream
disjoint records of the prepared data that together cover each epoch exactly once,
and each process reads only the records of its own rows (issue #12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_multiprocess import TIMEOUT_S, _free_port
from test_prepare import MAX_LEN, corpus_file, run_dir  # noqa: F401 (module fixtures)

from jaxformer.data import streaming
from jaxformer.data.prepared import PreparedCorpus

WORKER = Path(__file__).with_name("data_worker.py")


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_read_disjoint_records_covering_each_epoch_once(run_dir, processes):  # noqa: F811
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
               PYTHONPATH=os.pathsep.join([str(WORKER.parents[1]), os.environ.get("PYTHONPATH", "")]))
    workers = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(i), str(processes),
                                 str(run_dir.prepared)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(processes)]
    outputs = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=TIMEOUT_S)
            assert worker.returncode == 0, f"worker failed (exit {worker.returncode}):\n{err[-3000:]}"
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
    assert [o["process"] for o in outputs] == list(range(processes))
    records, _ = streaming.kept_records(PreparedCorpus.open(run_dir.prepared), MAX_LEN)
    for epoch in range(2):
        shares = [o["epochs"][epoch] for o in outputs]
        assert sorted(i for share in shares for i in share) == records.tolist()   # once, all of them
    for output in outputs:
        assert set(output["read"]) == set(output["epochs"][0]) | set(output["epochs"][1])
