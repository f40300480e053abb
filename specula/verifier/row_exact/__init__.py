"""Verification passes that compute every token exactly as a one-token step computes it.

A pass over k+1 tokens runs other kernels than a one-token step: in bf16 a matmul over k+1 rows may block its sum
over the inner dimension otherwise than one over 1 row, and attention with k+1 queries reduces otherwise than with
one. The results differ in the last bit now and then, and where two tokens' logits are that close, greedy output
differs from ``model.generate``'s. :class:`RowExact` removes the difference during the verifier's multi-token passes,
without touching the model's own one-token path:

- attention (:mod:`.attention`): each query row is computed as the model's own attention function computes a
  one-token step at its position, over the same keys with the same mask (the window of a sliding-window layer
  included). With SDPA, rows whose key counts differ little share one call, each as a batch entry of one query
  (:func:`.grouping._grouped_sdpa`), in groups as wide as a check finds exact and the clock finds cheapest; a group
  of one is the one-token call.
- linear layers (:mod:`.linear`): each ``nn.Linear`` (and GPT-2's ``Conv1D``) that gives a row other bits in a pass
  of several rows than alone computes its rows in chunks as wide as it stays exact for (:func:`.linear.exact_rows`),
  as it is or by columns (:func:`.linear._by_columns`), whichever the clock finds cheaper (which layers each CPU
  affects: ``docs/hardware.md``).
- the LM head of a greedy pass (:mod:`.head`): computed again exactly only for the rows whose argmax the rounding
  may have changed.

What is exact and what is cheapest is found once per machine, torch build and shape, and kept on disk
(:mod:`specula.machine.store`).

Everything else in a decoder (norms, rotary embeddings, activations, residual adds) works row by row and was found
invariant by :func:`specula.tools.probe.probe`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ...machine import store
from ...machine.profile import profile_of
from ..calibration import CALIBRATION_ROWS
from .attention import SUPPORTED_ATTENTION, RowAttention
from .head import _Head, _HeadPass
from .linear import _ExactLinear, exact_linears, exact_rows, installed

__all__ = ["SUPPORTED_ATTENTION", "RowExact", "exact_rows", "is_half_precision", "row_exact_for", "wanted"]


class RowExact:
    """Installs row-exact attention and linear layers on ``model`` for the duration of a multi-token pass.

    Build it with :func:`row_exact_for`, which checks each weight shape once per model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.implementation = model.config._attn_implementation
        if self.implementation not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"Row-exact verification supports the attention implementations {SUPPORTED_ATTENTION}, not "
                f"{self.implementation!r}; load the model with attn_implementation='sdpa'."
            )
        # plain_linears: chunked only in passes wider than calibrated (batches)
        self.linears, self.plain_linears, self.copied_bytes, linear_ms = exact_linears(model)
        self.head = _Head.of(model, self.linears)
        self.attention = RowAttention(self.implementation, linear_ms)

    @contextlib.contextmanager
    def applied(
        self, cache, ends: list[list[int]] | None = None, paths: list | None = None, argmax_only: bool = False
    ) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """Within the block, every multi-token pass of the model over ``cache`` (whose layers say which attention
        layers keep a sliding window) is row-exact. For a batch whose rows keep their own lengths, ``ends[b][i]``
        is how many keys of row ``b`` its query ``i`` sees (its keys start at slot 0: no padding). ``paths[b]``,
        for a row whose block is a tree, gives for each query the block indices of its ancestors and itself, or
        ``None`` where those are just the block tokens before it.

        Yields what turns the pass's logits into the ones to use. With ``argmax_only`` (greedy decoding that takes
        the argmax of the logits as they are), those are exact only where the argmax could change: the LM head
        feeds no cache, so it runs the ordinary way and only rows it cannot certify are computed again
        (:class:`.head._Head`).
        """
        head = self.head.pass_(argmax_only) if self.head is not None else None
        with self.attention.installed(cache, ends, paths), installed(self._linears(ends, head)):
            try:
                yield (lambda logits: logits) if head is None else head.logits
            finally:
                if head is not None:
                    head.close()

    def _linears(self, ends: list[list[int]] | None, head: _HeadPass | None) -> list[_ExactLinear]:
        """The linear layers a pass computes row-exactly: those that round otherwise in a multi-row pass, and in a
        pass wider than any width calibrated the others too; not the head where the pass runs it the ordinary way."""
        linears = self.linears
        if ends is not None and sum(map(len, ends)) > CALIBRATION_ROWS:  # wider than any width calibrated
            linears = linears + self.plain_linears
        if head is not None and head.shortcut:
            linears = [linear for linear in linears if linear is not self.head.exact]
        return linears


def row_exact_for(model: torch.nn.Module) -> RowExact:
    """The :class:`RowExact` of ``model``, built on first use (its checks take well under a second)."""
    weight = next(model.parameters())
    setting = (weight.dtype, weight.device, model.config._attn_implementation)
    profile = profile_of(model)
    if profile.row_exact is None or profile.row_exact[0] != setting:  # (again after model.to() or a new attention)
        profile.row_exact = (setting, RowExact(model))
        store.shared().tell()
    return profile.row_exact[1]


def is_half_precision(model: torch.nn.Module) -> bool:
    """Whether ``model`` computes in bf16 or fp16."""
    return next(model.parameters()).dtype in (torch.bfloat16, torch.float16)


def wanted(model: torch.nn.Module, row_exact: bool | None) -> bool:
    """Whether to verify row-exactly: ``row_exact`` as given, or by default in bf16 and fp16 with an attention
    implementation :class:`RowExact` supports."""
    if row_exact is None:
        return is_half_precision(model) and model.config._attn_implementation in SUPPORTED_ATTENTION
    return bool(row_exact)
