"""The command-line programs, each a thin ``main`` over the wings: ``train``
(``jaxformer-train``, ``train.py``), ``prepare`` (``jaxformer-prepare``), ``translate``
(``jaxformer-translate``) and ``convert`` (``jaxformer-convert``).
``python -m jaxformer.translate`` and ``python -m jaxformer.prepare`` run the same."""
