"""OPUS-MT/Marian models in, jaxformer models out: ``jaxformer-convert``.

``--from-hf DIR --workdir RUN`` reads a local Hugging Face Marian directory
(``config.json``, ``model.safetensors``, the tokenizer files) and writes a run
directory that ``jaxformer-translate --workdir RUN`` and ``train.py --init-from RUN``
use. ``--to-hf RUN --out DIR`` writes a post-norm run as a ``MarianMTModel``
directory (safetensors, ``config.json``, ``generation_config.json``, tokenizer files).

Neither direction needs torch: the weights go through ``safetensors.numpy``.
The parameter names mirror transformers' ``models/marian/modeling_marian.py``
(``MarianMTModel``: ``model.shared``, ``model.{encoder,decoder}.layers.N.{self_attn,
encoder_attn}.{q,k,v,out}_proj``, ``fc1``/``fc2``, ``*_layer_norm``, ``lm_head``,
``final_logits_bias``); PyTorch ``nn.Linear`` stores ``weight [out, in]``, our kernels
are ``[in, ...]``. Glossary: D d_model, H heads, K = D / H, F d_ff, V vocabulary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer.config import TransformerConfig

# Marian keys that name behaviour jaxformer does not have, with the value it needs.
_REQUIRED_HF = {"scale_embedding": True, "normalize_before": False, "normalize_embedding": False,
                "add_final_layer_norm": False, "static_position_embeddings": True,
                "add_bias_logits": False}
_ACTIVATION_FROM_HF = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}
MARIAN_LAYER_NORM_EPSILON = 1e-5   # torch.nn.LayerNorm's default, fixed in modeling_marian.py
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json", "tokenizer_config.json")


class ConversionError(ValueError):
    """The model cannot be converted; the message says why and what to do."""


# ---------------------------------------------------------------------- configs
def config_from_hf(hf: dict[str, Any]) -> TransformerConfig:
    """A :class:`TransformerConfig` equal in function to a Hugging Face ``MarianConfig``.

    Marian's departures from the paper become config fields: swish FFN, the split
    positional table, ``final_logits_bias``, LayerNorm ε 1e-5. Dropout rates are kept
    for fine-tuning (Marian's ``activation_dropout`` has no counterpart and is ignored).

    Raises:
      ConversionError: not a Marian config, or a Marian option jaxformer lacks
        (pre-norm, unscaled embeddings, learned positions, different encoder and
        decoder widths, an unknown activation).
    """
    if hf.get("model_type") != "marian":
        raise ConversionError(f"config.json has model_type={hf.get('model_type')!r}; only Marian "
                              f"(OPUS-MT) models convert. Is this a MarianMTModel directory?")
    missing = [k for k in ("vocab_size", "d_model", "encoder_attention_heads", "decoder_attention_heads",
                           "encoder_ffn_dim", "decoder_ffn_dim", "encoder_layers", "decoder_layers",
                           "max_position_embeddings", "pad_token_id") if hf.get(k) is None]
    if missing:
        raise ConversionError(f"config.json lacks {missing}: not a complete MarianConfig.")
    for key, needed in _REQUIRED_HF.items():
        # an absent scale_embedding is MarianConfig's default, False; the others are legacy keys
        value = hf.get(key, False if key == "scale_embedding" else needed)
        if value != needed:
            raise ConversionError(f"config.json sets {key}={value!r}; jaxformer's Marian import "
                                  f"needs {key}={needed!r} (the OPUS-MT architecture).")
    for a, b in (("encoder_attention_heads", "decoder_attention_heads"),
                 ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf[a] != hf[b]:
            raise ConversionError(f"{a}={hf[a]} != {b}={hf[b]}: jaxformer uses one value for both stacks.")
    activation = _ACTIVATION_FROM_HF.get(hf.get("activation_function", "gelu"))
    if activation is None:
        raise ConversionError(f"activation_function={hf['activation_function']!r} is not supported; "
                              f"jaxformer has {sorted(_ACTIVATION_FROM_HF)}.")
    shared = hf.get("share_encoder_decoder_embeddings", True)
    tied = hf.get("tie_word_embeddings", True)
    src_vocab = hf["vocab_size"]
    tgt_vocab = src_vocab if shared else (hf.get("decoder_vocab_size") or src_vocab)
    share = bool(shared and tied)
    return TransformerConfig(
        src_vocab_size=src_vocab, tgt_vocab_size=tgt_vocab, d_model=hf["d_model"],
        num_heads=hf["encoder_attention_heads"], d_ff=hf["encoder_ffn_dim"],
        num_encoder_layers=hf["encoder_layers"], num_decoder_layers=hf["decoder_layers"],
        dropout_rate=float(hf.get("dropout", 0.1)),
        attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
        max_len=hf["max_position_embeddings"], pad_id=hf["pad_token_id"], share_embeddings=share,
        norm_position="post", activation=activation, positional_layout="split",
        final_logits_bias=share, layer_norm_epsilon=MARIAN_LAYER_NORM_EPSILON)


def config_to_hf(config: TransformerConfig, *, eos_id: int, decoder_start_id: int) -> dict[str, Any]:
    """The ``MarianConfig`` (as a dict) of a post-norm jaxformer model.

    Raises:
      ConversionError: a pre-norm model (Marian has no pre-norm form in
        transformers: ``MarianEncoderLayer`` normalises after each residual).
    """
    c = config
    if c.norm_position != "post":
        raise ConversionError(
            f"this run is pre-norm (norm_position={c.norm_position!r}): transformers' MarianMTModel is "
            f"post-norm only (LayerNorm after each residual, no final LayerNorm), so the weights "
            f"would compute something else. Only post-norm runs export (train with "
            f"--norm-position post).")
    activation = {"relu": "relu", "swish": "swish", "gelu": "gelu"}[c.activation]
    return {
        "model_type": "marian", "architectures": ["MarianMTModel"],
        "vocab_size": c.src_vocab_size, "decoder_vocab_size": c.tgt_vocab_size,
        "share_encoder_decoder_embeddings": c.share_embeddings, "tie_word_embeddings": c.share_embeddings,
        "d_model": c.d_model, "encoder_attention_heads": c.num_heads, "decoder_attention_heads": c.num_heads,
        "encoder_ffn_dim": c.d_ff, "decoder_ffn_dim": c.d_ff, "encoder_layers": c.num_encoder_layers,
        "decoder_layers": c.num_decoder_layers, "num_hidden_layers": c.num_encoder_layers,
        "dropout": c.dropout_rate, "attention_dropout": c.attention_dropout_rate,
        "activation_dropout": 0.0, "activation_function": activation,
        "max_position_embeddings": c.max_len, "scale_embedding": True, "is_encoder_decoder": True,
        "pad_token_id": c.pad_id, "eos_token_id": eos_id, "forced_eos_token_id": eos_id,
        "decoder_start_token_id": decoder_start_id, "bos_token_id": None,
        "static_position_embeddings": True, "normalize_before": False, "normalize_embedding": False,
        "add_final_layer_norm": False, "use_cache": True,
    }


# ---------------------------------------------------------------------- weights
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
    for name in names:
        if name in t:
            return t[name]
    raise ConversionError(f"the checkpoint has none of {list(names)}: not a MarianMTModel state dict?")


def params_from_hf(tensors: dict[str, np.ndarray], config: TransformerConfig) -> dict[str, Any]:
    """Our parameter tree (float32 NumPy) from a ``MarianMTModel`` state dict.

    Tied models may store the shared table under ``model.shared.weight`` only (what
    transformers v5 saves) or repeat it under ``embed_tokens``/``lm_head``; both read.
    A model with separate vocabularies whose ``lm_head`` is tied to the decoder table
    becomes an untied projection initialised from that table (same function).

    Raises:
      ConversionError: a tensor is missing or has the wrong shape.
    """
    c, H, K = config, config.num_heads, config.head_dim
    t = {k.removeprefix("module."): np.asarray(v, np.float32) for k, v in tensors.items()}
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
    bias_V = _first(t, "final_logits_bias").reshape(-1)
    if c.share_embeddings:
        table = _first(t, "model.shared.weight", "model.encoder.embed_tokens.weight")
        params["src_embedding"] = {"embedding": table}
        params["final_logits_bias"] = bias_V
    else:
        src = _first(t, "model.encoder.embed_tokens.weight", "model.shared.weight")
        tgt = _first(t, "model.decoder.embed_tokens.weight", "model.shared.weight")
        head_VD = _first(t, "lm_head.weight", "model.decoder.embed_tokens.weight", "model.shared.weight")
        params["src_embedding"] = {"embedding": src}
        params["tgt_embedding"] = {"embedding": tgt}
        params["output_projection"] = {"kernel": np.ascontiguousarray(head_VD.T), "bias": bias_V}
    _check_shapes(params, config)
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
            for ours, norm, theirs in sublayers:
                out.update(_attention_to_hf(layer[ours], f"{prefix}.{theirs}"))
                out[f"{prefix}.{theirs}_layer_norm.weight"] = layer[norm]["norm"]["scale"]
                out[f"{prefix}.{theirs}_layer_norm.bias"] = layer[norm]["norm"]["bias"]
            ffn = layer["feed_forward"]
            for name in ("fc1", "fc2"):
                ours = ffn["w1" if name == "fc1" else "w2"]
                out[f"{prefix}.{name}.weight"] = ours["kernel"].T
                out[f"{prefix}.{name}.bias"] = ours["bias"]
            out[f"{prefix}.final_layer_norm.weight"] = layer["feed_forward_norm"]["norm"]["scale"]
            out[f"{prefix}.final_layer_norm.bias"] = layer["feed_forward_norm"]["norm"]["bias"]
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
    logical name ``embed`` (:mod:`jaxformer.sharding`).
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jaxformer.model import Transformer

    D = config.d_model
    perm = np.concatenate([np.arange(0, D, 2), np.arange(1, D, 2)])
    ids = jnp.ones((1, 2), jnp.int32)
    boxed = jax.eval_shape(lambda: Transformer(config).init(jax.random.key(0), ids, ids)["params"])
    names = jax.tree_util.tree_map(lambda b: b.names, boxed, is_leaf=lambda b: isinstance(b, nn.Partitioned))

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


def _check_shapes(params: dict[str, Any], config: TransformerConfig) -> None:
    """Compares every array with the shapes :class:`~jaxformer.model.Transformer` expects."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jaxformer.model import Transformer

    ids = jnp.ones((1, 2), jnp.int32)
    expected = jax.eval_shape(
        lambda: nn.unbox(Transformer(config).init(jax.random.key(0), ids, ids)["params"]))
    want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    have = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(params)}
    if want != have:
        problems = sorted(f"{k}: checkpoint {have.get(k)} vs model {want.get(k)}"
                          for k in set(want) | set(have) if want.get(k) != have.get(k))
        raise ConversionError("the weights do not fit the config: " + "; ".join(problems[:8]))


def read_hf_weights(hf_dir: Path) -> dict[str, np.ndarray]:
    """The state dict of ``hf_dir`` as NumPy: ``model.safetensors`` (or its shards).

    Raises:
      ConversionError: only ``pytorch_model.bin`` is there (a pickle needs torch);
        the message gives the one-line fix.
    """
    from safetensors.numpy import load_file

    single = hf_dir / "model.safetensors"
    shards = sorted(hf_dir.glob("model-*-of-*.safetensors"))
    if single.exists() or shards:
        tensors: dict[str, np.ndarray] = {}
        for path in [single] if single.exists() else shards:
            tensors.update(load_file(str(path)))
        return tensors
    if (hf_dir / "pytorch_model.bin").exists():
        raise ConversionError(
            f"{hf_dir} has only pytorch_model.bin, a torch pickle that cannot be read without torch. "
            f"Get the safetensors weights (`huggingface-cli download MODEL model.safetensors`, or the "
            f"repo's refs/pr/N branch), or convert once where torch is installed: "
            f"`python -c \"from transformers import MarianMTModel as M; "
            f"M.from_pretrained('{hf_dir}').save_pretrained('{hf_dir}')\"`.")
    raise ConversionError(f"{hf_dir} has no model.safetensors (nor pytorch_model.bin).")


# ---------------------------------------------------------------------- run directories
def import_marian(hf_dir: str | Path, workdir: str | Path) -> TransformerConfig:
    """Writes the run directory ``workdir`` from the Hugging Face Marian dir ``hf_dir``.

    Writes ``config.json`` (model config, tokenizer record, generation defaults from
    ``generation_config.json``), ``tokenizer/`` (the Marian tokenizer files) and the
    parameters as the best checkpoint at step 0 (params only, as
    :meth:`jaxformer.checkpoints.RunCheckpoints.restore_params` reads them).

    Raises:
      ConversionError: unsupported model, missing files, or ``workdir`` already holds
        a run.
    """
    from jaxformer.checkpoints import RunCheckpoints

    hf_dir, workdir = Path(hf_dir), Path(workdir)
    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"{hf_dir}/config.json not found: pass the folder of a downloaded "
                              f"Hugging Face Marian model (e.g. from `huggingface-cli download`).")
    if any((workdir / name).exists() for name in ("config.json", "best", "checkpoints")):
        raise ConversionError(f"{workdir} already holds a run; choose a new --workdir.")
    hf = json.loads((hf_dir / "config.json").read_text())
    config = config_from_hf(hf)
    for name in ("source.spm", "target.spm", "vocab.json"):
        if not (hf_dir / name).is_file():
            raise ConversionError(f"{hf_dir}/{name} not found: a Marian model needs its tokenizer "
                                  f"files (source.spm, target.spm, vocab.json) beside the weights.")
    params = params_from_hf(read_hf_weights(hf_dir), config)
    generation = _generation_defaults(hf_dir, hf)
    (workdir / "tokenizer").mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, workdir / "tokenizer" / name)
    tokenizer_config = _read_json(hf_dir / "tokenizer_config.json")
    record = {"model": config.to_dict(),
              "tokenizer": {"kind": "marian", "dir": "tokenizer", "pad_id": config.pad_id,
                            "eos_id": hf.get("eos_token_id", 0),
                            "decoder_start_id": hf.get("decoder_start_token_id", config.pad_id),
                            "separate_vocabs": bool(tokenizer_config.get("separate_vocabs", False))},
              "target_language": tokenizer_config.get("target_lang") or "xx",
              "generation": generation,
              "imported_from": {"format": "huggingface-marian", "name": hf.get("_name_or_path", hf_dir.name)}}
    checkpoints = RunCheckpoints(workdir)
    try:
        # An imported model has no dev BLEU of ours: 0.0 marks the step as the one to use.
        checkpoints.save_best(0, params, bleu=0.0)
        checkpoints.wait()
    finally:
        checkpoints.close()
    (workdir / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    return config


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _generation_defaults(hf_dir: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """Decoding defaults of the model (``generation_config.json``, else config.json):
    beam size, length limit, HF length normalisation with its exponent, pad never generated.
    """
    gen = {**hf, **_read_json(hf_dir / "generation_config.json")}
    pad = hf["pad_token_id"]
    bad = gen.get("bad_words_ids") or [[pad]]
    if any(ids != [pad] for ids in bad):
        raise ConversionError(f"generation config bad_words_ids={bad}: jaxformer's decoders ban only "
                              f"the pad id {pad} (and the decoder start id); other bans are not supported.")
    if gen.get("early_stopping") not in (None, False):
        print(f"note: early_stopping={gen['early_stopping']!r} in the generation config; jaxformer "
              f"reproduces generate's default (False) stopping rule", file=sys.stderr)
    return {"beam_size": int(gen.get("num_beams") or 1), "max_length": int(gen.get("max_length") or 512),
            "length_penalty": float(gen.get("length_penalty", 1.0)), "length_normalization": "hf",
            "banned_ids": sorted({ids[0] for ids in bad}),
            "forced_eos": gen.get("forced_eos_token_id") is not None}


def export_marian(workdir: str | Path, out_dir: str | Path) -> None:
    """Writes run ``workdir`` as a Hugging Face ``MarianMTModel`` directory ``out_dir``.

    Raises:
      ConversionError: a pre-norm run; a run whose tokenizer is not a Marian one
        (a joint sentencepiece model exports as ``source.spm = target.spm`` with a
        ``vocab.json`` built from it).
    """
    from safetensors.numpy import save_file

    from jaxformer.translate import Translator

    workdir, out_dir = Path(workdir), Path(out_dir)
    record = json.loads((workdir / "config.json").read_text())
    config = TransformerConfig.from_dict(record["model"])
    config_to_hf(config, eos_id=0, decoder_start_id=0)   # fails early on a pre-norm run
    translator = Translator(workdir, batch_size=1)
    params = translator.params
    if config.positional_layout != "split":
        # Marian computes the split table; permuting D turns ours into it exactly.
        params = interleaved_to_split(params, config)
        config = config.replace(positional_layout="split")
    if config.layer_norm_epsilon != MARIAN_LAYER_NORM_EPSILON:
        print(f"warning: this run's LayerNorm epsilon is {config.layer_norm_epsilon}; transformers' "
              f"Marian uses {MARIAN_LAYER_NORM_EPSILON}, so its outputs differ slightly", file=sys.stderr)
    tok = translator.tokenizer
    hf = config_to_hf(config, eos_id=tok.eos_id, decoder_start_id=tok.decoder_start_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(params_to_hf(params, config), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    generation = record.get("generation", {})
    banned = sorted({config.pad_id, tok.bos_id})    # what our decoders never generate
    gen = {"decoder_start_token_id": tok.decoder_start_id, "eos_token_id": tok.eos_id,
           "forced_eos_token_id": tok.eos_id, "pad_token_id": config.pad_id,
           "bad_words_ids": [[i] for i in banned], "num_beams": generation.get("beam_size", 4),
           "max_length": generation.get("max_length", config.max_len)}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save_marian(out_dir)


# ---------------------------------------------------------------------- CLI
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="jaxformer-convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR", help="local Hugging Face Marian model folder")
    direction.add_argument("--to-hf", metavar="RUN", help="jaxformer run directory to export")
    parser.add_argument("--workdir", help="run directory to write (with --from-hf)")
    parser.add_argument("--out", help="Hugging Face model folder to write (with --to-hf)")
    args = parser.parse_args(argv)
    if args.from_hf and not args.workdir:
        parser.error("--from-hf needs --workdir RUN")
    if args.to_hf and not args.out:
        parser.error("--to-hf needs --out DIR")
    try:
        if args.from_hf:
            config = import_marian(args.from_hf, args.workdir)
            print(f"wrote {args.workdir}: {config.num_encoder_layers}+{config.num_decoder_layers} layers, "
                  f"d_model {config.d_model}, vocab {config.src_vocab_size}/{config.tgt_vocab_size}")
        else:
            export_marian(args.to_hf, args.out)
            print(f"wrote {args.out}")
    except (ValueError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
