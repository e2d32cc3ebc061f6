"""The train wing: the training job (``trainer``: setup, loop, final test), its steps, losses,
optimizer, run plan and evaluations. The top wing below the command line: it may import every other."""
