"""Exported decoders and parameter shapes in a run directory (jaxformer.decode.exported, issue 14)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decode import exported
from jaxformer.decode.exported import ExportCache
from jaxformer.model import config as config_lib


def _counting(calls):
    def fn(params, src_BS):   # stands in for a decoder: a pure function of arrays
        calls.append(src_BS.shape)
        return jnp.argsort(src_BS @ params["w"], axis=-1), jnp.sum(src_BS, axis=-1)
    return fn


def test_a_decoder_is_exported_once_and_later_read_from_disk(tmp_path):
    params = {"w": jnp.arange(12.0).reshape(3, 4)}
    src = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3)), jnp.float32)
    config = config_lib.preset("tiny", src_vocab_size=64)
    calls = []
    first = ExportCache(tmp_path).decoder(_counting(calls), "toy", config, beam_size=4)
    expected = _counting([])(params, src)
    for _ in range(2):   # traced once, then the compiled export is reused in-process
        jax.tree_util.tree_map(np.testing.assert_array_equal, first(params, src), expected)
    assert calls == [(2, 3)] and len(list(tmp_path.glob("*.jaxexport"))) == 1

    again = ExportCache(tmp_path).decoder(_counting(calls), "toy", config, beam_size=4)   # "a new process"
    jax.tree_util.tree_map(np.testing.assert_array_equal, again(params, src), expected)
    assert calls == [(2, 3)], "read from disk, not traced again"

    again(params, jnp.ones((4, 3)))   # another input shape: its own export
    other = ExportCache(tmp_path).decoder(_counting(calls), "toy", config, beam_size=5)
    other(params, src)                # another static argument: its own export
    changed = ExportCache(tmp_path).decoder(_counting(calls), "toy", config.replace(activation="gelu"),
                                           beam_size=4)
    changed(params, src)              # another model config: its own export
    narrow = ExportCache(tmp_path).decoder(_counting(calls), "toy", config.replace(matmul_dtype="bfloat16"),
                                          beam_size=4)
    narrow(params, src)               # other weight matmuls (--matmul-dtype): its own export
    assert calls == [(2, 3), (4, 3), (2, 3), (2, 3), (2, 3)] and len(list(tmp_path.glob("*.jaxexport"))) == 5


def test_a_damaged_export_is_made_again(tmp_path):
    params, src = {"w": jnp.ones((3, 4))}, jnp.ones((2, 3))
    config = config_lib.preset("tiny", src_vocab_size=64)
    calls = []
    ExportCache(tmp_path).decoder(_counting(calls), "toy", config)(params, src)
    (path,) = tmp_path.glob("*.jaxexport")
    path.write_bytes(path.read_bytes()[:50])
    out = ExportCache(tmp_path).decoder(_counting(calls), "toy", config)(params, src)
    jax.tree_util.tree_map(np.testing.assert_array_equal, out, _counting([])(params, src))
    assert len(calls) == 2 and path.stat().st_size > 50


def test_parameter_shapes_are_kept_per_config(tmp_path):
    config = config_lib.preset("tiny", src_vocab_size=64)
    made = []

    def make(c):
        def shapes():
            made.append(c)
            return {"encoder": {"w": jax.ShapeDtypeStruct((c.d_model, c.d_ff), jnp.float32)},
                    "bias": jax.ShapeDtypeStruct((c.d_model,), jnp.bfloat16)}
        return shapes

    first = ExportCache(tmp_path).abstract_params(config, make(config))
    second = ExportCache(tmp_path).abstract_params(config, make(config))
    assert second == first and len(made) == 1
    wider = config.replace(d_ff=96)
    assert ExportCache(tmp_path).abstract_params(wider, make(wider))["encoder"]["w"].shape == (32, 96)
    assert len(made) == 2


def test_the_key_covers_the_libraries_and_the_tracing_settings(tmp_path, monkeypatch):
    import flax

    cache = ExportCache(tmp_path)
    first = cache.key("decoder", "beam")
    assert cache.key("decoder", "beam") == first and cache.key("decoder", "greedy") != first
    monkeypatch.setattr(flax, "__version__", "0.0.1")
    assert cache.key("decoder", "beam") != first
    monkeypatch.undo()
    with jax.default_matmul_precision("bfloat16"):
        assert cache.key("decoder", "beam") != first


def test_exported_files_have_the_umask_permissions_not_0600(tmp_path):
    import os
    import stat

    previous = os.umask(0o002)   # a group-shared run directory
    try:
        exported._write_atomically(tmp_path / "entry.bin", b"program")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "entry.bin").stat().st_mode) == 0o664
    assert exported._read_verified(tmp_path / "entry.bin") == b"program"


def test_the_source_digest_covers_every_wing():
    """The key hashes the whole package: a change to the model wing is another key."""
    import hashlib
    from pathlib import Path

    import jaxformer

    root = Path(jaxformer.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(f"{path.relative_to(root)}\0".encode() + path.read_bytes() + b"\0")
    assert exported.source_digest() == digest.hexdigest()
    assert any(p.parent.name == "model" for p in root.rglob("*.py"))
