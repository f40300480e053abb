"""Proposers keyed by request: the loop starts, asks, tells and stops each request by id; a proposer written for one
sequence serves a batch through the PerRequest adapter, each request with its own copy."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import Oracle, hf_greedy
from tiny_models import VOCAB, tiny_model

import specula
from specula.proposers.base import PerRequest, RequestFailed, for_requests

NEW_TOKENS = 16


@functools.cache
def model() -> torch.nn.Module:
    return tiny_model("llama")


def prompts() -> list[np.ndarray]:
    generator = np.random.default_rng(4)
    words = generator.integers(3, VOCAB, 6)
    return [
        np.concatenate([words, words, words[:3]]),
        generator.integers(3, VOCAB, 9),
        np.concatenate([words] * 3),
        generator.integers(3, VOCAB, 14),
        np.concatenate([words[::-1], words[::-1]]),
    ]


def expected() -> list[list[int]]:
    return [
        hf_greedy(model(), torch.from_numpy(p)[None], NEW_TOKENS, eos_token_id=[])[0, len(p) :].tolist()
        for p in prompts()
    ]


def decode(proposer: specula.Proposer, slots: int = 2) -> list[list[int]]:
    """Each prompt's new tokens, decoded ``slots`` at a time (more prompts than slots: continuous batching)."""
    jobs = [specula.Job(p, NEW_TOKENS, key=k) for k, p in enumerate(prompts())]
    decoder = specula.Decoder(model(), proposer, slots=slots)
    rows = {row.job.key: row for row, _ in decoder.run(jobs)}
    return [rows[k].sequence.ids[len(p) :].tolist() for k, p in enumerate(prompts())]


class Tracking(Oracle):
    """A one-sequence proposer that keeps its own copy of its sequence (``begin``, ``observe``) and checks it against
    every context it is asked about: one object serving two requests at once fails the check."""

    objects: set[int] = set()

    def begin(self, prompt_ids, sampling):
        self.seen = prompt_ids.tolist()
        Tracking.objects.add(id(self))

    def propose(self, context_ids, max_tokens):
        assert context_ids.tolist() == self.seen, "a proposer object was told another request's tokens"
        return super().propose(context_ids, max_tokens)

    def observe(self, new_ids, num_accepted):
        self.seen += list(new_ids)


def test_a_one_sequence_proposer_serves_a_batch_through_its_own_copies() -> None:
    outputs = expected()
    references = [torch.from_numpy(np.concatenate([p, out])) for p, out in zip(prompts(), outputs)]
    Tracking.objects.clear()
    proposer = Tracking(references, 4)
    assert decode(proposer) == outputs
    # two slots for five requests: the proposer itself and one fork, each reused once its request ended
    assert len(Tracking.objects) == 2 and id(proposer) in Tracking.objects


def test_the_adapter_is_used_only_for_one_sequence_proposers() -> None:
    lookup = specula.PromptLookup()
    assert for_requests(lookup) is lookup
    one_sequence = Tracking([torch.arange(4)], 2)
    adapted = for_requests(one_sequence)
    assert isinstance(adapted, PerRequest) and repr(adapted) == repr(one_sequence)  # (errors name the user's)


def test_a_built_in_proposer_subclassed_for_its_one_sequence_hooks_gets_them_called() -> None:
    class Steps(specula.PromptLookup):
        def observe(self, new_ids, num_accepted):
            self.steps = getattr(self, "steps", 0) + 1

    class Drafts(specula.SmallModelDrafter):
        def propose(self, context_ids, max_tokens):
            return super().propose(context_ids, max_tokens)

    for native in (specula.PromptLookup(), specula.NGramPredictor(), specula.SmallModelDrafter(model())):
        assert for_requests(native) is native
    assert isinstance(for_requests(Steps()), PerRequest) and isinstance(for_requests(Drafts(model())), PerRequest)
    steps = Steps()
    specula.generate(model(), torch.from_numpy(prompts()[0])[None], steps, max_new_tokens=4, eos_token_id=[])
    assert steps.steps == 4


def test_a_failing_request_is_named_by_the_adapter() -> None:
    class Fails(specula.Proposer):
        def propose(self, context_ids, max_tokens):
            if len(context_ids) == 3:
                raise KeyError("no table")
            return specula.Draft([])

    adapted = for_requests(Fails())
    for request, prompt in (("a", [1, 2]), ("b", [1, 2, 3])):
        adapted.start_request(request, np.array(prompt), specula.Sampling())
    with pytest.raises(RequestFailed) as failure:
        adapted.propose_requests(["a", "b"], [np.array([1, 2]), np.array([1, 2, 3])], [2, 2])
    assert failure.value.request == "b" and isinstance(failure.value.error, KeyError)
    with pytest.raises(KeyError):  # one request: its own error
        adapted.propose_requests(["b"], [np.array([1, 2, 3])], [2])


@pytest.mark.parametrize(
    "make",
    [lambda: specula.NGramPredictor(), lambda: specula.SmallModelDrafter(tiny_model("llama", 1), num_draft=3)],
    ids=["ngram", "small-model"],
)
def test_request_proposers_keep_each_request_apart_and_forget_it_when_it_ends(make) -> None:
    proposer = make()
    assert decode(proposer) == expected()
    kept = proposer._recent if isinstance(proposer, specula.NGramPredictor) else proposer.requests
    assert kept == {}
    run = specula.Decoder(model(), proposer, slots=2).run(specula.Job(p, NEW_TOKENS) for p in prompts())
    next(run), next(run), next(run)
    assert len(kept) == 2
    run.close()  # a run given up leaves no request behind
    assert kept == {}


def test_a_small_model_batch_reuses_the_rows_of_finished_requests() -> None:
    drafter = specula.SmallModelDrafter(tiny_model("llama", 1), num_draft=3)
    assert decode(drafter, slots=3) == expected()
    cache = drafter.batch.cache
    assert cache is not None and sorted(drafter.batch.free) == list(range(cache.slots))
    assert decode(drafter, slots=3) == expected() and drafter.batch.cache is cache  # (made once)
