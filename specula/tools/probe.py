"""The invariance probe: does a pass over several tokens compute, bit for bit, what one-token steps compute?

:func:`probe` feeds the same tokens after the same prompt twice -- as one-token steps (``model.generate``'s way) and
as one verification pass -- records every module's output at every position with forward hooks, and names the first
module whose inputs agree but whose outputs differ: the operation that rounds differently for this model, device
and dtype. ``specula probe`` runs it from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..verifier.runner import OneSequence


@dataclass
class ProbeReport:
    """What :func:`probe` found. ``culprit`` is ``None`` when every position's logits agree bit for bit."""

    device: str
    dtype: str
    width: int
    exact: bool
    logits_identical: bool
    culprit: str | None = None
    culprit_op: str | None = None
    differing_positions: list[int] = field(default_factory=list)
    modules_differing: int = 0
    max_logit_difference: float = 0.0

    def __str__(self) -> str:
        setting = f"{self.dtype} on {self.device}, a pass over {self.width} tokens" + (
            " (row-exact verification)" if self.exact else " (ordinary verification)"
        )
        if self.culprit is None and self.logits_identical:
            return f"{setting}: every module's output is bit for bit what one-token steps give."
        where = (
            f"; first: {self.culprit} ({self.culprit_op}) at positions {self.differing_positions}"
            if self.culprit
            else ""
        )
        return (
            f"{setting}: {self.modules_differing} modules' outputs differ from one-token steps{where}; logits "
            f"{'identical' if self.logits_identical else f'differ by up to {self.max_logit_difference:.3g}'}."
        )


def _first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    return getattr(value, "logits", None) if hasattr(value, "logits") else None


def _describe(module: torch.nn.Module, model: torch.nn.Module) -> str:
    if isinstance(module, torch.nn.Linear):
        return f"linear {module.in_features} -> {module.out_features}"
    if hasattr(module, "num_key_value_groups") or type(module).__name__.endswith(("Attention", "SdpaAttention")):
        return f"attention ({model.config._attn_implementation}) inside {type(module).__name__}"
    return type(module).__name__


class _Recorder:
    """Forward hooks that keep every module's first input and output tensor, per call, in call order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []
        self.handles = [
            module.register_forward_hook(self._hook(name), with_kwargs=True)
            for name, module in model.named_modules()
            if name
        ]

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            given = _first_tensor(list(args) + [v for v in kwargs.values() if isinstance(v, torch.Tensor)])
            self.calls.append((name, given, _first_tensor(output)))

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _seq_rows(tensor: torch.Tensor | None, width: int) -> list[torch.Tensor] | None:
    """A ``[batch, positions, ...]`` tensor's rows by position, or ``None`` if it has no such axis of ``width``."""
    if tensor is None or tensor.dim() < 2 or tensor.shape[1] != width:
        return None
    return [tensor[:, j] for j in range(width)]


@torch.no_grad()
def probe(model: torch.nn.Module, input_ids: torch.Tensor, width: int = 8, exact: bool = True) -> ProbeReport:
    """Compare one-token steps over the last ``width`` tokens of ``input_ids`` with one pass over them.

    Args:
        model: the target model, on its device and in its dtype.
        input_ids: ``[1, length]`` real text; the first ``length - width`` tokens are the prompt.
        width: tokens in the pass (the last token and ``width - 1`` drafts).
        exact: verify row-exactly (:mod:`specula.verifier.row_exact`), or the ordinary way.
    """
    ids = input_ids.reshape(-1).to(model.device)
    if not 2 <= width < len(ids):
        raise ValueError(f"width must be at least 2 and less than the prompt's {len(ids)} tokens, got {width}.")
    prompt, tail = ids[:-width], ids[-width:]

    steps_target = OneSequence(model, rollback=False, capacity=len(ids))
    steps_target.forward(prompt, 1)
    recorder = _Recorder(model)
    try:
        logits_steps = torch.cat([steps_target.forward(tail[j : j + 1], 1) for j in range(width)])
        step_calls = recorder.calls
        recorder.calls = []
        pass_target = OneSequence(model, rollback=True, capacity=len(ids), row_exact=exact)
        recorder.remove()
        pass_target.forward(prompt, 1)
        recorder = _Recorder(model)
        logits_pass = pass_target.forward(tail, width)
        pass_calls = recorder.calls
    finally:
        recorder.remove()

    report = ProbeReport(
        device=str(model.device),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        width=width,
        exact=exact,
        logits_identical=torch.equal(logits_steps, logits_pass),
        max_logit_difference=float((logits_steps.float() - logits_pass.float()).abs().max()),
    )
    _name_the_culprit(report, model, step_calls, pass_calls, width)
    return report


def _name_the_culprit(
    report: ProbeReport, model: torch.nn.Module, step_calls: list, pass_calls: list, width: int
) -> None:
    """Count the modules whose pass output differs from their one-token steps', and name the first whose inputs
    agree. One-token steps repeat each module's calls once per step; a pass calls each once."""
    per_step = len(step_calls) // width
    modules = dict(model.named_modules())
    for index, (name, given, output) in enumerate(pass_calls):
        step_outputs = [step_calls[j * per_step + index][2] for j in range(width)]
        step_inputs = [step_calls[j * per_step + index][1] for j in range(width)]
        rows = _seq_rows(output, width)
        if rows is None or any(o is None or o.dim() < 2 or o.shape[1] != 1 for o in step_outputs):
            continue
        differs = [j for j in range(width) if not torch.equal(rows[j], step_outputs[j][:, 0])]
        if not differs:
            continue
        report.modules_differing += 1
        given_rows = _seq_rows(given, width)
        inputs_agree = given_rows is None or all(
            s is not None and s.dim() >= 2 and torch.equal(given_rows[j], s[:, 0]) for j, s in enumerate(step_inputs)
        )
        if report.culprit is None and inputs_agree:
            report.culprit, report.culprit_op = name, _describe(modules[name], model)
            report.differing_positions = differs
