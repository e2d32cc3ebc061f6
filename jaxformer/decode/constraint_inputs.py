"""The host side of constrained decoding (:mod:`jaxformer.decode.constrained`): target phrases
and prefixes as token ids, checked against each sentence's length limit and the beam (the
per-line notes), padded into a batch's arrays, and the translations checked for them after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxformer.decode.constrained import bank_rule


@dataclasses.dataclass
class Request:
    """One sentence's constraints as token ids: ``phrases`` (each ≥ 1 token) and ``prefix``
    (``[]`` for none), and its text ``texts`` (the phrases as the tokenizer gives them back;
    ``asked``: as given)."""

    phrases: list[list[int]]
    prefix: list[int]
    texts: list[str]
    asked: list[str] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> int:
        """T, the constraint tokens (the banks are 0 … T)."""
        return sum(len(p) for p in self.phrases)


def encode_requests(tokenizer, constraints: Sequence[Sequence[str]] | None,
                    prefixes: Sequence[str] | None, count: int) -> list[Request]:
    """Each of ``count`` sentences' :class:`Request`: phrases encoded as target pieces, alone (as
    fairseq's ``--constraints``: a phrase is matched as the tokenizer segments it out of
    context; a multilingual model's language token, forced first, is no part of one), empty
    ones and repeats dropped; a prefix as the decoder's first tokens (the language token
    first); ``None`` lists: no constraints, no prefix."""
    constraints = constraints if constraints is not None else [[]] * count
    prefixes = prefixes if prefixes is not None else [""] * count
    requests = []
    for phrases, prefix in zip(constraints, prefixes):
        phrases = list(dict.fromkeys(p.strip() for p in phrases if p.strip()))
        ids = [list(map(int, x)) for x in tokenizer.encode_phrases(phrases)] if phrases else []
        kept = [(text, i) for text, i in zip(phrases, ids) if i]
        prefix_ids = list(map(int, tokenizer.encode_target([prefix])[0])) if prefix.strip() else []
        requests.append(Request([i for _, i in kept], prefix_ids,
                                tokenizer.decode([i for _, i in kept]) if kept else [], [t for t, _ in kept]))
    return requests


def fit_requests(requests: list[Request], limits: Sequence[int], beam_size: int) -> list[list[str]]:
    """Makes each request fit its sentence's output limit, in place, and returns each one's notes:
    constraints and prefix that need more tokens than the limit (eos included) are dropped, the
    prefix cut to fit; a beam below :func:`bank_rule` is named (the lower banks get no slot); a
    phrase the tokenizer writes otherwise (its normalisation: ``…`` as ``...``, a character it
    lacks as ``⁇``) is named."""
    notes = []
    for request, limit in zip(requests, limits):
        mine = []
        changed = [f"{a!r} as {t!r}" for a, t in zip(request.asked, request.texts) if a != t]
        if changed:
            mine.append(f"this model's tokenizer writes {', '.join(changed)}; that form is what the "
                        f"translation holds")
        needed = request.tokens + len(request.prefix) + 1
        if needed > limit:
            mine.append(f"its constraints and prefix need {needed} tokens with eos, but its output limit is "
                        f"{limit} (--max-len-a, --max-len-b, the model's max_len): translated without its "
                        f"constraints" + (", its prefix cut" if len(request.prefix) >= limit else ""))
            request.phrases, request.texts = [], []
            request.prefix = request.prefix[: max(limit - 1, 0)]
        if bank_rule(request.tokens) > beam_size:
            banks = bank_rule(request.tokens)
            mine.append(f"its {request.tokens} constraint tokens need --beam-size {banks} or more (a bank "
                        f"per count of tokens met; --beam-size {beam_size} leaves fewer banks): a phrase may "
                        f"be missed")
        notes.append(mine)
    return notes


def _bucket(n: int) -> int:
    """The next power of two ≥ ``n`` (≥ 1): one compile per bucket."""
    return 1 << max(n - 1, 0).bit_length()


def batch_arrays(requests: Sequence[Request | None], rows: int) -> dict[str, np.ndarray]:
    """``{"tokens": int32 [rows, C, P], "prefix": int32 [rows, Q]}``, -1 padded, row r from
    ``requests[r]`` (``None`` and the rows past them: none). C, P and Q are powers of two, at
    least 2, 8 and 8 where the batch has any (1 where none), so that few programs compile."""
    real = [r for r in requests if r is not None]
    any_phrase, any_prefix = any(r.phrases for r in real), any(r.prefix for r in real)
    phrases = _bucket(max([len(r.phrases) for r in real] + [2])) if any_phrase else 1
    width = _bucket(max([len(p) for r in real for p in r.phrases] + [8])) if any_phrase else 1
    prefix_width = _bucket(max([len(r.prefix) for r in real] + [8])) if any_prefix else 1
    tokens = np.full((rows, phrases, width), -1, np.int32)
    prefix = np.full((rows, prefix_width), -1, np.int32)
    for row, request in enumerate(requests):
        if request is None:
            continue
        for c, phrase in enumerate(request.phrases):
            tokens[row, c, :len(phrase)] = phrase
        prefix[row, :len(request.prefix)] = request.prefix
    return {"tokens": tokens, "prefix": prefix}


def missing_notes(requests: Sequence[Request], translations: Sequence[str]) -> list[list[str]]:
    """Each request's note that its translation misses one of its phrases (the search ran out of
    room, or the beam was too small for its banks), if it does."""
    notes = []
    for request, text in zip(requests, translations):
        missing = [phrase for phrase in request.texts if phrase not in text]
        notes.append([f"the translation misses {', '.join(map(repr, missing))} (no hypothesis holding it "
                      f"ended within the output limit)"] if missing else [])
    return notes
