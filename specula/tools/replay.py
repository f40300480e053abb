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
from ..decoding.loop import Job, Row, advance, propose
from ..hf.generate import generate
from ..hf.loading import load_model
from ..jobs.requests import encode, load_workloads
from ..policy.protocol import DraftPolicy, Pass
from ..proposers.base import Proposer, for_requests
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
    workloads: Path,
    limit: int,
    max_new_tokens: int,
    cache: Path | None = None,
    model: str | None = None,
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
    entry for longer ones). The loop's own steps (:func:`~specula.decoding.loop.propose`,
    :func:`~specula.decoding.loop.advance`) with the pass replayed: what the target keeps is the longest path of the
    draft along ``output``, then its next token. The prefill is the first pass, as in the loop."""
    requests = for_requests(proposer)
    row = Row(Job(np.asarray(prompt, dtype=np.int64), len(output)), policy.start())
    requests.start_request(row.request_id, row.sequence.ids, row.sampling)
    advance(row, requests, output[:1], Draft.empty())
    vocab = max(prompt + output) + 1
    passes, drafted, seconds = 1, 0, float(costs[0])
    while not row.finished:
        done = len(row.output)
        proposed, sent = propose(policy, requests, [row], vocab, batched=False, takes_trees=True)
        new = output[done : done + len(sent[0].path(output[done:])) + 1]
        cost = float(costs[min(len(sent[0]), len(costs) - 1)])
        policy.learn(Pass([row.policy_state], proposed, sent, [new], len(sent[0]) + 1, cost))
        advance(row, requests, new, sent[0])
        passes, drafted, seconds = passes + 1, drafted + len(sent[0]), seconds + cost
    requests.stop_request(row.request_id)
    return passes, drafted, seconds
