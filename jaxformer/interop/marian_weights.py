"""Marian (Hugging Face ``MarianMTModel``) weights ⇄ jaxformer parameters, in NumPy.

The names mirror transformers' ``models/marian/modeling_marian.py``: ``model.shared``,
``model.{encoder,decoder}.layers.N.{self_attn,encoder_attn}.{q,k,v,out}_proj``,
``fc1``/``fc2``, ``*_layer_norm``, ``lm_head``, ``final_logits_bias``. PyTorch
``nn.Linear`` stores ``weight [out, in]``; our kernels are ``[in, ...]`` with explicit
head axes. Glossary: D d_model, H heads, K = D / H, F d_ff, V vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.config import TransformerConfig
from jaxformer.model.transformer import Transformer


class ConversionError(ValueError):
    """The model cannot be converted; the message says why and what to do."""


def _linear_in(weight_OI, *out_shape):
    """torch ``Linear.weight [out, in]`` → our kernel ``[in, *out_shape]``."""
    return np.ascontiguousarray(weight_OI.T.reshape((weight_OI.shape[1],) + out_shape))


def _attention_from_hf(t: dict[str, np.ndarray], prefix: str, H: int, K: int) -> dict[str, np.ndarray]:
    out = {}
    for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        out[f"{ours}_kernel"] = _linear_in(t[f"{prefix}.{theirs}.weight"], H, K)      # [D, H, K]
        out[f"{ours}_bias"] = t[f"{prefix}.{theirs}.bias"].reshape(H, K)              # [H, K]
    out["out_kernel"] = np.ascontiguousarray(t[f"{prefix}.out_proj.weight"].T.reshape(H, K, -1))  # [H, K, D]
    out["out_bias"] = t[f"{prefix}.out_proj.bias"]
    return out


def _attention_to_hf(p: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    out = {}
    for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        kernel_DHK = p[f"{ours}_kernel"]
        out[f"{prefix}.{theirs}.weight"] = kernel_DHK.reshape(kernel_DHK.shape[0], -1).T
        out[f"{prefix}.{theirs}.bias"] = p[f"{ours}_bias"].reshape(-1)
    kernel_HKD = p["out_kernel"]
    out[f"{prefix}.out_proj.weight"] = kernel_HKD.reshape(-1, kernel_HKD.shape[-1]).T
    out[f"{prefix}.out_proj.bias"] = p["out_bias"]
    return out


def _norm(t, prefix):
    return {"norm": {"scale": t[f"{prefix}.weight"], "bias": t[f"{prefix}.bias"]}}


def _ffn(t, prefix):
    return {"w1": {"kernel": t[f"{prefix}.fc1.weight"].T, "bias": t[f"{prefix}.fc1.bias"]},
            "w2": {"kernel": t[f"{prefix}.fc2.weight"].T, "bias": t[f"{prefix}.fc2.bias"]}}


# (our layer name, our norm name, their attention / norm prefix) per sub-layer
_ENCODER_SUBLAYERS = (("self_attention", "attention_norm", "self_attn"),)
_DECODER_SUBLAYERS = (("self_attention", "self_attention_norm", "self_attn"),
                      ("cross_attention", "cross_attention_norm", "encoder_attn"))


def _first(t: dict[str, np.ndarray], *names: str) -> np.ndarray:
    """The first of ``names`` in ``t`` (``KeyError`` naming the last when none is)."""
    return t[next((name for name in names if name in t), names[-1])]


def params_from_hf(tensors: dict[str, np.ndarray], config: TransformerConfig) -> dict[str, Any]:
    """Our parameter tree (float32 NumPy) from a ``MarianMTModel`` state dict.

    Tied models may store the shared table under ``model.shared.weight`` only (what
    transformers v5 saves) or repeat it under ``embed_tokens``/``lm_head``; both read.
    A model with separate vocabularies whose ``lm_head`` is tied to the decoder table
    becomes an untied projection initialised from that table (same function).

    Raises:
      ConversionError: tensors missing or of the wrong shape, all named in one message.
    """
    t = {k.removeprefix("module."): np.asarray(v, np.float32) for k, v in tensors.items()}
    try:
        params = _params_from_hf(t, config)
        problems = _shape_problems(params, config)
    except KeyError as e:
        problems = [f"the checkpoint lacks {e}: not a MarianMTModel state dict?"]
    if problems:
        raise ConversionError("the weights do not fit the config: " + "; ".join(problems[:8]) + ".")
    return params


def _params_from_hf(t: dict[str, np.ndarray], config: TransformerConfig) -> dict[str, Any]:
    c, H, K = config, config.num_heads, config.head_dim
    params: dict[str, Any] = {"encoder": {}, "decoder": {}}
    for stack, sublayers, count in (("encoder", _ENCODER_SUBLAYERS, c.num_encoder_layers),
                                    ("decoder", _DECODER_SUBLAYERS, c.num_decoder_layers)):
        for i in range(count):
            prefix = f"model.{stack}.layers.{i}"
            layer = {"feed_forward": _ffn(t, prefix),
                     "feed_forward_norm": _norm(t, f"{prefix}.final_layer_norm")}
            for ours, norm, theirs in sublayers:
                layer[ours] = _attention_from_hf(t, f"{prefix}.{theirs}", H, K)
                layer[norm] = _norm(t, f"{prefix}.{theirs}_layer_norm")
            params[stack][f"layer_{i}"] = layer
    bias_V, shared = t["final_logits_bias"].reshape(-1), "model.shared.weight"
    if c.share_embeddings:
        params["src_embedding"] = {"embedding": _first(t, shared, "model.encoder.embed_tokens.weight")}
        params["final_logits_bias"] = bias_V
    else:
        head_VD = _first(t, "lm_head.weight", "model.decoder.embed_tokens.weight", shared)
        params["src_embedding"] = {"embedding": _first(t, "model.encoder.embed_tokens.weight", shared)}
        params["tgt_embedding"] = {"embedding": _first(t, "model.decoder.embed_tokens.weight", shared)}
        params["output_projection"] = {"kernel": np.ascontiguousarray(head_VD.T), "bias": bias_V}
    return params


def params_to_hf(params: dict[str, Any], config: TransformerConfig) -> dict[str, np.ndarray]:
    """Inverse of :func:`params_from_hf`: a ``MarianMTModel`` state dict, float32 NumPy."""
    c = config
    p = _to_numpy(params)
    out: dict[str, np.ndarray] = {}
    for stack, sublayers, count in (("encoder", _ENCODER_SUBLAYERS, c.num_encoder_layers),
                                    ("decoder", _DECODER_SUBLAYERS, c.num_decoder_layers)):
        for i in range(count):
            prefix, layer = f"model.{stack}.layers.{i}", p[stack][f"layer_{i}"]
            norms = [(norm, f"{theirs}_layer_norm") for _, norm, theirs in sublayers]
            for ours, _, theirs in sublayers:
                out.update(_attention_to_hf(layer[ours], f"{prefix}.{theirs}"))
            for ours, theirs in [*norms, ("feed_forward_norm", "final_layer_norm")]:
                out[f"{prefix}.{theirs}.weight"] = layer[ours]["norm"]["scale"]
                out[f"{prefix}.{theirs}.bias"] = layer[ours]["norm"]["bias"]
            for ours, theirs in (("w1", "fc1"), ("w2", "fc2")):
                out[f"{prefix}.{theirs}.weight"] = layer["feed_forward"][ours]["kernel"].T
                out[f"{prefix}.{theirs}.bias"] = layer["feed_forward"][ours]["bias"]
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
    """The same function with the split positional table: every ``embed`` (D) axis permuted.

    The interleaved table has sin of frequency i at dimension 2i and its cos at 2i+1;
    the split table has them at i and D/2 + i. Permuting the D axis of every
    parameter (embeddings, LayerNorms, the input of Q/K/V and of the FFN, the output
    of each sub-layer, the output projection's input) is a symmetry of the
    Transformer (LayerNorm statistics and dot products over D do not depend on the
    order), so permuted weights with the split table compute exactly what the
    original weights compute with the interleaved one. The axes are found by their
    logical name ``embed`` (:mod:`jaxformer.model.sharding`).
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
    """The state dict of ``hf_dir`` as NumPy: ``model.safetensors`` (or its shards).

    Raises:
      ConversionError: only ``pytorch_model.bin`` is there (a pickle needs torch);
        the message gives the one-line fix. A file that is not safetensors (truncated).
    """
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
                   f"transformers import MarianMTModel as M; M.from_pretrained('{hf_dir}')"
                   f".save_pretrained('{hf_dir}')\"`.")
    elif not paths:
        problem = f"{hf_dir} has no model.safetensors (nor pytorch_model.bin)."
    if problem:
        raise ConversionError(problem)
    return tensors
