"""Exact or ordinary verification: bitwise ``model.generate`` where it is cheap, chosen by its measured cost.

A row-exact pass (:mod:`specula.verifier.row_exact`) gives every token of a verification pass the bits of its
one-token step, so greedy output is ``model.generate``'s bit for bit in bf16 and fp16 too. What that costs differs
by machine, from a few percent to several times an ordinary pass (docs/exactness.md). So by default (``exact=None``)
specula measures it, once per machine
and model: a pass over ``TIMED_ROWS`` tokens after :data:`CONTEXT` tokens, row-exact against ordinary, interleaved
(a busy moment slows both), the lower median of the ratios. Exactness is chosen where it costs at most
:data:`THRESHOLD` times an ordinary pass, measured while the machine was quiet (one measured while other programs
took the CPUs is taken as dear: its threads wait alike in both kinds of pass, and the answers must not follow the
load; on the AMX Xeon a run with a core busy chose exactness where quiet ones measured 1.50-1.55x), and one that would
start while they take them is not made (taken as dear, :meth:`~specula.machine.store.Store.get`). The measurement
is kept with the calibrations (:mod:`.calibration`), so a machine keeps its choice and a request decodes the same on
every run (where exactness is not chosen, the loop takes passes invariant to drafts and batches where they hold:
:mod:`.invariant`). ``exact=True`` forces exactness whatever
it costs, ``exact=False`` never pays for it.

In fp32, passes of other shapes round differently too, but far below the gaps between logits: the default there is
ordinary verification, unmeasured (``exact=True`` makes it bitwise).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass

import torch

from ..machine import store
from ..machine.timing import lower_median, time_pass
from .calibration import TIMED_ROWS
from .row_exact import SUPPORTED_ATTENTION, is_half_precision
from .support import UnsupportedModelError, fit_context, is_quantized, model_device, vocab_size

THRESHOLD = 1.10  # exactness is chosen by default where a row-exact pass costs at most this many ordinary ones
CONTEXT = 256  # tokens of cache the timed passes follow
REPEATS = 5


@dataclass(frozen=True)
class Exactness:
    """How verification passes are computed, and why."""

    exact: bool  # row-exact: every token's bits those of its one-token step
    cost: float | None = None  # a row-exact pass's time over an ordinary one's, where measured
    reason: str = "asked"  # "asked", "measured", "fp32", "plain" (no pass over several tokens), or why not exact
    invariant: bool = False  # ordinary passes that round every row alike whatever the pass (verifier.invariant)

    def __str__(self) -> str:
        cost = f"; a row-exact pass costs {self.cost:.2f}x an ordinary one here" if self.cost is not None else ""
        if self.exact:
            return f"exact (bitwise model.generate{cost})"
        kind = "ordinary verification" + (", invariant to drafts and batches" if self.invariant else "")
        return f"{kind} ({self.reason}{cost})" if self.reason != "asked" else kind


def choose(model: torch.nn.Module, exact: bool | None, verifies: bool = True) -> Exactness:
    """How ``model``'s verification passes are computed: ``exact`` as given, else chosen (see the module docstring).
    ``verifies=False``: no pass over several tokens will run (plain decoding of one request), so nothing to pay."""
    if not verifies:
        return Exactness(True, reason="plain")
    if exact is not None:
        return Exactness(bool(exact))
    if not is_half_precision(model):
        return Exactness(False, reason="fp32: rounding far below the gaps between logits")
    if model.config._attn_implementation not in SUPPORTED_ATTENTION:
        return Exactness(
            False, reason=f"row-exact passes need sdpa or eager attention, not {model.config._attn_implementation!r}"
        )
    cost = measured_cost(model)
    if cost is None:
        return Exactness(False, reason="this model's row-exact passes are not supported")
    if cost == math.inf:
        return Exactness(
            False, reason="not measured while other programs took the CPUs: taken as dear; exact=True forces it"
        )
    if cost <= THRESHOLD and _cost_key(model) in store.shared().unkept:
        # (a busy machine's threads wait at every operation of both kinds of pass alike: ratios near 1 that a quiet
        # one does not measure; its answers must not follow the load)
        return Exactness(
            False, cost, "measured while other programs took the CPUs: taken as dear; exact=True forces it"
        )
    return Exactness(
        cost <= THRESHOLD,
        cost,
        "measured" if cost <= THRESHOLD else f"exactness would cost over {THRESHOLD:.2f}x; exact=True forces it",
    )


def model_key(model: torch.nn.Module) -> str:
    """What a measurement of the model depends on besides the machine: its parameters' names, shapes, dtypes, kinds
    of tensor (a quantized weight is another tensor subclass) and devices (an offloaded layer's weights wait on
    ``meta`` for a hook to bring them): whatever makes its passes cost otherwise."""
    shapes = str(
        [
            (name, tuple(p.shape), str(p.dtype), type(p).__name__ if is_quantized(p) else "Tensor", p.device.type)
            for name, p in model.named_parameters()
        ]
    )
    return hashlib.sha1(shapes.encode()).hexdigest()[:16]


def measured_cost(model: torch.nn.Module) -> float | None:
    """A row-exact pass's time over an ordinary one's for ``model`` on this machine (measured once, kept); ``None``
    where row-exact passes are not supported for it; infinite where other programs took the CPUs as it would have
    been measured (not measured: taken as dear)."""
    return store.shared().get(_cost_key(model), lambda: _measure(model), busy=lambda: math.inf)


def _cost_key(model: torch.nn.Module) -> str:
    weight = next(model.parameters())
    return store.key(
        weight.device, "exact pass", model_key(model), weight.dtype, model.config._attn_implementation, CONTEXT
    )


@torch.no_grad()
def _measure(model: torch.nn.Module) -> float | None:
    from .runner import CachedModel, OneSequence

    device = model_device(model)
    context = fit_context(model, CONTEXT, REPEATS + 1 + TIMED_ROWS)
    ids = torch.randint(
        3, vocab_size(model), (context + REPEATS + 1 + TIMED_ROWS,), generator=torch.Generator().manual_seed(0)
    ).to(device)

    def seconds(target: CachedModel) -> float:
        """One pass over ``TIMED_ROWS`` tokens, keeping its first (as the loop's passes do)."""
        at = target.cached_tokens
        elapsed = time_pass(
            lambda: target.forward_rows([ids[at : at + TIMED_ROWS]], [TIMED_ROWS], argmax_only=True), device
        )
        target.keep_rows([1])
        return elapsed

    try:
        targets = [OneSequence(model, rollback=True, capacity=len(ids) + 1, row_exact=exact) for exact in (False, True)]
        for target in targets:
            target.start_row(0, ids[:context])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (what the row-exact kernels cost is what is being measured)
            for target in targets:
                seconds(target)  # warm-up (the row-exact kernels are calibrated here)
            ratios = []
            for _ in range(REPEATS):
                ordinary = seconds(targets[0])
                ratios.append(seconds(targets[1]) / ordinary)
    except UnsupportedModelError:  # (row-exact passes, or the loop itself, refused for this model)
        return None
    return round(lower_median(ratios), 3)
