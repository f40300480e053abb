"""Deciding which draft tokens the target keeps: the one acceptance rule every proposer goes through.

Greedy decoding keeps a draft token while it is the target's argmax after the tokens before it.

Sampling with drafts that were not drawn at random (PromptLookup, NGramPredictor, trees of their candidates, a
greedy drafter) draws the target's token at each verified position exactly as ``model.generate`` draws it (its
processed scores after that position's own prefix, softmax, one ``torch.multinomial`` on the same generator),
position after position, and keeps the draft while the drawn token is a draft token there (at a tree node: one of
its children); the first drawn token that is not ends the step. That accepts a draft token ``d`` with probability
``p(d)`` and otherwise gives ``p`` without ``d``, renormalised: what the rejection rule below gives for a one-hot
``q`` (for several candidates at a node, the sum of their probabilities: SpecInfer's rule), so every token is
distributed as ``p``. It also draws one random number per new token, as ``model.generate`` does: a seeded request
gives ``model.generate``'s very tokens, whatever the drafts and their lengths.

Drafts drawn at random with probabilities ``q`` (``Draft.probs``: a sampling drafter) go through speculative
sampling (Leviathan et al. 2023, Chen et al. 2023): draft token ``d`` is accepted with probability
``min(1, p(d) / q(d))``; at the first rejection the target's token is drawn from the residual
``norm(max(0, p - q))``; after all drafts are accepted a bonus token is drawn from the target's next ``p``. Every
emitted token is then distributed exactly as ``p``, but the random numbers it draws depend on the drafts, so the
tokens are ``model.generate``'s in distribution only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .draft import Draft
from .sampling import Sampling


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """``min(1, p(d) / q(d))`` per draft token; a token the drafter gave probability 0 is accepted iff ``p(d) > 0``.

    >>> acceptance_probability(torch.tensor([0.2, 0.6, 0.0]), torch.tensor([0.4, 0.3, 0.0]))
    tensor([0.5000, 1.0000, 0.0000])
    """
    ratio = p_draft / q_draft.clamp(min=torch.finfo(q_draft.dtype).tiny)
    return torch.where(q_draft > 0, ratio.clamp(max=1), (p_draft > 0).to(p_draft.dtype))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` per row, what a rejection resamples from; ``p`` itself where the residual is all zero
    (then ``p == q`` and a rejection has probability 0).

    >>> residual_distribution(torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[1.0, 0.0, 0.0]]))
    tensor([[0.0000, 0.6000, 0.4000]])
    """
    residual = (p - q).clamp(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p)


def accept_draft(
    target_logits: torch.Tensor, draft: Draft, sampling: Sampling, input_ids: torch.Tensor | None = None
) -> list[int]:
    """Verify ``draft`` (a chain or a tree) against the target's logits; return the new tokens.

    ``target_logits[0]`` is the target's prediction after the last verified token, ``target_logits[i + 1]`` after
    draft token ``i`` and its ancestors, so it has ``len(draft) + 1`` rows. From the last verified token on, the
    children of the current node are tried in their order; an accepted child becomes the current node, and when
    none is (or there are none) the target's own token ends the step: ``len(result) - 1`` of the returned tokens
    came from the draft. Sampling draws the target's token at each node reached, as ``model.generate`` draws it, and
    moves to the child whose token was drawn (see the module); a draft with ``probs`` tries the children by the
    multi-candidate rule of SpecInfer (Miao et al. 2024): a child is accepted with probability ``min(1, r(d) / q(d))``
    where ``r`` starts as the target's ``p`` and becomes ``norm(max(0, r - q))`` after each rejected child; the
    target's token is drawn from the last ``r`` (for a chain, Leviathan et al.'s rule). Every emitted token is
    distributed exactly as ``p``. ``input_ids`` (``[1, length]``: the sequence so far followed by the draft) is
    needed when ``sampling.reads_tokens``. One host-device synchronisation per call (greedy, drafts with ``probs``),
    or per new token (drafts without).

    >>> logits = torch.eye(5)[[1, 2, 4]]                       # the target's argmax: 1, then 2, then 4
    >>> accept_draft(logits, Draft([1, 3]), Sampling())        # greedy: 1 agrees, 3 does not, correct to 2
    [1, 2]
    >>> logits = torch.eye(5)[[1, 3, 0, 4]]                    # after 1: 3 (after 1 2: 0); after 1 3: 4
    >>> accept_draft(logits, Draft([1, 2, 3], parents=[-1, 0, 0]), Sampling())  # the second child agrees
    [1, 3, 4]
    """
    scores = _scores(target_logits, draft, sampling, input_ids)  # [n + 1, vocab]
    if sampling.greedy:
        return _walk(draft, scores.argmax(dim=-1).tolist())
    if draft.probs is None:
        return _drawn_walk(scores, draft.tokens.tolist(), draft.children(), sampling)
    accepted, own = _sampled_decisions(torch.softmax(scores, dim=-1), draft, draft.children(), sampling)
    return _walk(draft, own, accepted)


def accept_drafts(
    target_logits: list[torch.Tensor],
    drafts: list[Draft],
    samplings: list[Sampling],
    input_ids: Callable[[int], torch.Tensor | None],
) -> list[list[int]]:
    """:func:`accept_draft` for each row of a pass (``input_ids(r)``: row ``r``'s, where its sampling reads
    tokens); the greedy rows without logits processors take their argmax together, one host-device synchronisation
    for all of them (in fp32, as :func:`accept_draft` takes it: torch's bf16 argmax is its slow path on a CPU)."""
    outcomes: list[list[int] | None] = [None] * len(drafts)
    plain = [r for r, sampling in enumerate(samplings) if sampling.greedy and not sampling.processors]
    if plain:
        own = torch.cat([target_logits[r].float().argmax(dim=-1) for r in plain]).tolist()  # [sum of n + 1]
        at = 0
        for r in plain:
            outcomes[r] = _walk(drafts[r], own[at : at + len(drafts[r]) + 1])
            at += len(drafts[r]) + 1
    for r, outcome in enumerate(outcomes):
        if outcome is None:
            outcomes[r] = accept_draft(target_logits[r], drafts[r], samplings[r], input_ids(r))
    return outcomes


def _walk(draft: Draft, own: list[int], accepted: list[bool] | None = None) -> list[int]:
    """The new tokens: from the last verified token, the first child of the node reached that is ``accepted``
    (default: greedy's, the child whose token is the target's ``own`` after its parent), until none is; then the
    target's own token after that node. ``own``: ``[n + 1]``, after each node."""
    if not len(draft):
        return [own[0]]
    tokens, children = draft.tokens.tolist(), draft.children()
    if accepted is None:
        accepted = [token == own[parent + 1] for token, parent in zip(tokens, draft.parent_list())]
    new, node = [], -1
    while (child := next((c for c in children[node + 1] if accepted[c]), None)) is not None:
        new.append(tokens[child])
        node = child
    return new + [own[node + 1]]


def _drawn_walk(scores: torch.Tensor, tokens: list[int], children: list[list[int]], sampling: Sampling) -> list[int]:
    """From the last verified token, draw the target's token at the node reached as ``model.generate`` draws it
    (softmax of that node's scores, ``[1, vocab]``, one ``torch.multinomial``) and move to the child with that
    token, until none has it: the drawn tokens are the step's new tokens. ``scores``: ``[n + 1, vocab]``."""
    new, node = [], -1
    while True:
        drawn = int(sampling.sample(torch.softmax(scores[node + 1 : node + 2], dim=-1)))
        new.append(drawn)
        node = next((child for child in children[node + 1] if tokens[child] == drawn), None)
        if node is None:
            return new


def _scores(logits: torch.Tensor, draft: Draft, sampling: Sampling, input_ids: torch.Tensor | None) -> torch.Tensor:
    """The target's processed scores after each node; a processor that reads the tokens sees each node's own
    path (in a chain, the rows' prefixes of ``input_ids``)."""
    if not draft.is_tree or not sampling.reads_tokens:
        return sampling.scores(logits, input_ids)
    if input_ids is None:
        raise ValueError("These logits processors read the tokens so far: pass input_ids to accept_draft().")
    sequence, parents = input_ids[:, : input_ids.shape[1] - len(draft)], draft.parent_list()
    paths = [sequence]  # paths[i + 1]: the tokens node i follows, itself included
    for index, parent in enumerate(parents):
        paths.append(torch.cat([paths[parent + 1], draft.tokens[index : index + 1, None].T.to(sequence.device)], 1))
    return torch.cat([sampling.scores(logits[i : i + 1], path) for i, path in enumerate(paths)])


def _sampled_decisions(
    p: torch.Tensor, draft: Draft, children: list[list[int]], sampling: Sampling
) -> tuple[list[bool], list[int]]:
    """Whether each draft token is accepted if tried (after its elder siblings were rejected), and the target's
    token drawn after each node should all its children be rejected. ``p``: ``[n + 1, vocab]``."""
    num_draft, device = len(draft), p.device
    tokens = draft.tokens.to(device)
    if draft.probs is None:
        q = torch.zeros_like(p[:num_draft]).scatter_(1, tokens[:, None], 1.0)  # [n, vocab]
    else:
        q = draft.probs.to(device=device, dtype=p.dtype)
    chance = torch.empty(num_draft, device=device, dtype=p.dtype)
    residual = p  # [n + 1, vocab]: r at each node once the children tried so far were rejected
    for rank in range(max(map(len, children))):  # the first children of all nodes at once, then the second ...
        nodes = [node for node, kids in enumerate(children) if len(kids) > rank]
        kids = torch.tensor([children[node][rank] for node in nodes], device=device)
        at = torch.tensor(nodes, device=device)
        chance[kids] = acceptance_probability(residual[at, tokens[kids]], q[kids, tokens[kids]])
        residual = residual.index_copy(0, at, residual_distribution(residual[at], q[kids]))
    accept = sampling.uniform(num_draft, device) < chance
    own = sampling.sample(residual)  # [n + 1]: only the one where the walk stops is used
    decisions = torch.cat([accept.long(), own]).tolist()
    return [bool(d) for d in decisions[:num_draft]], decisions[num_draft:]
