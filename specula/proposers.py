"""Naming proposers on the command line: ``prompt-lookup``, ``prompt-lookup-tree[:N]``, ``ngram``, ``none`` or
``draft:PATH``."""

from __future__ import annotations

from typing import Callable

import torch

from .models import load_model
from .ngram import NGramPredictor
from .prompt_lookup import PromptLookup
from .proposer import Proposer
from .small_model import SmallModelDrafter

PROPOSER_NAMES = ("prompt-lookup", "prompt-lookup-tree[:N]", "ngram", "none", "draft:PATH")
TREE_BRANCHES = 8  # occurrences a prompt-lookup tree proposes by default


def proposer_factory(
    spec: str, target_tokenizer=None, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> Callable[[], Proposer | None]:
    """A function that makes a fresh proposer for each request, from its name (see ``PROPOSER_NAMES``).

    ``prompt-lookup-tree:N`` proposes the continuations of ``N`` occurrences as a tree (default 8).
    ``draft:PATH`` loads the draft model (an HF folder or ``.gguf`` file) once, here, with ``dtype`` on ``device``.
    """
    if spec == "prompt-lookup":
        return PromptLookup
    if spec.partition(":")[0] == "prompt-lookup-tree":
        branches = spec.partition(":")[2] or str(TREE_BRANCHES)
        if not branches.isdigit() or int(branches) < 2:
            raise ValueError(f"prompt-lookup-tree:N takes a number of branches >= 2, got {branches!r}.")
        return lambda: PromptLookup(branches=int(branches))
    if spec == "ngram":
        return NGramPredictor
    if spec == "none":
        return lambda: None
    if spec.startswith("draft:") and len(spec) > len("draft:"):
        draft_model, draft_tokenizer = load_model(spec[len("draft:") :], dtype=dtype, device=device)
        return lambda: SmallModelDrafter(draft_model, tokenizer=draft_tokenizer, target_tokenizer=target_tokenizer)
    raise ValueError(f"Unknown proposer {spec!r}; use one of {', '.join(PROPOSER_NAMES)}.")
