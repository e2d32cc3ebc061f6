"""Two processes on localhost, 4 fake CPU devices each, train like one process (issue #5)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from multiprocess_worker import train_losses

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT_S = 240   # never hang CI: both workers are killed after this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process():
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([str(WORKER.parents[1]), os.environ.get("PYTHONPATH", "")]))
    workers = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(i)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
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
    reference = train_losses()        # this process: 8 devices, the same data=4,model=2 mesh
    assert sorted(o["process"] for o in outputs) == [0, 1]
    for output in outputs:
        np.testing.assert_allclose(output["losses"], reference, rtol=1e-5)
