"""What the verifier's calibrations time and test on: the widths of the passes, and data that exposes a changed
summation order. The measurements themselves are kept in the one store (:mod:`specula.machine.store`)."""

from __future__ import annotations

import torch

CALIBRATION_ROWS = 33  # the widest pass calibrated (32 drafts); a wider one chunks every linear layer row-exactly
TIMED_ROWS = 9  # strategies are timed on a typical pass: the last token and 8 drafts ...
TIMED_KEYS = 700  # ... after this many tokens


def spread(shape: tuple, generator: torch.Generator, octaves: float) -> torch.Tensor:
    """Random values of both signs whose magnitudes spread over ``octaves`` powers of two: sums of them cancel and
    are dominated by a few terms, so that a sum taken in another order rounds otherwise far more often than for
    Gaussian values."""
    magnitudes = torch.exp2((torch.rand(shape, generator=generator) - 0.5) * octaves)
    return torch.randn(shape, generator=generator) * magnitudes
