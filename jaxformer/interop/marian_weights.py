"""Marian (``MarianMTModel``) and M2M100/NLLB (``M2M100ForConditionalGeneration``, the same
layer names plus a final LayerNorm per stack) weights ⇄ jaxformer parameters, in NumPy, named
after transformers' ``models/marian/modeling_marian.py``. PyTorch ``nn.Linear`` stores
``weight [out, in]``; our kernels are ``[in, ...]`` with head axes. D d_model, H heads,
K = D / H, V vocabulary.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.interop import ConversionError, refuse  # noqa: F401  (raised here; named by importers)
from jaxformer.model.config import TransformerConfig
from jaxformer.model.transformer import Transformer

# How each kind of tensor maps: (Marian → ours, ours → Marian).
_KINDS = {
    "plain": (lambda w, c: w, lambda w: w),
    "linear": (lambda w, c: w.T, lambda w: w.T),                                         # [in, out]
    "heads_in": (lambda w, c: w.T.reshape(c.d_model, c.num_heads, c.head_dim),           # [D, H, K]
                 lambda w: w.reshape(w.shape[0], -1).T),
    "heads": (lambda w, c: w.reshape(c.num_heads, c.head_dim), lambda w: w.reshape(-1)),  # [H, K]
    "heads_out": (lambda w, c: w.T.reshape(c.num_heads, c.head_dim, c.d_model),          # [H, K, D]
                  lambda w: w.reshape(-1, w.shape[-1]).T),
}


def _layer_tensors(config: TransformerConfig):
    """``(our path, Marian name, kind)`` of every tensor of the encoder and decoder layers,
    after transformers' ``modeling_marian.py``."""
    for stack, count in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
        sublayers = [("self_attention", "attention_norm" if stack == "encoder" else "self_attention_norm",
                      "self_attn")]
        if stack == "decoder":
            sublayers.append(("cross_attention", "cross_attention_norm", "encoder_attn"))
        for i in range(count):
            ours, theirs = (stack, f"layer_{i}"), f"model.{stack}.layers.{i}"
            for attention, norm, hf in sublayers:
                for q, hq in (("query", "q"), ("key", "k"), ("value", "v")):
                    yield ours + (attention, f"{q}_kernel"), f"{theirs}.{hf}.{hq}_proj.weight", "heads_in"
                    yield ours + (attention, f"{q}_bias"), f"{theirs}.{hf}.{hq}_proj.bias", "heads"
                yield ours + (attention, "out_kernel"), f"{theirs}.{hf}.out_proj.weight", "heads_out"
                yield ours + (attention, "out_bias"), f"{theirs}.{hf}.out_proj.bias", "plain"
                yield ours + (norm, "norm", "scale"), f"{theirs}.{hf}_layer_norm.weight", "plain"
                yield ours + (norm, "norm", "bias"), f"{theirs}.{hf}_layer_norm.bias", "plain"
            for w, fc in (("w1", "fc1"), ("w2", "fc2")):
                yield ours + ("feed_forward", w, "kernel"), f"{theirs}.{fc}.weight", "linear"
                yield ours + ("feed_forward", w, "bias"), f"{theirs}.{fc}.bias", "plain"
            yield ours + ("feed_forward_norm", "norm", "scale"), f"{theirs}.final_layer_norm.weight", "plain"
            yield ours + ("feed_forward_norm", "norm", "bias"), f"{theirs}.final_layer_norm.bias", "plain"


def _first(t: dict[str, np.ndarray], *names: str) -> np.ndarray:
    """The first of ``names`` in ``t`` (``KeyError`` naming the last when none is)."""
    return t[next((name for name in names if name in t), names[-1])]


def params_from_hf(tensors: dict[str, np.ndarray], config: TransformerConfig) -> dict[str, Any]:
    """Our parameter tree (float32 NumPy) from a ``MarianMTModel`` state dict (the shared table under
    ``model.shared.weight`` alone, or repeated; a separate-vocabulary model's tied ``lm_head`` becomes an
    untied projection initialised from the decoder table). Raises ``ConversionError``: tensors missing or of
    the wrong shape, all named in one message."""
    t = {k.removeprefix("module."): np.asarray(v, np.float32) for k, v in tensors.items()}
    try:
        params = _params_from_hf(t, config)
        problems = _shape_problems(params, config)
    except KeyError as e:
        problems = [f"the checkpoint lacks {e}: not a MarianMTModel state dict?"]
    if problems:
        raise ConversionError("the weights do not fit the config: " + "; ".join(problems[:8]) + ".")
    return params


def _params_from_hf(t: dict[str, np.ndarray], c: TransformerConfig) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for path, name, kind in _layer_tensors(c):
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.ascontiguousarray(_KINDS[kind][0](t[name], c))
    if c.norm_position == "pre":   # M2M100/NLLB: a final LayerNorm per stack
        for stack in ("encoder", "decoder"):
            params[stack]["final_norm"] = {"scale": t[f"model.{stack}.layer_norm.weight"],
                                           "bias": t[f"model.{stack}.layer_norm.bias"]}
    shared = "model.shared.weight"
    bias_V = t["final_logits_bias"].reshape(-1) if c.final_logits_bias or not c.share_embeddings else None
    if c.share_embeddings:
        params["src_embedding"] = {"embedding": _first(t, shared, "model.encoder.embed_tokens.weight")}
        if c.final_logits_bias:
            params["final_logits_bias"] = bias_V
    else:
        head_VD = _first(t, "lm_head.weight", "model.decoder.embed_tokens.weight", shared)
        params["src_embedding"] = {"embedding": _first(t, "model.encoder.embed_tokens.weight", shared)}
        params["tgt_embedding"] = {"embedding": _first(t, "model.decoder.embed_tokens.weight", shared)}
        params["output_projection"] = {"kernel": np.ascontiguousarray(head_VD.T), "bias": bias_V}
    return params


def params_to_hf(params: dict[str, Any], config: TransformerConfig) -> dict[str, np.ndarray]:
    """Inverse of :func:`params_from_hf`: a ``MarianMTModel`` state dict, float32 NumPy."""
    c, p = config, _to_numpy(params)
    out = {name: _KINDS[kind][1](functools.reduce(lambda node, key: node[key], path, p))
           for path, name, kind in _layer_tensors(c)}
    if c.norm_position == "pre":
        for stack in ("encoder", "decoder"):
            out[f"model.{stack}.layer_norm.weight"] = p[stack]["final_norm"]["scale"]
            out[f"model.{stack}.layer_norm.bias"] = p[stack]["final_norm"]["bias"]
    if c.share_embeddings:
        out["model.shared.weight"] = p["src_embedding"]["embedding"]
        bias = p.get("final_logits_bias", np.zeros((c.tgt_vocab_size,), np.float32))
    else:
        out["model.encoder.embed_tokens.weight"] = p["src_embedding"]["embedding"]
        out["model.decoder.embed_tokens.weight"] = p["tgt_embedding"]["embedding"]
        out["lm_head.weight"] = p["output_projection"]["kernel"].T
        bias = p["output_projection"]["bias"]
    out["final_logits_bias"] = bias.reshape(1, -1)
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def interleaved_to_split(params: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """The same function for the split positional table: every ``embed`` (D) axis permuted,
    dimensions 2i, 2i+1 to i, D/2 + i (a symmetry: LayerNorm and dot products ignore D's order).
    """
    D = config.d_model
    perm = np.concatenate([np.arange(0, D, 2), np.arange(1, D, 2)])
    names = jax.tree_util.tree_map(lambda b: b.names, _boxed_params(config),
                                   is_leaf=lambda b: isinstance(b, nn.Partitioned))

    def permute(x, axis_names):
        x = np.asarray(x)
        for axis, name in enumerate(axis_names):
            if name == "embed":
                x = np.take(x, perm, axis=axis)
        return x

    return jax.tree_util.tree_map(permute, _to_numpy(params), names,
                                  is_leaf=lambda n: isinstance(n, tuple))


def _to_numpy(tree):
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    return np.asarray(tree, np.float32)


def _boxed_params(config: TransformerConfig) -> Any:
    """The shapes of a ``Transformer(config)``'s parameters, boxed with their logical names."""
    ids = jnp.ones((1, 2), jnp.int32)
    return jax.eval_shape(lambda: Transformer(config).init(jax.random.key(0), ids, ids)["params"])


def _shape_problems(params: dict[str, Any], config: TransformerConfig) -> list[str]:
    """Every array whose shape differs from what ``Transformer(config)`` expects."""
    expected = nn.unbox(_boxed_params(config))
    want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    have = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(params)}
    return sorted(f"{k}: checkpoint {have.get(k)} vs model {want.get(k)}"
                  for k in set(want) | set(have) if want.get(k) != have.get(k))


def read_hf_weights(hf_dir: Path) -> dict[str, np.ndarray]:
    """``hf_dir``'s ``model.safetensors`` (or shards) as NumPy. Raises ``ConversionError``: none there (a
    torch pickle only: the fix), or a damaged file."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    single = hf_dir / "model.safetensors"
    paths = [single] if single.exists() else sorted(hf_dir.glob("model-*-of-*.safetensors"))
    tensors: dict[str, np.ndarray] = {}
    problem = None
    for path in paths:
        try:
            tensors.update(load_file(str(path)))
        except SafetensorError as e:
            problem = (f"{path} is not a readable safetensors file ({e}): a truncated or damaged download? "
                       f"Download it again.")
    if not paths and (hf_dir / "pytorch_model.bin").exists():
        problem = (f"{hf_dir} has only pytorch_model.bin, a torch pickle that cannot be read without torch. "
                   f"Get the safetensors weights (`hf download MODEL model.safetensors`, or the repo's "
                   f"refs/pr/N branch), or convert once where torch is installed: `python -c \"from "
                   f"transformers import AutoModelForSeq2SeqLM as M; M.from_pretrained('{hf_dir}')"
                   f".save_pretrained('{hf_dir}')\"`.")
    elif not paths:
        problem = f"{hf_dir} has no model.safetensors (nor pytorch_model.bin)."
    if problem:
        raise ConversionError(problem)
    return tensors
