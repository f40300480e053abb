"""The transformers model inside what users hold: a PEFT model's base model with its adapters in place, the module a
``torch.compile`` wrapped. specula runs that model's forward as the wrapper would, so its output stays the wrapper's
``generate``'s."""

from __future__ import annotations

import torch

PROMPT_LEARNING = "adds virtual tokens to every pass (prompt or prefix tuning), which specula's passes do not"


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model ``model`` runs: itself; for a ``peft.PeftModel`` with injected adapters (LoRA and its
    kin, unmerged, the active ones applied), its base model, whose layers hold the adapters; for a module
    ``torch.compile`` made, the module it compiled (specula compiles its own passes where that pays: ``compile=``).
    A PEFT model whose forward does more than its base model's is refused with a ``ValueError``."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return unwrapped(model._orig_mod)
    if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
        config = model.active_peft_config
        if config.is_prompt_learning:
            raise ValueError(
                f"specula cannot run this {type(model).__name__}: its adapter "
                f"({config.peft_type}) {PROMPT_LEARNING}; merge it or use model.generate"
            )
        if getattr(config, "alora_invocation_tokens", None):
            raise ValueError(
                f"specula cannot run this {type(model).__name__}: its activated LoRA switches on at "
                "invocation tokens inside the prompt, which specula's passes do not track; use "
                "model.generate"
            )
        return unwrapped(model.get_base_model())
    return model
