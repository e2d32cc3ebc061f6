"""The train wing: the training job.

``losses`` (label smoothing, the fused output projection), ``optimizer`` (Adam and
the warm-up schedule of §5.3), ``step`` (the pure, jitted train/eval steps and the
train state), ``plan`` (the run's start, decided once), ``programs`` (the run's jitted
programs), ``run_setup``, ``run_state``, ``trainer`` (setup, loop, final test), ``run_eval``
(dev evaluation, averaging, the test), ``early_stopping``, ``averaging``, ``preemption``.
The top wing below the command line: it may import every other.
"""
