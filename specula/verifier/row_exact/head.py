"""The LM head of a greedy pass: run the ordinary way, its rows computed again exactly only where the rounding may
have changed their argmax (:class:`_Head`)."""

from __future__ import annotations

import torch

from ..support import weight_state
from .linear import _ExactLinear, _packed


class _Head:
    """The LM head of a model whose head rounds a row otherwise in a multi-row pass than alone, for greedy passes
    that only need each row's argmax (``model.generate``'s token) to be exact.

    Such a head runs the ordinary way; a row whose argmax the rounding cannot have changed keeps those logits, and
    the others are computed again exactly. The bound: a logit is ``z_j = sum_i h_i W_ji``, summed in float32 in some
    order and rounded once to the model's dtype. Summed in any order, ``|sum - z_j| <= gamma_d * sum_i |h_i W_ji|``
    with ``gamma_d = d u / (1 - d u)``, ``u = 2**-24`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
    3.1), and ``sum_i |h_i W_ji| <= |h| |W_j|`` (Cauchy-Schwarz); rounding moves each result by at most half a unit
    in the last place. So ordinary and exact logits differ by at most ``D_j = 2 gamma_d |h| |W_j| + U_j``, with
    ``U_j`` a unit in the last place one binade above ``|z_j|`` (plus a term for denormals flushed to zero), and the
    ordinary argmax ``a`` is the exact one (the first of the maxima, as ``argmax`` takes it, with no tie) wherever
    ``z_a - z_j > D_a + D_j`` for every other ``j``; :meth:`certain` checks it in float32 with the norms rounded up.
    Only on CPUs and GPUs that sum in float32 (a GPU allowed reduced-precision reductions is not covered), for a
    head without bias, its weight a plain tensor (not quantized), whose output the model returns as its logits (not
    softcapped or scaled: checked on the first pass, where the head is still exact).
    """

    def __init__(self, exact: _ExactLinear) -> None:
        self.exact, self.layer = exact, exact.layer
        self.returned: bool | None = None  # whether the model's logits are the head's output (seen on a first pass)
        d = self.layer.weight.shape[1]
        self.gamma = d * 2.0**-24 / (1 - d * 2.0**-24)
        self.eps = torch.finfo(self.layer.weight.dtype).eps  # a unit in the last place of 1.0 in the head's dtype
        self._norms: tuple[tuple[int, int], torch.Tensor, float] | None = None  # (weight version, |W_j|, max)
        self.norms()  # (now, while the model is being set up: a second for a 151936-token head, not in a timed pass)

    @classmethod
    def of(cls, model: torch.nn.Module, linears: list[_ExactLinear]) -> "_Head | None":
        """The model's head where it is among the layers computed row-exactly and the bound covers it."""
        layer = model.get_output_embeddings()
        exact = next((linear for linear in linears if linear.layer is layer), None)
        if exact is None or not isinstance(layer, torch.nn.Linear) or layer.bias is not None or _packed(layer):
            return None  # (a quantized head does not sum the stored numbers the bound is of)
        device, dtype = layer.weight.device, layer.weight.dtype
        if device.type == "cuda":
            matmul = torch.backends.cuda.matmul
            if (
                matmul.allow_bf16_reduced_precision_reduction
                if dtype == torch.bfloat16
                else matmul.allow_fp16_reduced_precision_reduction
            ):
                return None
        elif device.type != "cpu":
            return None
        return cls(exact)

    def norms(self) -> tuple[torch.Tensor, float]:
        """``|W_j|`` per token (float32, rounded up) and their largest, kept until the weight changes."""
        version = weight_state(self.layer.weight)
        if self._norms is None or self._norms[0] != version:
            norms = torch.linalg.vector_norm(self.layer.weight.detach().float(), dim=-1) * (1 + 2**-10)
            self._norms = (version, norms, float(norms.max()))
        return self._norms[1:]

    def certain(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Of ordinary-head ``logits`` ``[rows, vocab]`` from ``hidden`` ``[rows, d]``: whether each row's argmax
        is the exact head's (see the class). First with the row's largest bound for every token (its top two and
        largest magnitude: cheap), then token by token for the rows that leaves in doubt."""
        h = torch.linalg.vector_norm(hidden.float(), dim=-1) * (1 + 2**-10)  # [rows]
        norms, widest = self.norms()  # [vocab]; their largest
        flushed = hidden.shape[-1] * 2.0**-126 * (1 + float(h.max()) + widest)
        best = logits.topk(2, dim=-1).values.float()  # [rows, 2]
        bound = 2 * self.gamma * h * widest + flushed + self._ulp(logits.abs().amax(dim=-1).float())  # [rows]
        certain = best[:, 0] - best[:, 1] > 2 * bound
        doubtful = torch.nonzero(~certain).flatten()
        if len(doubtful):
            z = logits[doubtful].float()  # [doubtful, vocab]
            top, first = z.max(dim=-1, keepdim=True)
            bound = 2 * self.gamma * h[doubtful, None] * norms + flushed + self._ulp(torch.maximum(z.abs(), top.abs()))
            clear = (top - z) > bound + bound.gather(1, first)  # [doubtful, vocab]: z_a - z_j > D_a + D_j
            certain[doubtful] = clear.scatter_(1, first, True).all(dim=-1)
        return certain

    def _ulp(self, magnitude: torch.Tensor) -> torch.Tensor:
        """A unit in the last place of the head's dtype one binade above ``magnitude`` (float32)."""
        tiny = torch.finfo(torch.float32).tiny
        return self.eps * torch.exp2(torch.floor(torch.log2(magnitude.clamp(min=tiny))) + 1)

    def pass_(self, argmax_only: bool) -> "_HeadPass":
        return _HeadPass(self, shortcut=argmax_only and self.returned is True)


class _HeadPass:
    """One pass's view of the head: what it computed (watched with a hook), and the logits to use."""

    def __init__(self, head: _Head, shortcut: bool) -> None:
        self.head, self.shortcut, self.seen = head, shortcut, {}
        self.recomputed = 0  # rows whose argmax the bound could not certify
        self._hook = None
        if shortcut or head.returned is None:
            self._hook = head.layer.register_forward_hook(
                lambda module, args, out: self.seen.update(hidden=args[0], out=out)
            )

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The pass's ``logits`` ``[..., vocab]``, fixed where the ordinary head may have changed an argmax."""
        out = self.seen.get("out")
        returned = out is not None and logits.data_ptr() == out.data_ptr() and logits.shape == out.shape
        if self.head.returned is None:
            self.head.returned = returned
        if not self.shortcut:
            return logits
        if not returned:
            raise RuntimeError("the LM head's output is no longer the model's logits; cannot certify its argmax")
        flat, hidden = (
            logits.reshape(-1, logits.shape[-1]),
            self.seen["hidden"].reshape(-1, self.seen["hidden"].shape[-1]),
        )
        doubtful = torch.nonzero(~self.head.certain(flat, hidden)).flatten()
        self.recomputed = len(doubtful)
        if self.recomputed:
            flat = flat.clone()
            flat[doubtful] = self.head.exact.forward(hidden[doubtful][None])[0]
        return flat.reshape(logits.shape)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
