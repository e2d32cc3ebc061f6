"""The data wing: from corpus files to training batches.

``corpus`` (reading, cleaning, the hashed split), ``tokenizer`` (sentencepiece,
Marian), ``prepare`` (stream a corpus into ids on disk once), ``prepared`` (that
format), ``streaming`` and ``batching`` (packing, buckets, the grain pipeline),
``run_data`` (what a run's data is, its fingerprint, prepared when missing). Imports
the ``model`` and ``run`` wings only.
"""
