"""The aot wing: ahead-of-time compilation for accelerators this host does not have:
``chips`` (specifications, slice names), ``programs`` (the train step and beam search
compiled for compile-only devices, reports cached), ``report`` (memory, FLOPs,
collectives, fit, roofline); ``jaxformer-compile`` prints it."""
