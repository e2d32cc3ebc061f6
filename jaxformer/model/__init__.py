"""The model wing, importable alone (it imports no other wing): ``config``, ``masks``,
``attention``, ``splash`` (the TPU kernel), ``layers`` (Figure 1's boxes), ``stacks``,
``dropout``, ``matmul``, ``transformer`` (the encoder–decoder, its cache and step),
``scan`` (layer layouts), ``validation`` (the entry checks), ``sharding`` (the
logical-axis table and the mesh). The functional API of ``import jaxformer as jf``."""
