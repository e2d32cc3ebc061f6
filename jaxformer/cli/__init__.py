"""The command-line programs, each a thin ``main`` over the wings: ``train``
(``jaxformer-train``, ``train.py``), ``prepare`` (``jaxformer-prepare``), ``translate``
(``jaxformer-translate``; its flag checks in ``translate_flags``), ``convert``
(``jaxformer-convert``) and ``compile``
(``jaxformer-compile``). ``python -m jaxformer.translate``, ``.prepare`` and ``.compile``
run the same."""
