"""The aot wing: ahead-of-time compilation for accelerators this host does not have:
``chips`` (specifications, slice names), ``target`` (compile-only devices, the mesh),
``steps`` (train step and beam search lowered from abstract inputs), ``report`` (memory,
FLOPs, collectives, fit, roofline), ``cache``; ``jaxformer-compile`` prints it."""
