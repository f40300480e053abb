"""The proposer interfaces: what a drafting method implements to plug into the speculation loop.

The loop speaks to a :class:`RequestProposer`, which keeps every request's state itself, keyed by an id the loop
gives the request (as ArcticInference's suffix cache does):

1. ``check_target(model)`` with the target model (e.g. to check that a draft model shares its vocabulary);
2. ``start_request(request, prompt_ids, sampling)`` when a request starts; ``sampling`` (a
   :class:`specula.Sampling`) says how the target decodes it: a drafter that samples must draw with
   ``sampling.probs`` and ``sampling.generator`` and return the distributions it drew from as ``Draft.probs``;
3. ``propose_requests(requests, contexts, max_tokens)`` before every target forward pass, for the requests of the
   batch that may draft (``max_tokens[i] >= 1`` bounds a chain's length, a tree's depth);
4. ``observe_request(request, new_ids, num_accepted)`` after every verification, with the tokens appended to the
   request's sequence (the accepted draft prefix followed by the target's own token) and how many came from the
   draft;
5. ``stop_request(request)`` when the request is done.

A contexts entry is a read-only numpy int64 view of the request's prompt + output so far, valid only during the call
(copy it to keep it).

A proposer written for one sequence subclasses :class:`Proposer` (``begin``, ``propose``, ``observe``); the loop
runs it through :class:`PerRequest`, which gives each concurrent request its own :meth:`Proposer.fork`. Example, a
proposer that always guesses the token that came before the last one::

    class Echo(specula.Proposer):
        def propose(self, context_ids, max_tokens):
            return specula.Draft(context_ids[-2:-1])
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from ..core.draft import Draft, check_int, merged
from ..core.sampling import Sampling

__all__ = [
    "Draft",
    "PerRequest",
    "Proposer",
    "RequestFailed",
    "RequestProposer",
    "check_int",
    "for_requests",
    "merged",
]  # what a proposer is written with


class Proposer:
    """A drafting method for one sequence at a time: subclasses implement ``propose`` and, if they keep state,
    ``begin`` and ``observe`` (and ``fork``, if part of that state should serve every request)."""

    # Whether drafts may be trees (``Draft.parents``): the verifier then holds the target so that it can verify
    # them, and cuts them to their first branch where the model cannot (see ``specula.generate``).
    proposes_trees: bool = False
    # Whether, when the target samples, drafts are drawn at random (with ``Draft.probs``). Such drafts are verified
    # by speculative sampling, whose random draws depend on how many are sent; the cost model then leaves timings
    # out, so that a seeded request samples the same on every run. Other drafts are verified by drawing each token
    # as ``model.generate`` does, whatever their lengths.
    samples_drafts: bool = False

    def check_target(self, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` if this proposer cannot draft for ``model``; called before every generation."""

    def begin(self, prompt_ids: np.ndarray, sampling: Sampling) -> None:
        """A new sequence starts with these prompt tokens and is decoded with ``sampling``."""

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> Draft:
        """Guess up to ``max_tokens`` (>= 1) tokens that follow ``context_ids``; an empty draft means "no guess"."""
        raise NotImplementedError

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        """``new_ids`` were appended to the sequence; the first ``num_accepted`` of them were this proposer's draft."""

    def fork(self) -> "Proposer":
        """A proposer for another request decoded at the same time: the state of a request is its own, state that
        should serve every request (learnt tables, a loaded model) is shared. The default, a deep copy, shares
        nothing; proposers with shared state override it."""
        return copy.deepcopy(self)


class RequestProposer(Proposer):
    """A drafting method that keeps the state of every request itself, keyed by the loop's request ids (see the
    module docstring); it drafts for a batch of requests in one call. Used alone (``begin``, ``propose``,
    ``observe``), it serves one sequence as the request ``None``. Subclasses implement ``propose``,
    ``propose_requests`` or both."""

    def start_request(self, request: Hashable, prompt_ids: np.ndarray, sampling: Sampling) -> None:
        """Request ``request`` starts with these prompt tokens and is decoded with ``sampling``."""

    def propose_requests(
        self, requests: Sequence[Hashable], contexts: Sequence[np.ndarray], max_tokens: Sequence[int]
    ) -> list[Draft]:
        """One draft per request: at most ``max_tokens[i]`` (>= 1) tokens that follow ``contexts[i]``, the sequence
        of ``requests[i]``. A failure that concerns one request only raises :class:`RequestFailed`. The default asks
        ``propose`` about each context (for drafts that depend on the context and shared state only); a proposer
        that drafts requests together (one batched pass of a draft model) overrides it."""
        return [self.propose(context, most) for context, most in zip(contexts, max_tokens)]

    def observe_request(self, request: Hashable, new_ids: Sequence[int], num_accepted: int) -> None:
        """``new_ids`` were appended to ``request``'s sequence; the first ``num_accepted`` of them were its draft."""

    def stop_request(self, request: Hashable) -> None:
        """``request`` is done (or abandoned): forget what was kept for it. Unknown requests are ignored."""

    def begin(self, prompt_ids: np.ndarray, sampling: Sampling) -> None:
        self.stop_request(None)
        self.start_request(None, prompt_ids, sampling)

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        self.observe_request(None, new_ids, num_accepted)


class RequestFailed(RuntimeError):
    """Proposing failed for one request of a batch (``request``: its id; ``error``: what went wrong)."""

    def __init__(self, request: Hashable, error: Exception) -> None:
        super().__init__(str(error))
        self.request, self.error = request, error


class PerRequest(RequestProposer):
    """A one-sequence :class:`Proposer` serving many requests: the proposer itself serves the first, and each
    further request decoded at the same time gets a :meth:`Proposer.fork`, kept for later requests once free.

    Example::

        >>> class Last(Proposer):
        ...     def begin(self, prompt_ids, sampling):
        ...         self.seen = len(prompt_ids)
        ...     def propose(self, context_ids, max_tokens):
        ...         return Draft(context_ids[-1:])
        >>> proposer = for_requests(Last())
        >>> proposer.start_request("a", np.array([1, 2]), Sampling())
        >>> proposer.start_request("b", np.array([3, 4, 5]), Sampling())
        >>> [draft.tokens.tolist() for draft in proposer.propose_requests(["a", "b"], [np.array([1, 2]),
        ...                                                                             np.array([3, 4, 5])], [2, 2])]
        [[2], [5]]
        >>> proposer.stop_request("a"); proposer.stop_request("b")
    """

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.proposes_trees = proposer.proposes_trees
        self.samples_drafts = proposer.samples_drafts
        self._free = [proposer]  # proposer objects serving no request
        self._serving: dict[Hashable, Proposer] = {}

    def check_target(self, model: torch.nn.Module) -> None:
        self.proposer.check_target(model)

    def start_request(self, request: Hashable, prompt_ids: np.ndarray, sampling: Sampling) -> None:
        self._serving[request] = self._free.pop() if self._free else self.proposer.fork()
        self._serving[request].begin(prompt_ids, sampling)

    def propose_requests(self, requests, contexts, max_tokens) -> list[Draft]:
        drafts = []
        for request, context, most in zip(requests, contexts, max_tokens):
            try:
                drafts.append(self._serving[request].propose(context, most))
            except Exception as error:
                if len(requests) == 1:
                    raise
                raise RequestFailed(request, error) from error
        return drafts

    def observe_request(self, request: Hashable, new_ids: Sequence[int], num_accepted: int) -> None:
        self._serving[request].observe(new_ids, num_accepted)

    def stop_request(self, request: Hashable) -> None:
        if request in self._serving:
            self._free.append(self._serving.pop(request))

    def __repr__(self) -> str:
        return repr(self.proposer)


def for_requests(proposer: Proposer) -> RequestProposer:
    """``proposer`` as the loop speaks to it: itself if it keys requests, else through :class:`PerRequest` (so too a
    subclass of a request proposer that overrides a one-sequence hook, e.g. a ``PromptLookup`` whose ``observe``
    records the steps: its hooks are then called as they always were)."""
    if isinstance(proposer, RequestProposer) and not _overrides_one_sequence_hooks(type(proposer)):
        return proposer
    return PerRequest(proposer)


_HOOKS = {"begin": "start_request", "propose": "propose_requests", "observe": "observe_request"}


def _overrides_one_sequence_hooks(cls: type) -> bool:
    """Whether ``cls`` defines a one-sequence hook below the class that defines the request hook standing for it
    (``RequestProposer``'s own ``propose_requests`` asks ``propose``, so it stands for any ``propose``)."""

    def owner(name: str) -> type:
        return next(klass for klass in cls.__mro__ if name in vars(klass))

    return any(
        owner(one) is not owner(keyed)
        and issubclass(owner(one), owner(keyed))
        and not (one == "propose" and owner(keyed) is RequestProposer)
        for one, keyed in _HOOKS.items()
    )
