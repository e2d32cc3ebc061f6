"""The data wing, corpus files to training batches: ``lines`` (the text reader), ``corpus``
(pair files, the hashed split), ``tokenizer``, ``multilingual`` (M2M100's and NLLB's
tokenizers), ``prepare``/``prepared`` (ids on disk),
``batching`` and ``streaming`` (plans, collation, the grain pipeline), ``back_translation``,
``distillation``, ``sources`` (the protocol), ``run_data`` (a run's data, its fingerprint,
reused or prepared). Imports the ``model`` and ``run`` wings only.
"""
