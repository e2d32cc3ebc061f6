"""The decode wing: translating with a trained model.

``decoding`` (incremental greedy decoding, sampling, jitted decoders), ``beam_search``
(scoring and the stopping rule, after flax's WMT example), ``evaluation`` (batched
translation, BLEU/chrF), ``exported`` (the cache of exported decoders),
``translator`` (a run directory as a ``Translator``), ``bulk`` (whole files, chunked and
resumable). Imports ``model``, ``run`` and ``data`` only.
"""
