"""The aot wing: ahead-of-time compilation for accelerators this host does not have.

``chips`` (chip specifications, TPU slice names), ``target`` (compile-only TPU devices
from libtpu, the run's mesh over them), ``steps`` (the train step and beam search,
lowered from abstract inputs), ``report`` (memory, FLOPs, collectives, the fit verdict,
a roofline estimate). ``jaxformer-compile`` (:mod:`jaxformer.cli.compile`) prints it.
Above ``train`` and ``decode``, whose programs it compiles.
"""
