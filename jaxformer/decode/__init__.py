"""The decode wing (imports ``model``, ``run``, ``data``): ``decoding`` (``decode``), ``strategies``
and ``beam_search`` (``Greedy``, ``Sample``, ``Beam``), ``constrained`` (``Constrained``) and
``constraint_inputs``, ``penalties``, ``generation`` (a model's banned ids and forced first
token), ``staged``, ``evaluation``
(batches, BLEU/chrF), ``exported``, ``translator`` (``Translator``), ``bulk`` (whole files).
"""
