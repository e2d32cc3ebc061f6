"""The decode wing: translating with a trained model.

``decoding`` (:func:`decode`: a strategy over a batch), ``strategies`` and ``beam_search``
(``Greedy``, ``Sample``, ``Beam``), ``penalties`` (logit processors), ``staged`` (beam search
in stages), ``evaluation`` (batches, BLEU/chrF), ``exported`` (exported decoders),
``translator`` (a run as a ``Translator``), ``bulk`` (whole files, chunked and resumable).
Imports ``model``, ``run`` and ``data`` only.
"""
