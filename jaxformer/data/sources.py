"""The one small protocol every data source follows (:class:`DataSource`): the text
pairs of :class:`jaxformer.data.corpus.PairFiles` (a TSV file or two aligned files) and
:class:`jaxformer.data.back_translation.BackTranslationMix`, which ``prepare`` reads, and
the batches of :class:`jaxformer.data.streaming.BatchStream` (the prepared shards), which
the trainer iterates and checkpoints. A new source is one class with the four methods;
``tests/test_data.py`` walks each through them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class DataSource(Protocol):
    """A resumable, fingerprinted stream of records.

    ``records()`` gives the records from the current position on and advances it;
    ``fingerprint()`` is a JSON value that changes whenever the records would (a run
    never continues on other data: the trainer records it and compares it on resume);
    ``get_state()`` is the position as a JSON dict of integers, saved with every
    checkpoint, and ``set_state(state)`` restores it, so the records that follow are
    those that followed when it was saved.
    """

    def records(self) -> Iterator[Any]: ...

    def fingerprint(self) -> Any: ...

    def get_state(self) -> dict[str, int]: ...

    def set_state(self, state: dict[str, int]) -> None: ...
