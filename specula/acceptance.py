"""Deciding which draft tokens the target keeps: the one acceptance rule every proposer goes through.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft token ``d`` drawn from ``q`` is accepted with
probability ``min(1, p(d) / q(d))``; at the first rejection the target's token is drawn from the residual
``norm(max(0, p - q))``; after all drafts are accepted a bonus token is drawn from the target's next ``p``. Every
emitted token is then distributed exactly as ``p``. A deterministic proposer's ``q`` is one-hot on its token, which
makes the rule "accept ``d`` with probability ``p(d)``, else draw from ``p`` without ``d``"; greedy decoding is the
temperature-0 case, where ``p`` is one-hot on the target's argmax.
"""

from __future__ import annotations

import torch

from .proposer import Draft
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
    """Verify ``draft`` against the target's logits; return the new tokens.

    ``target_logits[i]`` is the target's prediction after the last verified token and ``draft.tokens[:i]``, so it has
    ``len(draft) + 1`` rows. Keeps the accepted draft prefix and appends the target's own token (its choice at the
    first rejection, or the bonus token when the whole draft was accepted): ``len(result) - 1`` of the returned
    tokens came from the draft. ``input_ids`` (``[1, length]``: the sequence so far followed by the draft) is needed
    when ``sampling.reads_tokens``. One host-device synchronisation per call.

    >>> logits = torch.eye(5)[[1, 2, 4]]                       # the target's argmax: 1, then 2, then 4
    >>> accept_draft(logits, Draft([1, 3]), Sampling())        # greedy: 1 agrees, 3 does not, correct to 2
    [1, 2]
    """
    draft_tokens = draft.tokens.tolist()
    if sampling.greedy:
        target_tokens = sampling.scores(target_logits, input_ids).argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(draft_tokens) and draft_tokens[accepted] == target_tokens[accepted]:
            accepted += 1
        return draft_tokens[:accepted] + [target_tokens[accepted]]

    p = sampling.probs(target_logits, input_ids)
    num_draft, device = len(draft_tokens), p.device
    tokens = draft.tokens.to(device)
    if draft.probs is None:
        q = torch.zeros_like(p[:num_draft]).scatter_(1, tokens[:, None], 1.0)
    else:
        q = draft.probs.to(device=device, dtype=p.dtype)
    rows = torch.arange(num_draft, device=device)
    accept = sampling.uniform(num_draft, device) < acceptance_probability(p[rows, tokens], q[rows, tokens])
    # The target's token for every possible first rejection, and the bonus token; only one of them is used.
    own_tokens = sampling.sample(torch.cat([residual_distribution(p[:num_draft], q), p[num_draft:]]))
    decisions = torch.cat([accept.long(), own_tokens]).tolist()
    accepted = 0
    while accepted < num_draft and decisions[accepted]:
        accepted += 1
    return draft_tokens[:accepted] + [decisions[num_draft + accepted]]
