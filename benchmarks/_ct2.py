"""The CTranslate2 side of ``benchmarks/bulk_translate.py``, run in its child processes:
converting the run's Marian export, and translating the input file."""

from __future__ import annotations

import time
from pathlib import Path


def convert(spec: dict) -> None:
    """The Marian export as CT2 float32 and int8 models (``bulk_translate.py``'s docstring, step 2)."""
    from ctranslate2.converters import TransformersConverter
    from ctranslate2.converters import transformers as ct2_hf

    class RunLoader(ct2_hf.BartLoader):
        """CTranslate2's Marian loader without its OPUS-MT rules (pad last, zero start)."""
        architecture_name = "MarianMTModel"

        def get_model_spec(self, model):
            model.config.normalize_before = model.config.normalize_embedding = False
            return super().get_model_spec(model)

        def set_config(self, config, model, tokenizer):
            super().set_config(config, model, tokenizer)   # decoder start: the export's (<s>)
            config.bos_token = config.decoder_start_token
            config.layer_norm_epsilon = spec["epsilon"]

    ct2_hf._MODEL_LOADERS["MarianConfig"] = RunLoader()
    for quantization in ("float32", "int8"):
        TransformersConverter(spec["hf"]).convert(str(Path(spec["out"]) / f"ct2-{quantization}"),
                                                  quantization=quantization, force=True)


def translate(spec: dict) -> None:
    """The input file through CT2, streamed (``bulk_translate.py``'s docstring, step 4)."""
    import ctranslate2
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=spec["spm"])
    translator = ctranslate2.Translator(spec["model"], device="cpu",
                                        inter_threads=spec.get("inter_threads", 1),
                                        intra_threads=spec["threads"])
    options = dict(max_batch_size=spec["batch_size"], beam_size=spec["beam"], length_penalty=spec["alpha"],
                   repetition_penalty=spec["repetition_penalty"], min_decoding_length=0,
                   max_decoding_length=spec["max_decoding_length"] - (spec["beam"] > 1),   # see the docstring
                   max_input_length=spec["max_len"],
                   suppress_sequences=[["<pad>"], ["<s>"]])
    start, lines = time.perf_counter(), 0
    with open(spec["input"], encoding="utf-8", newline="\n") as src, \
            open(spec["output"], "w", encoding="utf-8", newline="\n") as out:
        pieces = (sp.encode(line.removesuffix("\n"), out_type=str) for line in src)
        for result in translator.translate_iterable(pieces, **options):
            out.write(sp.decode(result.hypotheses[0]) + "\n")
            lines += 1
    seconds = time.perf_counter() - start
    print(f"ct2: {lines} lines in {seconds:.1f} s: {lines / seconds:,.1f} sentences/s")
