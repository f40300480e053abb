"""The one way to drive the loop over jobs: every caller (``specula.generate`` and ``custom_generate``, request
files and Ray workers, ``specula bench``) runs a :class:`~specula.decoding.loop.Decoder` through these."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from .loop import Decoder, Job, Row


def finished_rows(
    decoder: Decoder, jobs: Iterable[Job], on_tokens: Callable[[Row, list[int]], None] | None = None
) -> Iterator[Row]:
    """Each request of ``jobs`` as its row finishes (not in their order); ``on_tokens(row, kept)`` is told the
    tokens every pass kept for a row (a streamer, a progress bar) as they come."""
    for row, kept in decoder.run(jobs):
        if on_tokens is not None:
            on_tokens(row, kept)
        if row.finished:
            yield row


def decode_all(
    decoder: Decoder, jobs: Iterable[Job], on_tokens: Callable[[Row, list[int]], None] | None = None
) -> dict[object, Row]:
    """Every request of ``jobs`` decoded: its finished row by its key (:func:`finished_rows`)."""
    return {row.job.key: row for row in finished_rows(decoder, jobs, on_tokens)}
