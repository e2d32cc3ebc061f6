"""The model wing: the Transformer and everything it is made of, importable alone.

``config`` (``TransformerConfig``, presets), ``masks``, ``attention``, ``layers``,
``dropout``, ``transformer`` (the encoder–decoder, its cache and incremental step),
``validation`` (token-id and shape checks), ``sharding`` (the logical-axis table and
the mesh). This wing imports nothing from the others (``tests/test_layout.py``); the
functional API of ``import jaxformer as jf`` lives here.
"""
