"""The serving wing: a run translated on CPUs through CTranslate2, without JAX.

``ct2_model`` (the run's checkpoint chosen and fingerprinted from its files, and its
CTranslate2 model converted once into ``RUN/ct2/``), ``ct2_engine`` (the engine
``jaxformer-translate --engine ct2`` decodes with). Imports ``data`` (the tokenizer) and
``decode.defaults``; the conversion itself (``interop.ct2``) loads JAX, once per checkpoint.
"""
