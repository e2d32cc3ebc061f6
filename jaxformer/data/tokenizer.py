"""Tokenizers behind one interface (:class:`TextTokenizer`): the joint sentencepiece model
a run trains (:class:`Tokenizer`, ``<workdir>/tokenizer/spm.model``) and OPUS-MT's
(:class:`MarianTokenizer`, from ``jaxformer-convert``); :func:`load_tokenizer` builds the
one a run's ``config.json`` names. Special ids come from the files, never from literals.
"""

from __future__ import annotations

import io
import json
import operator
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from jaxformer.model.validation import check_special_ids

# The tag of back-translated sources (Caswell et al. 2019, "Tagged Back-Translation"): a
# reserved piece of a run's tokenizer when the run has --bt-file data.
BT_TAG = "<BT>"


def _until(seq: Sequence[int], eos_id: int) -> list[int]:
    """The ids of ``seq`` as ints, up to (without) the first ``eos_id``."""
    seq = [int(t) for t in seq]
    return seq[: seq.index(eos_id)] if eos_id in seq else seq


def _load(path: Path, fix: str, required: Sequence[str] = ()):
    """A ``*.json`` vocabulary (piece → int id) holding the ``required`` pieces, or else a
    sentencepiece model whose ``required`` ids (e.g. ``"pad_id"``) are set. Raises
    FileNotFoundError: a missing vocabulary. ValueError: anything else unreadable (``fix``)."""
    import sentencepiece as spm

    is_vocab = path.suffix == ".json"
    unreadable = (RuntimeError, ValueError, LookupError, TypeError, AttributeError,
                  *(() if is_vocab else (OSError,)))
    try:
        if is_vocab:
            vocab = {p: operator.index(i) for p, i in json.loads(path.read_text(encoding="utf-8")).items()}
            _ = [vocab[piece] for piece in required]
            return vocab
        sp = spm.SentencePieceProcessor(model_file=str(path))
        _ = [sp.id_to_piece(getattr(sp, name)()) for name in required]   # IndexError when unset (-1)
        return sp
    except unreadable as e:
        what = "readable JSON (piece → id)" if is_vocab else "a readable sentencepiece model"
        raise ValueError(f"{str(path)!r} is unreadable: it is not {what}"
                         f"{' with ' + ', '.join(required) if required else ''} ({type(e).__name__}: {e}); "
                         f"{fix}") from e


class Tokenizer:
    """A joint sentencepiece vocabulary for source and target, special ids from the model. Raises
    ValueError: an unreadable model, no pad, bos or eos id, or a pad id shared."""

    # Generation rules (:mod:`jaxformer.decode.generation`): pad and bos banned, no forced first token.
    banned_ids: tuple[int, ...] | None = None
    forced_first_id: int | None = None

    def __init__(self, model_file: str | os.PathLike):
        self.model_file = Path(model_file)
        self.sp = _load(self.model_file, "it must be the sentencepiece model the run was trained with: "
                        "restore it, or start a new run (--fresh or another --workdir).",
                        ("pad_id", "bos_id", "eos_id"))
        self.pad_id, self.unk_id, self.eos_id = self.sp.pad_id(), self.sp.unk_id(), self.sp.eos_id()
        self.bos_id = self.decoder_start_id = self.sp.bos_id()
        check_special_ids(pad_id=self.pad_id, bos_id=self.bos_id, eos_id=self.eos_id, unk_id=self.unk_id,
                          source=str(self.model_file))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    src_vocab_size = tgt_vocab_size = vocab_size   # one joint vocabulary

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids (no bos/eos) for each text."""
        return self.sp.encode(list(texts))

    encode_source = encode_target = encode_phrases = encode

    def source_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.sp.id_to_piece(int(i)) for i in ids]

    target_pieces = source_pieces

    def save_marian(self, out_dir) -> None:
        """Writes this model as Marian tokenizer files (for a Hugging Face export)."""
        save_joint_as_marian(self.model_file, Path(out_dir))

    def decode(self, ids: Iterable[Sequence[int]]) -> list[str]:
        """Text of each id sequence, up to the first eos, without pad and bos."""
        return [self.sp.decode([t for t in _until(seq, self.eos_id) if t not in (self.pad_id, self.bos_id)])
                for seq in ids]

    @staticmethod
    def train(sentences: Iterable[str], model_dir: str | os.PathLike, vocab_size: int = 8000,
              seed_sentences: int = 200_000, reserved: Sequence[str] = ()) -> Tokenizer:
        """A unigram sentencepiece model trained on ``sentences``, written to ``model_dir/spm.model``.
        Ids: pad 0, unk 1, bos 2, eos 3, the ``reserved`` control pieces (e.g. :data:`BT_TAG`), then
        the learned pieces. Raises ValueError: a ``vocab_size`` below the corpus's characters plus
        the special pieces."""
        import sentencepiece as spm

        buffer = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_writer=buffer, vocab_size=vocab_size,
                model_type="unigram", character_coverage=0.9995, pad_id=0, unk_id=1, bos_id=2,
                eos_id=3, input_sentence_size=seed_sentences, shuffle_input_sentence=True,
                num_threads=os.cpu_count() or 1, minloglevel=2, hard_vocab_limit=False,
                control_symbols=list(reserved))
        except RuntimeError as e:   # e.g. "Vocabulary size is smaller than required_chars. 5 vs 81"
            reason = str(e).strip().split("] ")[-1].split(" Increase vocab_size")[0]
            raise ValueError(f"sentencepiece cannot train a vocabulary of {vocab_size} pieces on this "
                             f"corpus ({reason}); use a larger --vocab-size (at least the corpus's "
                             f"distinct characters plus {4 + len(reserved)} special pieces).") from e
        path, tmp = Path(model_dir) / "spm.model", Path(model_dir) / "spm.tmp"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(buffer.getvalue())
        return Tokenizer(tmp.replace(path))


class MarianTokenizer:
    """OPUS-MT's tokenizer, mirroring transformers' ``tokenization_marian.py`` (without its
    optional Moses normalisation): ``source.spm`` / ``target.spm`` segment, ``vocab.json`` (and
    ``target_vocab.json`` if separate) maps pieces to ids, ``<unk>`` if missing; a leading
    ``>>xx<<`` passes as one token; sources end in ``</s>``. ``bos_id`` (the decoder start) is
    the pad id unless ``decoder_start_id`` says otherwise. Raises FileNotFoundError: no
    ``vocab.json``. ValueError: a damaged file."""

    banned_ids: tuple[int, ...] | None = None   # pad (= the decoder start) banned, as OPUS-MT's bad_words_ids
    forced_first_id: int | None = None

    def __init__(self, directory: str | os.PathLike, *, separate_vocabs: bool = False,
                 decoder_start_id: int | None = None):
        self.directory = directory = Path(directory)
        self.separate_vocabs = separate_vocabs

        def read(name: str):
            required = ("<unk>", "</s>", "<pad>") if name == "vocab.json" else ()
            return _load(directory / name, "a damaged Marian tokenizer file; copy it again from the model "
                         "it came with.", required)

        self.source_vocab = read("vocab.json")
        self.target_vocab = read("target_vocab.json") if separate_vocabs else self.source_vocab
        self.pieces_of = {i: p for p, i in self.target_vocab.items()}
        self.source_pieces_of = {i: p for p, i in self.source_vocab.items()}
        self.source_spm, self.target_spm = read("source.spm"), read("target.spm")
        self.pad_id, self.eos_id = self.source_vocab["<pad>"], self.source_vocab["</s>"]
        self.unk_id = self.source_vocab["<unk>"]
        self.bos_id = self.decoder_start_id = self.pad_id if decoder_start_id is None else decoder_start_id
        self._special = {self.pad_id, self.eos_id, self.unk_id}

    @property
    def src_vocab_size(self) -> int:
        return max(self.source_vocab.values()) + 1

    @property
    def tgt_vocab_size(self) -> int:
        return max(self.target_vocab.values()) + 1

    vocab_size = src_vocab_size

    def _encode(self, text: str, processor, vocab: dict[str, int]) -> list[int]:
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[: end + 2]], text[end + 2:]
        return [vocab.get(p, self.unk_id) for p in code + processor.encode(text, out_type=str)]

    def encode_source(self, texts: Sequence[str]) -> list[list[int]]:
        """Encoder input ids, ``</s>`` appended (``MarianTokenizer(texts)["input_ids"]``)."""
        return [self._encode(t, self.source_spm, self.source_vocab) + [self.eos_id] for t in texts]

    def encode_target(self, texts: Sequence[str]) -> list[list[int]]:
        """Target ids without start or eos (``text_target=`` labels less their ``</s>``)."""
        return [self._encode(t, self.target_spm, self.target_vocab) for t in texts]

    encode_phrases = encode_target   # a constraint phrase: target ids alone

    def decode(self, ids: Iterable[Sequence[int]]) -> list[str]:
        """Text of each id sequence, up to the first eos, without special tokens
        (``batch_decode(..., skip_special_tokens=True)``)."""
        processor = self.target_spm if self.separate_vocabs else self.source_spm
        return [processor.decode_pieces([self.pieces_of.get(t, "<unk>") for t in _until(seq, self.eos_id)
                                         if t not in self._special]).replace("\u2581", " ").strip()
                for seq in ids]

    def source_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.source_pieces_of.get(int(i), "<unk>") for i in ids]

    def target_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.pieces_of.get(int(i), "<unk>") for i in ids]

    def save_marian(self, out_dir: Path) -> None:
        """Copies the tokenizer files (what ``transformers.MarianTokenizer`` reads)."""
        for name in ("source.spm", "target.spm", "vocab.json", "target_vocab.json", "tokenizer_config.json"):
            if (self.directory / name).is_file():
                shutil.copyfile(self.directory / name, Path(out_dir) / name)


def save_joint_as_marian(model_file: Path, out_dir: Path, *, target_language: str | None = None) -> None:
    """Writes a joint sentencepiece model as Marian tokenizer files: ``source.spm`` =
    ``target.spm`` = the model, ``vocab.json`` its pieces in id order."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    out_dir = Path(out_dir)
    for name in ("source.spm", "target.spm"):
        shutil.copyfile(model_file, out_dir / name)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1), encoding="utf-8")
    config: dict[str, Any] = {"tokenizer_class": "MarianTokenizer", "separate_vocabs": False,
                              **{f"{name}_token": sp.id_to_piece(getattr(sp, f"{name}_id")())
                                 for name in ("unk", "eos", "pad")}}
    if target_language:
        config["target_lang"] = target_language
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(workdir: str | os.PathLike, record: dict[str, Any]):
    """The tokenizer a run's ``config.json`` names: ``{"file": ...}`` (the trainer's) a
    :class:`Tokenizer`, ``{"kind": "marian", "dir": ...}`` (``jaxformer-convert``'s) a
    :class:`MarianTokenizer`, ``"m2m100"`` or ``"nllb"`` a
    :class:`~jaxformer.data.multilingual.MultilingualTokenizer`. Raises ValueError: an unknown
    kind or a damaged file.
    FileNotFoundError: a missing vocabulary."""
    workdir, info = Path(workdir), record.get("tokenizer", {})
    kind = info.get("kind", "sentencepiece")
    if kind == "sentencepiece":
        return Tokenizer(workdir / info.get("file", "tokenizer/spm.model"))
    if kind == "marian":
        return MarianTokenizer(workdir / info.get("dir", "tokenizer"),
                               separate_vocabs=bool(info.get("separate_vocabs", False)),
                               decoder_start_id=info.get("decoder_start_id"))
    if kind in ("m2m100", "nllb"):
        from jaxformer.data.multilingual import MultilingualTokenizer

        return MultilingualTokenizer(
            workdir / info.get("dir", "tokenizer"), kind, src_lang=info.get("src_lang"),
            tgt_lang=info.get("tgt_lang"), decoder_start_id=info.get("decoder_start_id"),
            banned_ids=record.get("generation", {}).get("banned_ids", ()))
    raise ValueError(f"{workdir / 'config.json'} names tokenizer kind {kind!r}; "
                     f"known: 'sentencepiece', 'marian', 'm2m100', 'nllb'.")


def with_languages(tokenizer, src_lang: str | None, tgt_lang: str | None):
    """A multilingual ``tokenizer`` set to translate ``src_lang`` → ``tgt_lang``. Raises ValueError: a
    code not the model's, or a tokenizer of one language pair (whose languages are fixed)."""
    if not hasattr(tokenizer, "with_languages"):
        raise ValueError(f"--src-lang/--tgt-lang ({src_lang}, {tgt_lang}) choose the languages of a "
                         f"multilingual model (M2M100, NLLB); this run's model translates one language "
                         f"pair: leave them out.")
    return tokenizer.with_languages(src_lang, tgt_lang)


# What translate and the trainer ask of a tokenizer: ``pad_id``, ``eos_id``, ``unk_id``, ``bos_id``
# (the decoder start id), ``src_vocab_size``, ``tgt_vocab_size``, ``encode_source`` (the encoder
# input as trained), ``encode_target`` (no start or eos), ``encode_phrases`` (a target phrase's pieces
# alone, for constraints), ``decode``, ``*_pieces``, ``save_marian``.
TextTokenizer = Tokenizer | MarianTokenizer
