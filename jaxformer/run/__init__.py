"""The run wing: what every job of a run directory looks down at.

``config`` (``TrainConfig``, the flags of ``train.py``), ``directory`` (``RunDir``: the
run directory's files, JAX's compilation cache), ``metrics`` (``metrics.jsonl``,
TensorBoard events, plots), ``checkpoints``
(orbax), ``logs``, ``platform`` (the CPU when libtpu is installed but no TPU is attached).
Below ``data``, ``decode``, ``interop`` and ``train``, which all
read or write run directories; it imports only the ``model`` wing.
"""
