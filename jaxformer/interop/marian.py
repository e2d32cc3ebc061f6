"""Hugging Face Marian (OPUS-MT) folders as jaxformer run directories and back (the command
:mod:`jaxformer.cli.convert`): configs after transformers' ``MarianConfig``, weights through
``safetensors.numpy`` (no torch) by :mod:`jaxformer.interop.marian_weights`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from jaxformer.data.tokenizer import MarianTokenizer
from jaxformer.decode.served_run import ServedRun
from jaxformer.interop.marian_weights import (  # noqa: F401  (the public names of the conversion)
    ConversionError,
    interleaved_to_split,
    params_from_hf,
    params_to_hf,
    read_hf_weights,
    refuse,
)
from jaxformer.model.config import TransformerConfig
from jaxformer.model.scan import unstack_layers

# Marian keys that name behaviour jaxformer does not have, with the value it needs.
_REQUIRED_HF = {"scale_embedding": True, "normalize_before": False, "normalize_embedding": False,
                "add_final_layer_norm": False, "static_position_embeddings": True,
                "add_bias_logits": False}
_ACTIVATION_FROM_HF = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu": "gelu"}
MARIAN_LAYER_NORM_EPSILON = 1e-5   # torch.nn.LayerNorm's default, fixed in modeling_marian.py
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json", "tokenizer_config.json")


def _config_problems(hf: dict[str, Any]) -> list[str]:
    """What a Hugging Face config asks that jaxformer's Marian model cannot do."""
    if hf.get("model_type") != "marian":
        return [f"config.json has model_type={hf.get('model_type')!r}; only Marian (OPUS-MT) and "
                f"M2M100/NLLB-200 (model_type 'm2m_100') models convert"]
    missing = [k for k in ("vocab_size", "d_model", "encoder_attention_heads", "decoder_attention_heads",
                           "encoder_ffn_dim", "decoder_ffn_dim", "encoder_layers", "decoder_layers",
                           "max_position_embeddings", "pad_token_id") if hf.get(k) is None]
    if missing:
        return [f"config.json lacks {missing}: not a complete MarianConfig"]
    # an absent scale_embedding is MarianConfig's default, False; the others are legacy keys
    problems = [f"config.json sets {key}={value!r}; jaxformer's Marian import needs {key}={needed!r} (the "
                f"OPUS-MT architecture)" for key, needed in _REQUIRED_HF.items()
                if (value := hf.get(key, False if key == "scale_embedding" else needed)) != needed]
    problems += [f"{a}={hf[a]} != {b}={hf[b]}: jaxformer uses one value for both stacks"
                 for a, b in (("encoder_attention_heads", "decoder_attention_heads"),
                              ("encoder_ffn_dim", "decoder_ffn_dim")) if hf[a] != hf[b]]
    if hf.get("activation_function", "gelu") not in _ACTIVATION_FROM_HF:
        problems.append(f"activation_function={hf['activation_function']!r} is not supported; jaxformer "
                        f"has {sorted(_ACTIVATION_FROM_HF)}")
    return problems


def config_from_hf(hf: dict[str, Any]) -> TransformerConfig:
    """The :class:`TransformerConfig` computing what a ``MarianConfig`` does (swish FFN, split positions,
    ``final_logits_bias``, ε 1e-5); dropout rates kept for fine-tuning. Raises ``ConversionError``: not a
    Marian config, or options jaxformer lacks, in one message."""
    refuse(_config_problems(hf))
    shared = hf.get("share_encoder_decoder_embeddings", True)
    share = bool(shared and hf.get("tie_word_embeddings", True))
    src_vocab = hf["vocab_size"]
    tgt_vocab = src_vocab if shared else (hf.get("decoder_vocab_size") or src_vocab)
    return TransformerConfig(
        src_vocab_size=src_vocab, tgt_vocab_size=tgt_vocab,
        d_model=hf["d_model"], num_heads=hf["encoder_attention_heads"], d_ff=hf["encoder_ffn_dim"],
        num_encoder_layers=hf["encoder_layers"], num_decoder_layers=hf["decoder_layers"],
        dropout_rate=float(hf.get("dropout", 0.1)),
        attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
        max_len=hf["max_position_embeddings"], pad_id=hf["pad_token_id"], share_embeddings=share,
        norm_position="post", activation=_ACTIVATION_FROM_HF[hf.get("activation_function", "gelu")],
        positional_layout="split", final_logits_bias=share, layer_norm_epsilon=MARIAN_LAYER_NORM_EPSILON)


def config_to_hf(config: TransformerConfig, *, eos_id: int, decoder_start_id: int) -> dict[str, Any]:
    """The ``MarianConfig`` (as a dict) of a post-norm jaxformer model. Raises ``ConversionError``: a pre-norm
    model (transformers' Marian normalises after each residual)."""
    c = config
    if c.norm_position != "post":
        raise ConversionError(
            f"this run is pre-norm (norm_position={c.norm_position!r}): transformers' MarianMTModel is "
            f"post-norm only (LayerNorm after each residual, no final LayerNorm), so the weights "
            f"would compute something else. Only post-norm runs export (train with "
            f"--norm-position post).")
    return {
        "model_type": "marian", "architectures": ["MarianMTModel"],
        "vocab_size": c.src_vocab_size, "decoder_vocab_size": c.tgt_vocab_size,
        "share_encoder_decoder_embeddings": c.share_embeddings, "tie_word_embeddings": c.share_embeddings,
        "d_model": c.d_model, "encoder_attention_heads": c.num_heads, "decoder_attention_heads": c.num_heads,
        "encoder_ffn_dim": c.d_ff, "decoder_ffn_dim": c.d_ff, "encoder_layers": c.num_encoder_layers,
        "decoder_layers": c.num_decoder_layers, "num_hidden_layers": c.num_encoder_layers,
        "dropout": c.dropout_rate, "attention_dropout": c.attention_dropout_rate,
        "activation_dropout": 0.0, "activation_function": c.activation,
        "max_position_embeddings": c.max_len, "scale_embedding": True, "is_encoder_decoder": True,
        "pad_token_id": c.pad_id, "eos_token_id": eos_id, "forced_eos_token_id": eos_id,
        "decoder_start_token_id": decoder_start_id, "bos_token_id": None,
        "static_position_embeddings": True, "normalize_before": False, "normalize_embedding": False,
        "add_final_layer_norm": False, "use_cache": True,
    }


def _read_folder(hf_dir: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A Marian folder's JSON files ``(config, generation config over it, tokenizer_config)``; the tokenizer
    is loaded to name a damaged file now. Raises ``ConversionError``: every problem (missing or unreadable
    files, unsupported fields) and its fix."""
    problems: list[str] = []

    def read(name: str) -> dict[str, Any]:
        path = hf_dir / name
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            if isinstance(data, dict):
                return data
            problems.append(f"{path} is not a JSON object, as a Hugging Face model's must be")
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append(f"{path} is not readable JSON ({e}): a damaged or partial download? "
                            f"Download it again")
        return {}

    hf, tokenizer_config = read("config.json"), read("tokenizer_config.json")
    gen = {**hf, **read("generation_config.json")}
    if not (hf_dir / "config.json").is_file():
        problems.append(f"{hf_dir}/config.json not found: pass the folder of a downloaded Hugging Face "
                        f"Marian model (e.g. from `hf download`)")
    elif hf:
        problems += _config_problems(hf) or _generation_problems(hf, gen)
    absent = [name for name in ("source.spm", "target.spm", "vocab.json") if not (hf_dir / name).is_file()]
    if absent:
        problems.append(f"{hf_dir} lacks {', '.join(absent)}: a Marian model needs its tokenizer files "
                        f"(source.spm, target.spm, vocab.json) beside the weights")
    else:
        try:
            MarianTokenizer(hf_dir, separate_vocabs=bool(tokenizer_config.get("separate_vocabs", False)))
        except (ValueError, OSError) as e:
            problems.append(str(e).rstrip("."))
    refuse(problems)
    return hf, gen, tokenizer_config


def _generation_problems(hf: dict[str, Any], gen: dict[str, Any]) -> list[str]:
    """What config.json and the generation config over it ask that jaxformer's decoders do not do."""
    pad, eos = hf["pad_token_id"], hf.get("eos_token_id", 0)
    start, first = gen.get("decoder_start_token_id", pad), hf.get("decoder_start_token_id", pad)
    bad = gen.get("bad_words_ids") or [[pad]]
    return [problem for wrong, problem in (
        (first == eos, f"decoder_start_token_id={first} is the eos id: jaxformer's decoders never generate "
                       f"the start token, so this model could never end a translation. Only models whose "
                       f"decoder starts with another token (OPUS-MT: the pad id) convert"),
        (any(ids not in ([pad], [start]) for ids in bad),
         f"generation config bad_words_ids={bad}: jaxformer's decoders ban only the pad id {pad} and the "
         f"decoder start id {start}; other bans are not supported"),
        (gen.get("max_length") and gen.get("forced_eos_token_id") != eos,
         f"generation config max_length={gen.get('max_length')} without forced_eos_token_id={eos}: generate "
         f"then cuts a hypothesis at the limit without eos, which jaxformer's beam search does not "
         f"reproduce (it ends every hypothesis with eos). Set forced_eos_token_id={eos} (as OPUS-MT "
         f"models do) in config.json or generation_config.json")) if wrong]


def _generation_defaults(gen: dict[str, Any], pad: int) -> dict[str, Any]:
    """The run's decoding defaults from the generation config over config.json (``max_length``
    with the start token, ``None``: the translate tool's)."""
    if gen.get("early_stopping") not in (None, False, True):
        print(f"note: early_stopping={gen['early_stopping']!r} in the generation config; jaxformer "
              f"reproduces generate's default (False) stopping rule", file=sys.stderr)
    bad = gen.get("bad_words_ids") or [[pad]]
    return {"beam_size": int(gen.get("num_beams") or 1),
            "max_length": int(gen["max_length"]) if gen.get("max_length") else None,
            "length_penalty": float(gen.get("length_penalty", 1.0)), "length_normalization": "hf",
            "early_stopping": gen.get("early_stopping") is True,
            "banned_ids": sorted({ids[0] for ids in bad}),
            "forced_eos": gen.get("forced_eos_token_id") is not None,
            "no_repeat_ngram_size": int(gen.get("no_repeat_ngram_size") or 0),
            "repetition_penalty": float(gen.get("repetition_penalty") or 1.0)}


def check_new_workdir(workdir: Path) -> None:
    """Refuses (``ConversionError``) a ``workdir`` that already holds a run."""
    refuse([f"{workdir} already holds a run; choose a new --workdir"]
           if any((workdir / name).exists() for name in ("config.json", "best", "checkpoints")) else [])


def import_marian(hf_dir: str | Path, workdir: str | Path) -> TransformerConfig:
    """Writes run ``workdir`` from Marian folder ``hf_dir``: ``config.json`` (model, tokenizer, generation
    defaults), ``tokenizer/``, the parameters as the best checkpoint of step 0. Raises ``ConversionError``:
    ``workdir`` holds a run; an unsupported model, missing or damaged files."""
    from jaxformer.run.checkpoints import RunCheckpoints

    hf_dir, workdir = Path(hf_dir), Path(workdir)
    check_new_workdir(workdir)
    hf, gen, tokenizer_config = _read_folder(hf_dir)
    config = config_from_hf(hf)
    params = params_from_hf(read_hf_weights(hf_dir), config)
    (workdir / "tokenizer").mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, workdir / "tokenizer" / name)
    record = {"model": config.to_dict(),
              "tokenizer": {"kind": "marian", "dir": "tokenizer", "pad_id": config.pad_id,
                            "eos_id": hf.get("eos_token_id", 0),
                            "decoder_start_id": hf.get("decoder_start_token_id", config.pad_id),
                            "separate_vocabs": bool(tokenizer_config.get("separate_vocabs", False))},
              "target_language": tokenizer_config.get("target_lang") or "xx",
              **({"source_language": tokenizer_config["source_lang"]} if tokenizer_config.get("source_lang")
                 else {}),
              "generation": _generation_defaults(gen, config.pad_id),
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


EXPORT_FILES = ("model.safetensors", "config.json", "generation_config.json", *TOKENIZER_FILES)


def _check_export_folder(workdir: Path, out_dir: Path) -> None:
    """Refuses an ``--out`` that is a file or holds a run or a model (other files, such as a Hub
    clone's ``README.md``, stay beside the export); raises ``ConversionError`` naming the fix."""
    present = [name for name in EXPORT_FILES if (out_dir / name).exists()]
    run = out_dir.exists() and (out_dir.resolve() == workdir.resolve() or any(
        (out_dir / name).exists() for name in ("checkpoints", "best", "prepared", "tokenizer")))
    problem = ("is a file; choose a new folder" if out_dir.exists() and not out_dir.is_dir() else
               "holds a jaxformer run, which the export would overwrite; choose a new folder" if run else
               f"already holds a model ({', '.join(present)}), which the export would overwrite; remove "
               f"those files or choose a new folder" if present else None)
    if problem:
        raise ConversionError(f"--out {str(out_dir)!r} {problem}.")


def export_marian(run: ServedRun | str | Path, out_dir: str | Path) -> None:
    """Writes ``run`` (a :class:`~jaxformer.decode.served_run.ServedRun` or its folder) as a
    ``MarianMTModel`` folder ``out_dir`` (a joint sentencepiece model as ``source.spm =
    target.spm`` with a ``vocab.json`` built from it). Raises ``ConversionError``: a pre-norm
    run; an ``out_dir`` holding a run or a model."""
    from safetensors.numpy import save_file

    run = run if isinstance(run, ServedRun) else ServedRun.load(run)
    out_dir, record, config = Path(out_dir), run.record, run.config
    _check_export_folder(run.root, out_dir)
    config_to_hf(config, eos_id=0, decoder_start_id=0)   # fails early on a pre-norm run
    params = unstack_layers(run.restore_params()[0])   # Marian names each layer; a scanned run is unrolled
    config = config.replace(scan_layers=False)
    if config.positional_layout != "split":
        # Marian computes the split table; permuting D turns ours into it exactly.
        params = interleaved_to_split(params, config)
        config = config.replace(positional_layout="split")
    if config.layer_norm_epsilon != MARIAN_LAYER_NORM_EPSILON:
        print(f"warning: this run's LayerNorm epsilon is {config.layer_norm_epsilon}; transformers' "
              f"Marian uses {MARIAN_LAYER_NORM_EPSILON}, so its outputs differ slightly", file=sys.stderr)
    tok = run.tokenizer
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
           "max_length": generation.get("max_length") or config.max_len}
    for name, off in (("no_repeat_ngram_size", 0), ("repetition_penalty", 1.0), ("early_stopping", False)):
        if generation.get(name, off) != off:
            gen[name] = generation[name]
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save_marian(out_dir)
