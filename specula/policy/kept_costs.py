"""Pass costs measured once per machine and model and kept: what sizes drafts where output depends on their lengths.

With ordinary verification in bf16 or fp16, a pass over several tokens rounds otherwise than one-token steps, so
which tokens come may depend on how many drafts each pass verified. Draft lengths must then not follow the clock,
or a request would decode differently from run to run. Yet they should follow what passes cost, or a machine where
a pass over 8 tokens costs several one-token steps would be slower than plain decoding. So there, draft lengths are
decided from a table of pass costs measured once per machine and model (passes over 1, 2, 3, 5, 9, 17 and 33 tokens
after :data:`CONTEXT` tokens, timed in rounds, the lower median of each width's ratio to the one-token pass) and kept
with the calibrations (:mod:`specula.verifier.calibration`): later runs on the machine read the same table, so they
decide alike.
"""

from __future__ import annotations

import torch

from ..verifier import calibration
from ..verifier.calibration import calibration_key
from ..verifier.exactness import model_key
from ..verifier.support import UnsupportedModelError, vocab_size
from .costs import PassCosts, lower_median

CONTEXT = 256  # tokens of cache the timed passes follow
WIDTHS = (1, 2, 3, 5, 9, 17, 33)  # tokens per timed pass
ROUNDS = 3


class KeptCosts(PassCosts):
    """A one-row :class:`PassCosts` that holds a kept table: nothing is recorded into it, nothing re-measured, and
    no draft sent longer than its widest pass measured (a wider one's cost is not known, and never will be)."""

    def record(self, tokens: int, seconds: float, tree: bool = False) -> None:
        pass

    def explored_width(self, tree: bool = False) -> int:
        return min(super().explored_width(tree), WIDTHS[-1] - 1)


def kept_pass_costs(model: torch.nn.Module, max_draft: int) -> KeptCosts | None:
    """The kept pass costs of ``model`` on this machine (measured on first use), as one-row costs for drafts of up to
    ``max_draft`` tokens; ``None`` where its passes cannot be timed so."""
    weight = next(model.parameters())
    key = calibration_key(weight.device, "pass costs", model_key(model), weight.dtype,
                          model.config._attn_implementation, CONTEXT)
    ratios = calibration.shared().get(key, lambda: _measure(model))
    if ratios is None:
        return None
    costs = KeptCosts(1, max_draft + 2)
    for tokens, ratio in zip(WIDTHS, ratios):
        if tokens < costs.size:
            PassCosts.record(costs, tokens, ratio)
    return costs


@torch.inference_mode()
def _measure(model: torch.nn.Module) -> list[float] | None:
    """Each of :data:`WIDTHS`' pass cost over a one-token pass's, ordinary verification."""
    from ..verifier.runner import CachedModel

    device = model.get_input_embeddings().weight.device
    passes = (ROUNDS + 1) * len(WIDTHS)  # (each keeps its first token, as the loop's passes do)
    ids = torch.randint(3, vocab_size(model), (CONTEXT + passes + max(WIDTHS),),
                        generator=torch.Generator().manual_seed(0)).to(device)
    seconds: dict[int, list[float]] = {width: [] for width in WIDTHS}
    try:
        target = CachedModel(model, None, None, rollback=True, capacity=len(ids) + 1)
        target.start_row(0, ids[:CONTEXT])
        for _ in range(ROUNDS + 1):  # (the first round warms up)
            for width in WIDTHS:
                at = target.cached_tokens
                started = calibration.CLOCK()
                target.forward_rows([ids[at : at + width]], [width], argmax_only=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds[width].append(calibration.CLOCK() - started)
                target.keep_rows([1])
    except UnsupportedModelError:  # (a model the loop refuses, or whose state cannot be rolled back so)
        return None
    ratios = [[s / one for s, one in zip(seconds[width][1:], seconds[1][1:])] for width in WIDTHS]
    return [round(lower_median(r), 3) for r in ratios]
