"""The serving wing: runs translated on CPUs through CTranslate2 without JAX, and served over
HTTP with LibreTranslate's API (``jaxformer-serve``, docs/serving.md).

``ct2_model`` (the run's checkpoint chosen and fingerprinted from its files, and its
CTranslate2 model converted once into ``RUN/ct2/``), ``ct2_engine`` (the engine
``jaxformer-translate --engine ct2`` decodes with). The service, over any engine
(:mod:`jaxformer.decode.engine`): ``app`` (the HTTP routes), ``api`` (LibreTranslate's fields
and errors), ``served_model`` (a run served: its pairs, texts in, texts out), ``batcher``
(dynamic batching), ``markup`` (HTML; sentences: :mod:`jaxformer.decode.text`), ``languages``
(LibreTranslate's codes, detection), ``limits`` (keys, rate, body size), ``metrics``
(Prometheus), ``static/`` (the web page). Imports ``data`` (the tokenizer) and ``decode``;
the conversion itself (``interop.ct2``) loads JAX, once per checkpoint.
"""
