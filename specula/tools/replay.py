"""Offline replay: how a proposer would do on outputs already generated, without the model.

Greedy decoding is deterministic, so a proposer's gain can be replayed: generate each prompt's output once
(:func:`recorded_outputs`, cached in a JSON file), then walk through it as the loop does (:func:`walk`), asking the
proposer for drafts, sizing them with a draft-length policy and advancing by accepted + 1. :class:`Replay` is the
perfect proposer (the upper bound of any), also the bench's oracle row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..core.draft import Draft
from ..core.sampling import Sampling
from ..hf.generate import generate
from ..hf.loading import load_model
from ..jobs.requests import encode, load_workloads
from ..policy.protocol import DraftPolicy, Step
from ..proposers.base import Proposer
from ..proposers.prompt_lookup import PromptLookup


class Replay(Proposer):
    """Drafts the continuation of a known sequence (prompt + output): every draft token is right as long as the
    context follows it. Given several (a batch's rows), it follows the one the context is a prefix of; nothing
    when it follows none."""

    def __init__(self, references: Sequence[Sequence[int]], num_draft: int = 10) -> None:
        self.references = [np.asarray(r, dtype=np.int64).reshape(-1) for r in references]
        self.num_draft = num_draft

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> Draft:
        start = len(context_ids)
        for reference in self.references:
            if start < len(reference) and np.array_equal(reference[:start], context_ids):
                return Draft(reference[start : start + min(self.num_draft, max_tokens)])
        return Draft.empty()


def recorded_outputs(
    workloads: Path, limit: int, max_new_tokens: int, cache: Path | None = None, model: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt, greedy output) token ids of the first ``limit`` rows of every workload, by workload; outputs
    already in the JSON file ``cache`` are read from it, the others generated (``specula.generate`` with
    PromptLookup: ``model.generate``'s tokens) and added to it."""
    cached = json.loads(cache.read_text()) if cache and cache.exists() else {}
    loaded = None
    runs: dict[str, list[tuple[list[int], list[int]]]] = {}
    for workload, rows in load_workloads(workloads, limit).items():
        for row in rows:
            key = f"{workload}/{row.id}/{max_new_tokens}"
            if key not in cached:
                loaded = loaded or load_model(model, dtype=dtype)
                prompt = encode(loaded[1], row)
                out = generate(loaded[0], prompt, PromptLookup(), max_new_tokens=max_new_tokens)
                cached[key] = [prompt[0].tolist(), out.sequences[0, prompt.shape[1] :].tolist()]
                if cache:
                    cache.write_text(json.dumps(cached))
            runs.setdefault(workload, []).append(tuple(cached[key]))
    return runs


def walk(
    proposer: Proposer, prompt: list[int], output: list[int], policy: DraftPolicy, costs: np.ndarray
) -> tuple[int, int, float]:
    """(target passes, drafted tokens, estimated seconds) to produce ``output`` after ``prompt`` with
    ``proposer``, its drafts sized by ``policy``; ``costs[n - 1]`` is what a pass over n tokens costs (the last
    entry for longer ones). The prefill is the first pass, as in the loop."""
    states = [policy.start()]
    proposer.begin(np.asarray(prompt, dtype=np.int64), Sampling())
    proposer.observe(np.asarray(output[:1], dtype=np.int64), 0)
    context, passes, drafted, seconds = list(prompt) + output[:1], 1, 0, float(costs[0])
    while len(context) - len(prompt) < len(output):
        done = len(context) - len(prompt)
        budget = policy.budgets(states, [len(output) - done - 1])[0]
        proposed = Draft.empty()
        if budget:
            proposed = proposer.propose(np.asarray(context, dtype=np.int64), budget).cut(budget)
        sent = proposed.select(policy.trim(states, [proposed], [None])[0])  # (drafting time: not replayed)
        accepted = len(sent.path(output[done:]))
        new = output[done : done + accepted + 1]
        cost = float(costs[min(len(sent), len(costs) - 1)])
        policy.learn(Step(states, [proposed], [sent], [new], len(sent) + 1, cost))
        proposer.observe(np.asarray(new, dtype=np.int64), accepted)
        context += new
        passes, drafted, seconds = passes + 1, drafted + len(sent), seconds + cost
    return passes, drafted, seconds
