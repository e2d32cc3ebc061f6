"""The data wing: from corpus files to training batches.

``lines`` (the one reader of text files), ``corpus`` (pair files, the hashed split),
``tokenizer`` (sentencepiece, Marian), ``prepare`` (stream a corpus into ids on disk
once), ``prepared`` (that format), ``streaming`` and ``batching`` (packing, buckets, the
grain pipeline), ``back_translation`` (the synthetic mix), ``sources`` (the protocol
they follow), ``spec`` and ``run_data`` (what a run's data is, its fingerprint,
prepared when missing). Imports the ``model`` and ``run`` wings only.
"""
