"""Log probabilities of the tokens a request was given, as OpenAI's ``logprobs`` report them.

A token's log probability is read from the logits the verification pass computed at its position: the model's own
distribution there, before logits processors and sampling settings change it (vLLM's default, "raw logprobs"), for
a token the target chose itself as for a draft token it accepted. With ordinary verification they are the pass's
numbers, which may differ from ``model.generate``'s one-token steps in their last bits (as the tokens may not:
docs/exactness.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP = 20  # alternatives a token may list (OpenAI's top_logprobs goes up to 20)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log probability (``None``: a prompt's first token, which nothing before it chose), and the ``top``
    likeliest tokens at its position (id, log probability), likeliest first."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each of ``tokens`` with its log probability under the logits of its position (``logits``: ``[len(tokens),
    vocab]``, row ``i`` the one that chose token ``i``) and its position's ``top`` likeliest tokens.

    >>> logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    >>> [(t.token, round(t.logprob, 3), t.top[0][0]) for t in token_logprobs(logits, [1, 0], 1)]
    [(1, -0.693, 0), (0, -0.127, 0)]
    """
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    if top:
        values, indices = logprobs.topk(top, dim=-1)  # [n, top]
        tops = [tuple(zip(ids, lps)) for ids, lps in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(token, logprob, alternatives) for token, logprob, alternatives in zip(tokens, chosen, tops)]
