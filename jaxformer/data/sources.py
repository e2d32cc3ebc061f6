"""The protocol every data source follows: :class:`jaxformer.data.corpus.PairFiles` (a TSV
file or two aligned files) and :class:`jaxformer.data.back_translation.BackTranslationMix`
give text pairs to ``prepare``; :class:`jaxformer.data.streaming.BatchStream` gives the
prepared shards' batches to the trainer. ``tests/test_data.py`` walks each through it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class DataSource(Protocol):
    """A resumable, fingerprinted stream of records.

    ``records()``: the records from the position on (advancing it). ``fingerprint()``: a
    JSON value that changes whenever the records would (the trainer compares it on
    resume). ``get_state()``: the position as a JSON dict of ints, saved with every
    checkpoint; after ``set_state(state)`` the records are those that followed it.
    """

    def records(self) -> Iterator[Any]: ...

    def fingerprint(self) -> Any: ...

    def get_state(self) -> dict[str, int]: ...

    def set_state(self, state: dict[str, int]) -> None: ...
