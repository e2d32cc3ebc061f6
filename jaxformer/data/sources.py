"""The one small protocol every data source follows, so the trainer and ``prepare`` see
nothing else: :class:`DataSource`.

Implemented by :class:`jaxformer.data.corpus.PairFiles` (a TSV file or two aligned files:
text pairs), :class:`jaxformer.data.back_translation.BackTranslationMix` (the synthetic
pairs chosen at ``--bt-ratio``: text pairs) and :class:`jaxformer.data.streaming.BatchStream`
(the prepared shards: training batches, what the trainer iterates and checkpoints).

A new source is one class with these four methods, e.g. a source of pairs held in memory::

    @dataclasses.dataclass
    class InMemoryPairs:
        pairs: list[tuple[str, str]]
        position: int = 0

        def records(self):
            while self.position < len(self.pairs):
                self.position += 1
                yield self.pairs[self.position - 1]

        def fingerprint(self):
            return {"sha256": hashlib.sha256(repr(self.pairs).encode()).hexdigest()}

        def get_state(self):
            return {"pairs": self.position}

        def set_state(self, state):
            self.position = state["pairs"]
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
