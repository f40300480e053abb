"""Naming proposers on the command line: the built-in ``prompt-lookup``, ``prompt-lookup-tree[:N]``, ``ngram``,
``ngram-tree``, ``none`` and ``draft:PATH``, and those other packages register.

A package registers a proposer under the entry-point group ``specula.proposers``; in its ``pyproject.toml``::

    [project.entry-points."specula.proposers"]
    echo = "specula_echo:Echo"

``--proposer echo`` then calls ``Echo()`` for each request, ``--proposer echo:ARG`` calls ``Echo("ARG")``; either must
return a :class:`specula.Proposer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # (naming and checking proposers import neither torch nor transformers: the CLI checks at once)
    import torch

    from ..proposers.base import Proposer

ENTRY_POINT_GROUP = "specula.proposers"
BUILT_IN = {
    "prompt-lookup": "copies what followed the most recent earlier occurrence of the last tokens",
    "prompt-lookup-tree[:N]": "the continuations of the N best earlier occurrences as one tree (default 16)",
    "ngram": "chains the most confident continuations of n-gram tables learnt from everything seen",
    "ngram-tree": "that chain, and the best continuations of shorter contexts as other branches of a tree",
    "none": "no drafts: plain decoding through specula's loop",
    "draft:PATH": "a smaller model with the same vocabulary (an HF folder or .gguf file)",
}
_BUILT_IN_NAMES = {name.partition(":")[0].partition("[")[0] for name in BUILT_IN}
PROPOSER_NAMES = tuple(BUILT_IN) + ("a registered NAME[:ARG]",)
TREE_BRANCHES = 16  # occurrences a prompt-lookup tree proposes by default


@dataclass(frozen=True)
class ProposerEntry:
    """A proposer the command line can name: where it comes from and what it does (or why it cannot be loaded)."""

    name: str
    source: str
    description: str


def registered() -> dict[str, EntryPoint]:
    """Proposers other packages register, by name (the first of a name wins; built-in names cannot be taken)."""
    found: dict[str, EntryPoint] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name, entry)
    return found


def _package(entry: EntryPoint) -> str:
    return f"package {entry.dist.name} {entry.dist.version}" if entry.dist else f"entry point {entry.value}"


def _load_plugin(entry: EntryPoint) -> Callable[..., Proposer]:
    try:
        return entry.load()
    except Exception as error:  # whatever a broken package raises, it must not look like specula's own failure
        raise ValueError(
            f"proposer {entry.name!r} from {_package(entry)} ({entry.value}) cannot be loaded: "
            f"{type(error).__name__}: {error}. Fix or reinstall that package, or use a built-in proposer "
            f"({', '.join(BUILT_IN)})."
        ) from error


def available() -> list[ProposerEntry]:
    """Every proposer ``--proposer`` accepts: the built-in ones, then each registered one (broken ones say why)."""
    entries = [ProposerEntry(name, "specula (built-in)", text) for name, text in BUILT_IN.items()]
    for name, entry in sorted(registered().items()):
        source = f"{_package(entry)} ({entry.value})"
        if name in _BUILT_IN_NAMES:
            entries.append(ProposerEntry(name, source, "ignored: a built-in proposer has this name"))
            continue
        try:
            doc = (_load_plugin(entry).__doc__ or "").strip()
            entries.append(ProposerEntry(name, source, doc.splitlines()[0] if doc else ""))
        except ValueError as error:
            entries.append(ProposerEntry(name, source, f"BROKEN: {error.__cause__!r}"))
    return entries


def _plugin_factory(name: str, argument: str | None) -> Callable[[], Proposer]:
    entry = registered().get(name)
    if entry is None:
        plugins = sorted(registered())
        raise ValueError(
            f"Unknown proposer {name!r}; built-in: {', '.join(BUILT_IN)}"
            + (f"; registered: {', '.join(plugins)}" if plugins else "; none registered by other packages")
            + " (`specula proposers` lists them)."
        )
    make = _load_plugin(entry)

    def fresh() -> Proposer:
        from ..proposers.base import Proposer

        try:
            proposer = make() if argument is None else make(argument)
        except Exception as error:
            raise ValueError(
                f"proposer {name!r} from {_package(entry)} failed to start"
                + (f" with argument {argument!r}" if argument is not None else "")
                + f": {type(error).__name__}: {error}"
            ) from error
        if not isinstance(proposer, Proposer):
            raise ValueError(
                f"proposer {name!r} from {_package(entry)}: {entry.value} returned a {type(proposer).__name__}, "
                "not a specula.Proposer."
            )
        return proposer

    fresh()  # a plugin that cannot make a proposer fails here, before any model work
    return fresh


def _parse(spec: str) -> tuple[str, str | None]:
    """(name, argument) of a proposer spec; a malformed built-in one raises ``ValueError``."""
    name, colon, argument = spec.partition(":")
    if spec in ("prompt-lookup", "ngram", "ngram-tree", "none"):
        return spec, None
    if name == "prompt-lookup-tree":
        branches = argument or str(TREE_BRANCHES)
        if not branches.isdigit() or int(branches) < 2:
            raise ValueError(f"prompt-lookup-tree:N takes a number of branches >= 2, got {branches!r}.")
        return name, branches
    if name == "draft" and argument:
        return name, argument
    if name in _BUILT_IN_NAMES:
        raise ValueError(f"Proposer {spec!r} is malformed; the built-in ones are: {', '.join(BUILT_IN)}.")
    return name, argument if colon else None


def proposer_factory(
    spec: str, target_tokenizer=None, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu"
) -> Callable[[], Proposer | None]:
    """A function that makes a fresh proposer for each request, from its name (see ``PROPOSER_NAMES``).

    ``prompt-lookup-tree:N`` proposes the continuations of ``N`` occurrences as a tree (default 16).
    ``draft:PATH`` loads the draft model (an HF folder or ``.gguf`` file) once, here, with ``dtype`` on ``device``.
    Any other ``NAME[:ARG]`` is looked up among the proposers other packages register (``specula.proposers``).
    """
    name, argument = _parse(spec)
    if name not in _BUILT_IN_NAMES:
        return _plugin_factory(name, argument)
    from ..proposers.ngram import NGramPredictor
    from ..proposers.prompt_lookup import PromptLookup
    from ..proposers.small_model import SmallModelDrafter
    from .loading import load_model

    if name == "draft":
        draft_model, draft_tokenizer = load_model(argument, dtype=dtype, device=device)
        return lambda: SmallModelDrafter(draft_model, tokenizer=draft_tokenizer, target_tokenizer=target_tokenizer)
    if name == "prompt-lookup-tree":
        return lambda: PromptLookup(branches=int(argument))
    if name == "ngram-tree":
        return lambda: NGramPredictor(tree=True)
    return {"prompt-lookup": PromptLookup, "ngram": NGramPredictor, "none": lambda: None}[name]


def check_proposer(spec: str) -> None:
    """Raise ``ValueError`` if ``spec`` names no proposer, before any model is loaded (a draft model's path is
    checked when it loads; a registered proposer is made once, to see that it can be)."""
    name, argument = _parse(spec)
    if name not in _BUILT_IN_NAMES:
        _plugin_factory(name, argument)
