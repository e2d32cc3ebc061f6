"""The tokenizers of M2M100 and NLLB-200 (:class:`MultilingualTokenizer`), read offline without
transformers: M2M100's sentencepiece model + ``vocab.json`` with ``__en__`` language tokens
(transformers' ``tokenization_m2m_100.py``), NLLB's ``tokenizer.json`` through Hugging Face's
``tokenizers`` library with ``eng_Latn`` language tokens (``tokenization_nllb.py``). Both put
the source language first and ``</s>`` last; the target language is the decoder's forced
first token (``forced_bos_token_id``).
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# transformers' FAIRSEQ_LANGUAGE_CODES of M2M100 (its language tokens follow the vocabulary in
# this order, as "__en__"); NLLB's are the tokens of tokenizer.json named like "eng_Latn".
M2M100_LANGUAGES = {
    "m2m100": (
        "af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he "
        "hi hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl "
        "no ns oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi "
        "yo zh zu").split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}
NLLB_LANGUAGE = re.compile(r"[a-z]{3}_[A-Z][a-z]{3}")
TOKENIZER_FILES = {"m2m100": ("sentencepiece.bpe.model", "vocab.json", "tokenizer_config.json",
                              "special_tokens_map.json"),
                   "nllb": ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                            "sentencepiece.bpe.model")}
# sacrebleu tokenizes these targets its own way; other codes score with 13a.
_SCORING = {"zho": "zh", "yue": "zh", "jpn": "ja", "kor": "ko"}


def scoring_language(code: str) -> str:
    """The language code sacrebleu's BLEU wants for a model's code: ``"zh"`` for ``zho_Hans``,
    ``"de"`` for ``de``, ``"deu"`` for ``deu_Latn`` (any non-CJK code scores with 13a)."""
    base = code.split("_")[0]
    return _SCORING.get(base, base)


class MultilingualTokenizer:
    """M2M100's (``kind="m2m100"``) or NLLB-200's (``"nllb"``) tokenizer from the files in
    ``directory``, translating ``src_lang`` → ``tgt_lang`` (the model's codes: ``en``/``de``,
    ``eng_Latn``/``deu_Latn``). Sources are ``[src_lang] pieces </s>``, targets ``[tgt_lang]
    pieces`` (the decoder starts with ``</s>``, ``decoder_start_id``); :attr:`forced_first_id`
    is the target language; ``banned_ids`` (the generation config's ``bad_words_ids``) are never
    generated, by default none (``generate``'s).

    Raises ValueError: a damaged or missing file, a language not the model's (the nearest named).
    """

    def __init__(self, directory: str | Path, kind: str, *, src_lang: str | None = None,
                 tgt_lang: str | None = None, decoder_start_id: int | None = None,
                 banned_ids: Sequence[int] = ()):
        self.directory, self.kind, self.banned_ids = Path(directory), kind, tuple(banned_ids)
        config = self._read_json("tokenizer_config.json", required=False)
        try:
            if kind == "m2m100":
                self._load_m2m100(config)
            else:
                self._load_nllb()
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.directory} does not hold a readable {kind} tokenizer "
                             f"({type(e).__name__}: {e}); copy the tokenizer files again from the model "
                             f"they came with.") from e
        self.id_of = {**self.vocab, **self.language_ids}
        self.piece_of = {i: p for p, i in self.id_of.items()}
        self.pad_id, self.eos_id, self.unk_id = self.id_of["<pad>"], self.id_of["</s>"], self.id_of["<unk>"]
        self.bos_id = self.decoder_start_id = self.eos_id if decoder_start_id is None else decoder_start_id
        self._special = {self.id_of[t] for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
                         if t in self.id_of}
        self._special |= set(self.language_ids.values())
        self.src_lang = self.language(src_lang) if src_lang else None
        self.tgt_lang = self.language(tgt_lang) if tgt_lang else None

    def _read_json(self, name: str, required: bool = True) -> dict[str, Any]:
        path = self.directory / name
        if not path.is_file() and not required:
            return {}
        return json.loads(path.read_text(encoding="utf-8"))

    def _load_m2m100(self, config: dict[str, Any]) -> None:
        import sentencepiece as spm

        self.vocab = {p: int(i) for p, i in self._read_json("vocab.json").items()}
        self.sp = spm.SentencePieceProcessor(model_file=str(self.directory / "sentencepiece.bpe.model"))
        codes = M2M100_LANGUAGES[config.get("language_codes", "m2m100")]
        self.language_ids = {f"__{code}__": len(self.vocab) + i for i, code in enumerate(codes)}
        self.codes = {code: f"__{code}__" for code in codes}
        # Made-up words follow the language tokens (transformers' num_madeup_words).
        self.vocab_size = len(self.vocab) + len(codes) + int(config.get("num_madeup_words", 8))

    def _load_nllb(self) -> None:
        from tokenizers import Tokenizer

        self.tk = Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        self.vocab = self.tk.get_vocab(with_added_tokens=True)
        self.language_ids = {p: i for p, i in self.vocab.items() if NLLB_LANGUAGE.fullmatch(p)}
        self.vocab = {p: i for p, i in self.vocab.items() if p not in self.language_ids}
        self.codes = {p: p for p in self.language_ids}
        self.vocab_size = self.tk.get_vocab_size(with_added_tokens=True)

    src_vocab_size = tgt_vocab_size = property(lambda self: self.vocab_size)

    def language(self, code: str | None, side: str = "target") -> str:
        """``code`` if it is one of the model's languages; ``ValueError`` naming the nearest, or for
        ``None`` asking for the ``side``'s language."""
        if code in self.codes:
            return code
        example = "en, de" if self.kind == "m2m100" else "eng_Latn, deu_Latn"
        near = difflib.get_close_matches(code or "", list(self.codes), n=5, cutoff=0.4)
        flag = "--src-lang" if side == "source" else "--tgt-lang"
        raise ValueError(
            f"this {self.kind} model translates between many languages: name the {side} language "
            f"({flag}, codes such as {example})." if code is None else
            f"{code!r} is not a language of this {self.kind} model (codes such as {example}); "
            f"nearest: {', '.join(near) or 'none'}.")

    def with_languages(self, src_lang: str | None, tgt_lang: str | None) -> MultilingualTokenizer:
        """This tokenizer translating ``src_lang`` → ``tgt_lang`` (``None``: as now); raises as
        :meth:`language`."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.src_lang = self.language(src_lang) if src_lang else self.src_lang
        other.tgt_lang = self.language(tgt_lang) if tgt_lang else self.tgt_lang
        return other

    def _language_id(self, code: str | None, side: str) -> int:
        return self.language_ids[self.codes[self.language(code, side)]]

    @property
    def forced_first_id(self) -> int:
        """The target language's token, ``generate``'s ``forced_bos_token_id``."""
        return self._language_id(self.tgt_lang, "target")

    def _pieces(self, texts: Sequence[str]) -> list[list[int]]:
        if self.kind == "nllb":
            return [e.ids for e in self.tk.encode_batch(list(texts), add_special_tokens=False)]
        return [[self.vocab.get(p, self.unk_id) for p in self.sp.encode(t, out_type=str)] for t in texts]

    def encode_source(self, texts: Sequence[str]) -> list[list[int]]:
        """Encoder input ids: ``[src_lang] pieces </s>`` (transformers' tokenizer with ``src_lang``)."""
        first = self._language_id(self.src_lang, "source")
        return [[first, *ids, self.eos_id] for ids in self._pieces(texts)]

    def encode_target(self, texts: Sequence[str]) -> list[list[int]]:
        """Target ids without start or eos: ``[tgt_lang] pieces`` (``text_target=`` labels less ``</s>``)."""
        first = self._language_id(self.tgt_lang, "target")
        return [[first, *ids] for ids in self._pieces(texts)]

    def encode_phrases(self, texts: Sequence[str]) -> list[list[int]]:
        """A target phrase's pieces alone, without the language token (a constraint phrase: the
        language token is forced first, never part of a phrase met later)."""
        return self._pieces(texts)

    def decode(self, ids: Iterable[Sequence[int]]) -> list[str]:
        """Text of each id sequence up to the first eos, special and language tokens dropped
        (``batch_decode(..., skip_special_tokens=True)``)."""
        out = []
        for seq in ids:
            seq = [int(t) for t in seq]
            seq = [t for t in (seq[: seq.index(self.eos_id)] if self.eos_id in seq else seq)
                   if t not in self._special]
            if self.kind == "nllb":
                out.append(self.tk.decode(seq, skip_special_tokens=True))
            else:
                out.append(self.sp.decode([self.piece_of.get(t, "<unk>") for t in seq]).strip())
        return out

    def source_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.piece_of.get(int(i), "<unk>") for i in ids]

    target_pieces = source_pieces

    def save_hf(self, out_dir: str | Path) -> None:
        """Copies the tokenizer files (what transformers' tokenizer of this kind reads)."""
        for name in TOKENIZER_FILES[self.kind]:
            if (self.directory / name).is_file():
                shutil.copyfile(self.directory / name, Path(out_dir) / name)
