"""Hugging Face M2M100 and NLLB-200 folders (``M2M100ForConditionalGeneration``; NLLB-200 dense
uses the same class) as jaxformer run directories and back (the command :mod:`jaxformer.cli.convert`).
The model after transformers' ``models/m2m_100/modeling_m2m_100.py``: pre-norm with a final
LayerNorm per stack, scaled embeddings, fairseq positions past the padding index
(``positional_layout="fairseq"``), one table tied to the output; decoding as ``generate``: the
decoder starts with ``</s>``, the target language is forced first, nothing is banned.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from jaxformer.data.multilingual import TOKENIZER_FILES, MultilingualTokenizer, scoring_language
from jaxformer.decode.served_run import ServedRun
from jaxformer.interop.marian import (
    _ACTIVATION_FROM_HF,
    _check_export_folder,
    _generation_defaults,
    check_new_workdir,
)
from jaxformer.interop.marian_weights import (  # noqa: F401  (ConversionError: what this module raises)
    ConversionError,
    params_from_hf,
    params_to_hf,
    read_hf_weights,
    refuse,
)
from jaxformer.model.config import TransformerConfig
from jaxformer.model.scan import unstack_layers

M2M100_LAYER_NORM_EPSILON = 1e-5   # torch.nn.LayerNorm's default, fixed in modeling_m2m_100.py
# NLLB-200's dense checkpoints (their config.json): (d_model, heads, d_ff, layers per stack), one
# 256,206-piece table; pre-norm, ReLU. The distilled 600M and 1.3B share the shapes of their teachers'.
NLLB200_SHAPES = {"600M": (1024, 16, 4096, 12), "1.3B": (1024, 16, 8192, 24), "3.3B": (2048, 16, 8192, 24)}
NLLB200_VOCAB = 256_206


def nllb200_flags(size: str) -> list[str]:
    """``jaxformer-compile`` flags of NLLB-200 ``size``'s shape (``--preset big``: one shared table)."""
    d_model, heads, d_ff, layers = NLLB200_SHAPES[size]
    return ["--preset", "big", "--d-model", str(d_model), "--num-heads", str(heads), "--d-ff", str(d_ff),
            "--num-layers", str(layers), "--norm-position", "pre", "--vocab-size", str(NLLB200_VOCAB)]
_SIZES = ("vocab_size", "d_model", "encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim",
          "decoder_ffn_dim", "encoder_layers", "decoder_layers", "max_position_embeddings", "pad_token_id")


def config_problems(hf: dict[str, Any]) -> list[str]:
    """What an ``M2M100Config`` asks that jaxformer's model cannot do (every one named)."""
    missing = [k for k in _SIZES if hf.get(k) is None]
    if missing:
        return [f"config.json lacks {missing}: not a complete M2M100Config"]
    problems = [f"{a}={hf[a]} != {b}={hf[b]}: jaxformer uses one value for both stacks"
                for a, b in (("encoder_attention_heads", "decoder_attention_heads"),
                             ("encoder_ffn_dim", "decoder_ffn_dim")) if hf[a] != hf[b]]
    if hf.get("activation_function", "relu") not in _ACTIVATION_FROM_HF:
        problems.append(f"activation_function={hf['activation_function']!r} is not supported; jaxformer has "
                        f"{sorted(_ACTIVATION_FROM_HF)}")
    problems += [f"config.json sets {key}={hf[key]!r}; jaxformer needs {key}=True ({why})"
                 for key, why in (("scale_embedding", "embeddings × √d_model"),
                                  ("tie_word_embeddings", "one table for source, target and output"))
                 if hf.get(key, True) is not True]
    if hf["d_model"] % 2 or hf["d_model"] < 4:
        problems.append(f"d_model={hf['d_model']}: fairseq positions need an even d_model ≥ 4")
    return problems


def config_from_hf(hf: dict[str, Any]) -> TransformerConfig:
    """The :class:`TransformerConfig` computing what an ``M2M100Config`` does; dropout rates kept for
    fine-tuning (layerdrop and activation dropout act in training only and are not reproduced).
    Raises ``ConversionError``: options jaxformer lacks, in one message."""
    refuse(config_problems(hf))
    return TransformerConfig(
        src_vocab_size=hf["vocab_size"], tgt_vocab_size=hf["vocab_size"], d_model=hf["d_model"],
        num_heads=hf["encoder_attention_heads"], d_ff=hf["encoder_ffn_dim"],
        num_encoder_layers=hf["encoder_layers"], num_decoder_layers=hf["decoder_layers"],
        dropout_rate=float(hf.get("dropout", 0.1)),
        attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
        max_len=hf["max_position_embeddings"], pad_id=hf["pad_token_id"], share_embeddings=True,
        norm_position="pre", activation=_ACTIVATION_FROM_HF[hf.get("activation_function", "relu")],
        positional_layout="fairseq", final_logits_bias=False, layer_norm_epsilon=M2M100_LAYER_NORM_EPSILON)


def config_to_hf(config: TransformerConfig, ids: dict[str, int]) -> dict[str, Any]:
    """The ``M2M100Config`` (a dict) of a jaxformer model of this family; ``ids``: ``bos``, ``eos``,
    ``pad``, ``decoder_start``. Raises ``ConversionError``: a model of another shape (named)."""
    c = config
    wrong = [f"{name}={value!r} (needs {needed!r})" for name, value, needed in (
        ("norm_position", c.norm_position, "pre"), ("positional_layout", c.positional_layout, "fairseq"),
        ("share_embeddings", c.share_embeddings, True), ("final_logits_bias", c.final_logits_bias, False))
        if value != needed]
    refuse([f"this run is not an M2M100/NLLB model: {', '.join(wrong)}. Only runs imported (or "
            f"fine-tuned) from such a model export as M2M100ForConditionalGeneration"] if wrong else [])
    return {
        "model_type": "m2m_100", "architectures": ["M2M100ForConditionalGeneration"],
        "vocab_size": c.src_vocab_size, "d_model": c.d_model, "encoder_attention_heads": c.num_heads,
        "decoder_attention_heads": c.num_heads, "encoder_ffn_dim": c.d_ff, "decoder_ffn_dim": c.d_ff,
        "encoder_layers": c.num_encoder_layers, "decoder_layers": c.num_decoder_layers,
        "num_hidden_layers": c.num_encoder_layers, "dropout": c.dropout_rate,
        "attention_dropout": c.attention_dropout_rate, "activation_dropout": 0.0, "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0, "activation_function": c.activation, "max_position_embeddings": c.max_len,
        "scale_embedding": True, "tie_word_embeddings": True, "is_encoder_decoder": True, "use_cache": True,
        "pad_token_id": ids["pad"], "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
        "decoder_start_token_id": ids["decoder_start"],
    }


def tokenizer_kind(hf_dir: Path, tokenizer_config: dict[str, Any]) -> str:
    """``"nllb"`` (a ``tokenizer.json`` or an ``Nllb*`` tokenizer class) or ``"m2m100"``."""
    name = str(tokenizer_config.get("tokenizer_class") or "")
    return "nllb" if name.startswith("Nllb") or (not name and (hf_dir / "tokenizer.json").is_file()) \
        else "m2m100"


def _read_folder(hf_dir: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], str]:
    """``(config, generation config over it, tokenizer_config, tokenizer kind)``; the tokenizer is loaded
    to name a damaged file now. Raises ``ConversionError``: every problem and its fix."""
    problems: list[str] = []

    def read(name: str) -> dict[str, Any]:
        path = hf_dir / name
        try:
            return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append(f"{path} is not readable JSON ({e}): download it again")
            return {}

    hf, tokenizer_config = read("config.json"), read("tokenizer_config.json")
    gen = {**hf, **read("generation_config.json")}
    problems += config_problems(hf)
    kind = tokenizer_kind(hf_dir, tokenizer_config)
    if tokenizer_config.get("legacy_behaviour"):
        problems.append("tokenizer_config.json sets legacy_behaviour=true (language token after </s>); "
                        "jaxformer reads NLLB's current layout only ([lang] pieces </s>)")
    absent = [n for n in TOKENIZER_FILES[kind][:2 if kind == "m2m100" else 1] if not (hf_dir / n).is_file()]
    if absent:
        problems.append(f"{hf_dir} lacks {', '.join(absent)}: the {kind} tokenizer files belong beside the "
                        f"weights")
    else:
        try:
            tok = MultilingualTokenizer(hf_dir, kind)
            problems += [f"config.json's {key}={hf.get(key)} is not the tokenizer's {piece} ({want}): "
                         f"the tokenizer files belong to another model"
                         for key, piece, want in (("pad_token_id", "<pad>", tok.pad_id),
                                                  ("eos_token_id", "</s>", tok.eos_id))
                         if hf.get(key, want) != want]
        except ValueError as e:
            problems.append(str(e).rstrip("."))
    bad = gen.get("bad_words_ids") or []
    if any(len(ids) != 1 for ids in bad):
        problems.append(f"generation config bad_words_ids={bad}: jaxformer bans single tokens only")
    refuse(problems)
    return hf, gen, tokenizer_config, kind


def import_m2m100(hf_dir: str | Path, workdir: str | Path) -> TransformerConfig:
    """Writes run ``workdir`` from an M2M100/NLLB folder ``hf_dir``: ``config.json`` (model, tokenizer,
    languages, generation defaults), ``tokenizer/``, the parameters as the best checkpoint of step 0.
    Raises ``ConversionError``: ``workdir`` holds a run; an unsupported model, missing or damaged files."""
    from jaxformer.run.checkpoints import RunCheckpoints

    hf_dir, workdir = Path(hf_dir), Path(workdir)
    check_new_workdir(workdir)
    hf, gen, tokenizer_config, kind = _read_folder(hf_dir)
    config = config_from_hf(hf)
    params = params_from_hf(read_hf_weights(hf_dir), config)
    for key in ("encoder_layerdrop", "decoder_layerdrop", "activation_dropout"):
        if hf.get(key):
            print(f"note: {key}={hf[key]} acts in training only; jaxformer's fine-tuning does without it",
                  file=sys.stderr)
    (workdir / "tokenizer").mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES[kind]:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, workdir / "tokenizer" / name)
    tok = MultilingualTokenizer(workdir / "tokenizer", kind)
    forced = gen.get("forced_bos_token_id")
    tgt_lang = tokenizer_config.get("tgt_lang") or (tok.piece_of.get(forced) if forced is not None else None)
    tgt_lang = next((code for code, token in tok.codes.items() if token == tgt_lang), tgt_lang)
    src_lang = tokenizer_config.get("src_lang")
    generation = _generation_defaults(gen, config.pad_id)
    generation["banned_ids"] = sorted({ids[0] for ids in gen.get("bad_words_ids") or []})
    record = {"model": config.to_dict(),
              "tokenizer": {"kind": kind, "dir": "tokenizer", "pad_id": config.pad_id, "eos_id": tok.eos_id,
                            "decoder_start_id": hf.get("decoder_start_token_id", tok.eos_id),
                            "src_lang": src_lang, "tgt_lang": tgt_lang},
              "target_language": scoring_language(tgt_lang) if tgt_lang else "xx",
              **({"source_language": scoring_language(src_lang)} if src_lang else {}),
              "generation": generation,
              "imported_from": {"format": f"huggingface-{kind}",
                                "name": hf.get("_name_or_path", hf_dir.name)}}
    checkpoints = RunCheckpoints(workdir)
    try:
        checkpoints.save_best(0, params, bleu=0.0)   # no dev BLEU of ours: 0.0 marks the step to use
        checkpoints.wait()
    finally:
        checkpoints.close()
    (workdir / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    return config


def export_m2m100(run: ServedRun | str | Path, out_dir: str | Path) -> None:
    """Writes ``run`` (an imported or fine-tuned M2M100/NLLB model: a
    :class:`~jaxformer.decode.served_run.ServedRun` or its folder) as an
    ``M2M100ForConditionalGeneration`` folder ``out_dir`` with its tokenizer files and its
    generation config (the record's ``generation``, which a fine-tune inherits). Raises
    ``ConversionError``: a run of another architecture; an ``out_dir`` holding a run or a model."""
    from safetensors.numpy import save_file

    run = run if isinstance(run, ServedRun) else ServedRun.load(run)
    out_dir, record, config = Path(out_dir), run.record, run.config
    _check_export_folder(run.root, out_dir)
    config_to_hf(config, {"bos": 0, "eos": 0, "pad": 0, "decoder_start": 0})   # another architecture: now
    tok = run.tokenizer
    ids = {"bos": tok.id_of.get("<s>", 0), "eos": tok.eos_id, "pad": tok.pad_id,
           "decoder_start": tok.decoder_start_id}
    hf = config_to_hf(config, ids)
    params = unstack_layers(run.restore_params()[0])   # transformers names each layer; a scanned run unrolled
    config = config.replace(scan_layers=False)
    tensors = params_to_hf(params, config)
    del tensors["final_logits_bias"]             # M2M100 has none
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    generation = record.get("generation", {})
    gen = {"decoder_start_token_id": ids["decoder_start"], "bos_token_id": ids["bos"],
           "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
           "max_length": generation.get("max_length") or config.max_len}
    for name, key, off in (("beam_size", "num_beams", 1), ("length_penalty", "length_penalty", 1.0),
                           ("early_stopping", "early_stopping", False),
                           ("no_repeat_ngram_size", "no_repeat_ngram_size", 0),
                           ("repetition_penalty", "repetition_penalty", 1.0)):
        if generation.get(name, off) != off:
            gen[key] = generation[name]
    if generation.get("forced_eos"):
        gen["forced_eos_token_id"] = ids["eos"]
    if generation.get("banned_ids"):
        gen["bad_words_ids"] = [[i] for i in generation["banned_ids"]]
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save_hf(out_dir)
