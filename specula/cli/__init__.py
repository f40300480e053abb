"""The ``specula`` command: ``generate`` (JSONL in, JSONL out, or one streamed prompt), ``bench``, ``drift`` (where
speculative output leaves ``model.generate``'s, and why), ``probe`` (which operation rounds differently in a pass over
several tokens) and ``proposers``.

The command line is parsed and checked, and its files read, before torch, transformers or the model are imported
(:mod:`.parser`, :mod:`.checks`), so a usage or file error comes back at once; the commands run after
(:mod:`.commands`).
"""

from __future__ import annotations

import sys

from ..hf.registry import available
from .checks import check, read_files
from .parser import build_parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    check(args)
    if args.command == "proposers":
        _list_proposers()
        return
    read_files(args)
    try:
        from .commands import run  # (torch, transformers: once the command line holds)

        run(args)
    except KeyboardInterrupt:  # (where a command has no clean stop of its own: loading, a second Ctrl-C)
        print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130) from None


def _list_proposers() -> None:
    """``specula proposers``: the built-in and registered proposers (a registered one is loaded to describe it)."""
    entries = available()
    width = max(len(entry.name) for entry in entries)
    for entry in entries:
        print(f"{entry.name:<{width}}  {entry.description}\n{'':<{width}}  from {entry.source}")
