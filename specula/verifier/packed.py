"""Verification passes with prepacked weights on a CPU.

A pass over a few tokens reads the same weights as a one-token step, so on a CPU, where decoding is bound by
reading weights, it should cost little more. ``nn.Linear`` computes it with the BLAS kernel for a transposed
operand, which for a few rows can cost several one-row products; oneDNN's linear with the weight reordered once
into its own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) costs about one (the figures by machine:
docs/hardware.md). :class:`PackedLinears` computes the linear layers of a verification pass so, where that is faster
on this machine for that weight's shape (timed once, kept with the row-exact calibrations:
:mod:`specula.machine.store`). One-token steps and prompts' prefills round otherwise packed, so only ordinary
decoding's (``CachedModel(cheap_steps=True)``) take packed weights, for the shapes where one row (a step) or
:data:`PREFILL_ROWS` rows (a prefill, of a layer packed for passes or steps: no copy for prefills alone) are faster
packed on the machine at hand too (where oneDNN re-lays out the
weight at every one-row call, steps stay the model's own; a bf16 prefill's products are about a sixth cheaper packed on
the AVX512_BF16 EPYC: docs/hardware.md). Invariant passes (:mod:`.invariant`) take every layer oneDNN packs, for passes
and prefills, untimed: which layers are packed changes their bits, which must not follow the clock.

The packed copies cost memory (as much as the weights they copy): layers are packed only while the copies take at
most an eighth of the free memory. Where oneDNN cannot pack a dtype (bf16 without AVX512-BW or AVX-NE-CONVERT),
nothing is packed. Int8 weight-only weights (torchao's, optimum-quanto's) are not copied: their int8 numbers are read
as they are (:mod:`specula.verifier.int8`), where that is faster, in fp32 for passes up to the most rows it is
faster for. A model whose linear weights outgrow the CPU's caches (:data:`STREAMED` bytes) has its products timed over
copies of each weight that outgrow them too, as its passes read them (:func:`_faster`), and its timed ordinary fp32
passes may take a weight laid out in panels instead (:mod:`specula.verifier.panels`), where a pass computes faster so;
wider products (a prefill's) then take its oneDNN copy, where that was faster. A smaller model's passes read their
weights from the caches: each is timed as it is, and packed for oneDNN only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..machine import store
from ..machine.memory import spare_bytes
from ..machine.profile import profile_of
from ..machine.timing import cheapest
from .calibration import TIMED_ROWS
from .int8 import Int8Weight, int8_forward, int8_weight
from .panels import Panels, panel_forward, panels
from .support import is_quantized, weight_state

WIDER_ROWS = (16, 32, 64, 128)  # rows at which int8 weights, faster at TIMED_ROWS, are timed again
PREFILL_ROWS = 256  # rows at which a prefill's products are timed
STREAMED = 64 << 20  # bytes of weights past which a pass reads them from memory (more than a CPU's caches hold)
MOST_COPIES = 64  # copies of a weight it is timed over
PASS, STEP, PREFILL = range(3)  # what :meth:`PackedLinears.applied` computes: a pass, a one-token step, a prefill


def _packable(module: nn.Module) -> bool:
    """An ``nn.Linear`` computed by ``nn.Linear.forward`` itself (or optimum-quanto's ``QLinear`` of int8 weights,
    frozen, its activations not quantized: ``F.linear`` over them too), with a floating-point weight on the CPU."""
    weight = getattr(module, "weight", None)
    quanto = type(module).__module__.startswith("optimum.quanto.") and type(module).__name__ == "QLinear"
    return (
        isinstance(module, nn.Linear)
        and (
            type(module).forward is nn.Linear.forward
            or (quanto and module.activation_qtype is None and int8_weight(weight) is not None)
        )
        and isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.is_floating_point()
    )


def _pack(weight: torch.Tensor, layer: nn.Linear | None = None) -> torch.Tensor | Int8Weight | Panels | None:
    """``weight`` reordered for oneDNN's linear (torchao's int8 weights: their numbers and scales; with ``layer``, of a
    model whose weights are streamed from memory, an fp32 weight in panels where a pass computes faster so:
    :mod:`.panels`), ``None`` where none applies on this CPU."""
    if is_quantized(weight):
        return int8_weight(weight)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError):
        packed = None
    if layer is not None and weight.dtype == torch.float32 and _faster_in_panels(layer, packed):
        return panels(weight)._replace(wider=packed)
    return packed


def _faster_in_panels(layer: nn.Linear, packed: torch.Tensor | None) -> bool:
    """Whether a pass's ``TIMED_ROWS`` rows through the fp32 ``layer`` are faster in panels than packed for oneDNN
    (``packed``; ``None``: than as it is), timed once per shape on this machine (:func:`_faster`), remembered."""
    weight = layer.weight
    key = store.key(weight.device, "panel linear", tuple(weight.shape), layer.bias is not None, packed is not None)
    form = None if packed is None else _pack
    return store.shared().get(key, lambda: _faster(layer, TIMED_ROWS, form, panels, streamed=True))


@torch.no_grad()
def _faster(
    layer: nn.Linear,
    rows: int,
    first: Callable[[torch.Tensor], torch.Tensor | Int8Weight | Panels] | None,
    second: Callable[[torch.Tensor], torch.Tensor | Int8Weight | Panels],
    streamed: bool,
) -> bool:
    """Whether ``rows`` rows through ``layer`` compute faster with its weight as ``second(weight)`` makes it than as
    ``first`` does (``None``: as it is). ``streamed`` (a model whose weights outgrow the CPU's caches): timed over
    copies of the layer that outgrow them too (:data:`STREAMED` bytes), as a pass reads its layers: one weight read
    again and again is read from a cache, where another kernel may be the faster (the 2-core AVX2 EPYC, 576 x 576
    fp32: oneDNN's at 9 rows, not the panels' that are 1.5x faster read from memory). Else, and int8 numbers: timed
    in the one layer."""
    weight = layer.weight
    streamed = streamed and not is_quantized(weight)
    copies = [layer] + [_copy(layer) for _ in range(_copies(weight) - 1)] if streamed else [layer]

    def forwards(form):
        own = [functools.partial(type(copy).forward, copy) for copy in copies]
        return own if form is None else [_packed_forward(form(c.weight), c.bias, c) for c in copies]

    x = torch.randn((1, rows, weight.shape[1]), generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    runs = {"first": forwards(first), "second": forwards(second)}
    return cheapest({name: lambda run=run: [forward(x) for forward in run] for name, run in runs.items()}) == "second"


def _copies(weight: torch.Tensor) -> int:
    """How many copies of ``weight`` hold :data:`STREAMED` bytes (one at least, :data:`MOST_COPIES` at most)."""
    return min(max(1, -(-STREAMED // weight.nbytes)), MOST_COPIES)


def _copy(layer: nn.Linear) -> nn.Linear:
    """An ``nn.Linear`` holding a copy of ``layer``'s weight and bias."""
    weight = layer.weight
    copy = torch.nn.utils.skip_init(
        nn.Linear, weight.shape[1], weight.shape[0], layer.bias is not None, dtype=weight.dtype
    )
    copy.load_state_dict(layer.state_dict())
    return copy


def _packed_forward(packed: torch.Tensor | Int8Weight | Panels, bias: torch.Tensor | None, layer: nn.Linear):
    if isinstance(packed, Int8Weight):
        return int8_forward(packed, bias, functools.partial(type(layer).forward, layer))
    if isinstance(packed, Panels):
        wider = packed.wider
        own = functools.partial(type(layer).forward, layer) if wider is None else _packed_forward(wider, bias, layer)
        return panel_forward(packed, bias, own)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


def _faster_packed(
    layer: nn.Linear, packed: torch.Tensor | Int8Weight | Panels, rows: int = TIMED_ROWS, streamed: bool = False
) -> bool:
    """Whether ``rows`` rows through ``layer`` are faster packed (timed once per shape and dtype on this machine
    (:func:`_faster`; ``streamed``: its model's weights outgrow the caches), remembered): ``TIMED_ROWS`` for a pass, 1
    for a one-token step, :data:`PREFILL_ROWS` for a prefill."""
    weight = layer.weight

    def again(copied: torch.Tensor) -> torch.Tensor | Int8Weight | Panels:  # (``packed``'s form, of a copy's weight)
        if isinstance(packed, Panels):
            return panels(copied)._replace(wider=None if packed.wider is None else _pack(copied))
        return packed if isinstance(packed, Int8Weight) else _pack(copied)

    kind = [type(weight).__name__] if is_quantized(weight) else ["panels"] if isinstance(packed, Panels) else []
    kind += ["streamed"] if streamed else []
    key = store.key(
        weight.device, "packed linear", tuple(weight.shape), weight.dtype, layer.bias is not None, rows, *kind
    )
    return store.shared().get(key, lambda: _faster(layer, rows, None, again, streamed))


def _limited(layer: nn.Linear, packed: Int8Weight | Panels, streamed: bool) -> Int8Weight | Panels:
    """``packed`` computing up to the most rows of :data:`WIDER_ROWS` that ``layer`` computes faster from its int8
    numbers (or in panels) than as it is (``TIMED_ROWS`` where none; its cost grows with the rows, a matrix product's
    hardly); in bf16 and fp16, every width (a row must round alike in every pass: invariant passes, which time the wide
    ones)."""
    if layer.weight.dtype != torch.float32:
        return packed
    most = TIMED_ROWS
    for rows in WIDER_ROWS:
        if not _faster_packed(layer, packed, rows, streamed):
            break
        most = rows
    return packed._replace(most_rows=most)


def _streamed(model: nn.Module) -> bool:
    """Whether ``model``'s linear weights (int8 numbers aside) outgrow the CPU's caches (:data:`STREAMED` bytes)."""
    weights = {id(m.weight): m.weight for m in model.modules() if _packable(m) and not int8_weight(m.weight)}
    return sum(weight.nbytes for weight in weights.values()) > STREAMED


class PackedLinears:
    """The linear layers of ``model`` that a verification pass or a one-token step computes with prepacked weights
    (packed again where a weight changed since); ``timed=False``: every layer oneDNN packs, for passes and prefills,
    untimed (invariant passes: which layers are packed changes their bits, so it must not follow a timing)."""

    def __init__(self, model: nn.Module, timed: bool = True) -> None:
        # [layer, the weight and bias packed, the weight's state then, the packed forward, (for passes, for steps)]
        self.layers: list[list] = []
        self.timed = timed
        self.streamed = _streamed(model)  # (its passes read their weights from memory, not from the caches)
        spare = spare_bytes(torch.device("cpu"))
        budget = None if spare is None else spare // 8
        packed_by_weight: dict[int, torch.Tensor | None] = {}  # (tied weights: packed once)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for module in model.modules():
            if not _packable(module):
                continue
            weight = module.weight
            if id(weight) not in packed_by_weight:
                copies = 0 if int8_weight(weight) else weight.nbytes  # (int8 numbers are read where they are)
                panel = module if timed and self.streamed else None
                packed = _pack(weight, panel) if budget is None or copies <= budget else None
                if isinstance(packed, Panels) and packed.wider is not None:
                    copies *= 2  # (a pass's rows in panels, a prefill's packed for oneDNN)
                uses = (False,) * 3
                if packed is not None and not timed:
                    uses = (True, False, not isinstance(packed, Int8Weight) or module is head)
                elif packed is not None:
                    timed_at = functools.partial(_faster_packed, module, streamed=self.streamed)
                    uses = (timed_at(packed), timed_at(packed, rows=1))
                    # a prefill's: its products where packed anyway (no copy for prefills alone; int8 numbers: the
                    # model's own; panels: oneDNN's, past the panels' most rows), its LM head over its last token;
                    # timed in the one layer (so wide a product is bound by its sums, not by reading the weight)
                    wider = packed.wider if isinstance(packed, Panels) else packed
                    prefill = (
                        any(uses) and isinstance(wider, torch.Tensor) and _faster_packed(module, wider, PREFILL_ROWS)
                    )
                    uses += (uses[STEP] if module is head else prefill,)
                if uses[0] and isinstance(packed, (Int8Weight, Panels)):
                    packed = _limited(module, packed, self.streamed)
                if any(uses) and budget is not None:
                    budget -= copies
                packed_by_weight[id(weight)] = (packed, uses) if any(uses) else None
            if packed_by_weight[id(weight)] is not None:
                packed, uses = packed_by_weight[id(weight)]
                forward = _packed_forward(packed, module.bias, module)
                self.layers.append([module, weight, module.bias, weight_state(weight), forward, uses])

    @contextlib.contextmanager
    def applied(self, kind: int = PASS) -> Iterator[None]:
        """Within the block, the layers packed for ``kind`` (:data:`PASS`, :data:`STEP` or :data:`PREFILL`) compute
        with their packed weights (packed again where a layer's weight or bias is another tensor now, or its weight
        changed in place)."""
        for entry in self.layers:
            layer, weight, bias, state, forward, uses = entry
            if not uses[kind]:
                continue
            now, bias_now = layer._parameters.get("weight"), layer._parameters.get("bias")  # (not Module.__getattr__)
            if now is not weight or bias_now is not bias or weight_state(now) != state:
                packed = _pack(now, layer if self.timed and self.streamed else None) if now is not None else None
                if isinstance(packed, (Int8Weight, Panels)):
                    packed = _limited(layer, packed, self.streamed)
                forward = None if packed is None else _packed_forward(packed, bias_now, layer)
                entry[1:5] = [now, bias_now, None if now is None else weight_state(now), forward]
            if forward is not None:
                layer.__dict__["forward"] = forward  # (not Module.__setattr__: slow)
        try:
            yield
        finally:
            for entry in self.layers:
                entry[0].__dict__.pop("forward", None)


def packed_for(model: nn.Module, timed: bool = True) -> PackedLinears | None:
    """``model``'s :class:`PackedLinears` (``timed``: see there), built on first use and kept with the model (again
    after its weights' dtype or device changed); ``None`` where no layer is packed (or the model is not on a CPU)."""
    weight = next(model.parameters())
    if weight.device.type != "cpu":
        return None
    setting = (weight.dtype, weight.device, timed)
    profile = profile_of(model)
    if profile.packed is None or profile.packed[0] != setting:
        profile.packed = (setting, PackedLinears(model, timed))
    return profile.packed[1] if profile.packed[1].layers else None
