"""The model wing: the Transformer and everything it is made of, importable alone.

``config`` (``TransformerConfig``, presets), ``masks``, ``attention``, ``splash`` (the
Pallas TPU attention kernel), ``layers`` (the boxes of Figure 1), ``stacks`` (N of them,
unrolled or scanned), ``dropout``, ``transformer`` (the
encoder–decoder, its cache and incremental step), ``scan`` (scanned and unrolled layer
layouts), ``validation`` (token-id and shape checks), ``sharding`` (the logical-axis
table and the mesh). This wing imports nothing from the others (``tests/test_layout.py``); the
functional API of ``import jaxformer as jf`` lives here.
"""
