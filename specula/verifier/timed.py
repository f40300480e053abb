"""Passes of a model timed on this machine, as the loop runs them: what the policy's decisions are made from (the
policy says what to time and decides; this layer runs the model)."""

from __future__ import annotations

import torch

from ..machine.timing import lower_median, time_pass
from .runner import CachedModel, RaggedRows, cached_model
from .support import UnsupportedModelError, fit_context, model_device, vocab_size


@torch.no_grad()
def width_costs(
    model: torch.nn.Module,
    rows: int,
    widths: tuple[int, ...],
    context: int,
    rounds: int,
    compiled: str | None = None,
    max_width: int = 1,
) -> list[float] | None:
    """The cost of an ordinary pass of ``rows`` rows over each of ``widths`` tokens a row (the first 1), after
    ``context`` tokens a row (fewer where the model's positions end), over a one-token pass's: timed in ``rounds``
    rounds after one that warms up, the lower median of each width's ratios; ``None`` where the loop refuses the
    model or cannot roll its state back so. ``compiled``, ``max_width``: passes as a compiled run takes them
    (:class:`~specula.verifier.runner.CachedModel`)."""
    device = model_device(model)
    passes = (rounds + 1) * len(widths)  # (each keeps its first token, as the loop's passes do)
    context = fit_context(model, context, passes + max(widths))
    ids = torch.randint(
        3, vocab_size(model), (context + passes + max(widths),), generator=torch.Generator().manual_seed(0)
    ).to(device)
    seconds: dict[int, list[float]] = {width: [] for width in widths}
    try:
        target = cached_model(
            model,
            rollback=True,
            capacity=len(ids) + 1,
            slots=rows,
            cheap_steps=True,
            compiled=compiled,
            max_width=max_width,
        )
        _fill(target, ids, [context] * rows)
        at = context  # (every row's cached tokens)
        for _ in range(rounds + 1):  # (the first round warms up)
            for width in widths:
                block = [ids[at : at + width]] * rows
                seconds[width].append(
                    time_pass(lambda: target.forward_rows(block, [width] * rows, argmax_only=True), device)
                )
                target.keep_rows([1] * rows)
                at += 1
    except UnsupportedModelError:  # (a model the loop refuses, or whose state cannot be rolled back so)
        return None
    ratios = [[s / one for s, one in zip(seconds[width][1:], seconds[widths[0]][1:])] for width in widths]
    return [round(lower_median(r), 3) for r in ratios]


class BatchRates:
    """Plain passes (one token a row) over batches of 1 to ``largest`` rows as the loop runs them, the rows of
    different lengths as real requests are (``context``, ``context + step`` ... tokens, fewer where the model's
    positions end): :meth:`rate` is a size's tokens per second in those of a one-row pass timed just before each
    (load on the machine slows both, so it favours no size)."""

    def __init__(self, model: torch.nn.Module, largest: int, context: int, exact: bool, limit: int) -> None:
        self.step = max(0, min(16, (limit - 2 - context) // largest))  # (tokens each row has over the one before)
        self.context = max(1, min(context, limit - 2 - self.step * largest))
        self.device = model_device(model)
        longest = self.context + self.step * largest
        self.text = torch.randint(0, vocab_size(model), (longest,), generator=torch.Generator().manual_seed(0))
        self.text = self.text.to(self.device)
        self.target, self.alone = (
            RaggedRows(model, rollback=True, capacity=longest + 1, row_exact=exact, slots=slots, cheap_steps=not exact)
            for slots in (largest, 1)
        )  # (raises UnsupportedModelError for a model that cannot be batched)
        self.alone.start_row(0, self.text)
        self.target.start_row(0, self.text)  # (the longest row, whose prefixes the others take)

    def grow(self, size: int) -> float:
        """Rows up to ``size``; the bytes of keys and values a token of a row takes (0 for recurrent state)."""
        _fill(self.target, self.text, [self.context + self.step * index for index in range(size)], self.target.batch)
        return sum(
            t.nbytes
            for layer in self.target.cache.layers
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if isinstance(t, torch.Tensor)
        ) / (size * self.target.cached_tokens)

    def rate(self, rounds: int = 3) -> float:
        """Tokens per second of plain passes over the rows held, in those of a one-row pass (the lower median over
        ``rounds`` rounds, after one that warms up)."""
        token, ratios = self.text[:1], []
        for _ in range(rounds + 1):
            one = _pass_seconds(self.alone, [token])
            ratios.append(self.target.batch * one / _pass_seconds(self.target, [token] * self.target.batch))
        return lower_median(ratios[1:])


def _fill(target: CachedModel, text: torch.Tensor, lengths: list[int], start: int = 0) -> None:
    """Rows ``start`` to ``len(lengths) - 1`` of ``target``, row ``i`` the first ``lengths[i]`` tokens of ``text``:
    row 0 computed, the others copied from it where the cache holds prefixes, computed where it cannot (recurrent
    state)."""
    for index in range(start, len(lengths)):
        if index == 0 or target.rows_state is not None:
            target.start_row(index, text[: lengths[index]])
        else:
            target.copy_prefix(0, index, lengths[index])


def _pass_seconds(target: CachedModel, blocks: list[torch.Tensor]) -> float:
    """The time of a plain pass over ``blocks`` (one token a row); the cache is left as it was."""
    seconds = time_pass(lambda: target.forward_rows(blocks, [1] * len(blocks)), target.device)
    target.keep_rows([0] * len(blocks))  # (forgotten again)
    return seconds
