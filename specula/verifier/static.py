"""Passes of static shapes, for compiled code: a cache written by position into buffers of a fixed size, passes
padded to a few (rows, width) buckets, and the compiled function that serves each bucket.

A compiled graph is specialised to its input shapes, so a pass of any other shape would compile again. Here every
pass of a batch of ``r`` rows over at most ``w`` tokens a row is padded to the smallest bucket ``(R, W)`` that holds
it (:func:`bucket_of`), attends over the whole buffer (its mask hides what no row wrote yet, and what a rejected draft
wrote: a rollback moves a row's start only), and writes its keys and values at each row's own start: the pass has
the same shapes whatever the rows hold, and a handful of graphs serve every pass (one request, ragged batches, trees,
predictions, sampling). On a GPU the graphs are captured as CUDA graphs (``mode="reduce-overhead"``), which removes
the host's work of launching each kernel; on a CPU, inductor's fused kernels. Compiled code is kept on disk by
inductor's own caches, so a later process compiles the same bucket from them.
"""

from __future__ import annotations

import bisect
import inspect
import sys
import time
import weakref
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from ..machine import store
from ..machine.timing import CLOCK, lower_median
from .cache_layers import PreallocatedLayer
from .support import cache_argument, model_device


def buckets_up_to(limit: int) -> tuple[int, ...]:
    """The bucket sizes for passes of 1 to ``limit`` (rows, or tokens a row): powers of two below it, and itself.

    >>> buckets_up_to(65), buckets_up_to(8), buckets_up_to(1)
    ((1, 2, 4, 8, 16, 32, 64, 65), (1, 2, 4, 8), (1,))
    """
    sizes = [1 << i for i in range(limit.bit_length()) if 1 << i < limit]
    return tuple(sizes + [limit])


def bucket_of(size: int, sizes: tuple[int, ...]) -> int:
    """The smallest of ``sizes`` (ascending) that holds ``size``.

    >>> bucket_of(5, (1, 2, 4, 8)), bucket_of(4, (1, 2, 4, 8))
    (8, 4)
    """
    if size > sizes[-1]:
        raise ValueError(f"a pass of {size} exceeds the largest bucket, {sizes[-1]}")
    return sizes[bisect.bisect_left(sizes, size)]


class StaticLayer(PreallocatedLayer):
    """A full-attention cache layer of a batch, with static shapes while ``static``: a pass writes each row's block
    at that row's start (``row_starts``, ``[R]``: the pass's rows, padding rows included) and attends over the whole
    buffer of its ``R`` rows (``[R, heads, capacity, dim]``), so that neither depends on what the rows hold. The
    buffers grow (doubling) only between passes, and a pass reads no number from the host. Otherwise (an eager
    pass) a :class:`PreallocatedLayer`."""

    static = False
    follows_rows = False
    bucketed = True
    whole_pages = False  # (capacities stay powers of two: each is a compiled shape)

    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor, slots: int | None = None
    ) -> None:
        super().lazy_initialization(key_states, value_states, slots)
        self._mark_static()

    def _mark_static(self) -> None:
        # the buffers keep their address from pass to pass: CUDA graphs write them in place instead of copying them
        for buffer in (self.arena[0].pages.tensor,) if self.arena else (self._key_buffer, self._value_buffer):
            torch._dynamo.mark_static_address(buffer)

    def _grow(self, end: int) -> None:
        # (between passes only: a new capacity is a new shape, whose passes compile again; powers of two keep them few)
        if end > self.capacity:
            super()._grow(1 << (end - 1).bit_length())
            self._mark_static()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [R, heads, W, dim]; row_starts: [R]
        if not self.static:
            return super().update(key_states, value_states, *args, **kwargs)
        rows, width = key_states.shape[0], key_states.shape[-2]
        slots = self.row_starts[:, None] + torch.arange(width, device=key_states.device)  # [R, W]
        index = torch.arange(rows, device=key_states.device)[:, None]  # [R, 1]
        if self.arena:  # (one input for every layer; its views made within the pass, written by put_states)
            arena, layer = self.arena
            states = torch.stack([key_states, value_states], dim=2).transpose(1, 3)  # [R, W, 2, heads, dim]
            put_states(arena.pages.tensor, index.expand(rows, width), slots, layer, states)
            states = arena.pages.tensor[:rows, : self.capacity, layer]  # [R, capacity, 2, heads, dim]
            return states[:, :, 0].transpose(1, 2), states[:, :, 1].transpose(1, 2)
        self._key_buffer[index, :, slots] = key_states.transpose(1, 2)  # [R, W, heads, dim]
        self._value_buffer[index, :, slots] = value_states.transpose(1, 2)
        return self._key_buffer[:rows], self._value_buffer[:rows]


@torch.library.custom_op("specula::put_states", mutates_args=("arena",))
def put_states(arena: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, layer: int, states: torch.Tensor) -> None:
    """Write ``states`` (``[R, W, 2, heads, dim]``, a layer's keys and values) into ``arena`` (a
    :class:`~specula.verifier.cache_layers.RowArena`'s ``[slots, capacity, layers, 2, heads, dim]``) at rows
    ``rows`` and positions ``slots`` (``[R, W]`` each) of ``layer``. An operation of its own, declared to change
    ``arena`` in place: compiled code then writes the arena where it is, where an ``index_put`` into views of it, one
    per layer, made the whole arena an input copied and written back at every pass."""
    kinds = torch.arange(2, device=arena.device)  # [2]: keys, values
    arena[rows[:, :, None], slots[:, :, None], layer, kinds] = states


@put_states.register_fake
def _(arena: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, layer: int, states: torch.Tensor) -> None:
    return None


def static_layers(cache, capacity: int) -> bool:
    """Make every full-attention layer of ``cache`` (a ``DynamicCache`` of preallocated layers) a
    :class:`StaticLayer`; whether that covered every layer (static passes need it: other layers change shape)."""
    for i, layer in enumerate(cache.layers):
        if type(layer) in (PreallocatedLayer, DynamicLayer):
            static = StaticLayer(capacity)
            static.sliding_window = getattr(layer, "sliding_window", None)
            cache.layers[i] = static
    return all(type(layer) is StaticLayer for layer in cache.layers)


BACKEND = "inductor"  # what compiles the passes (tests count graphs with dynamo's "eager", which compiles nothing)
# devices where compiled passes read a batch's RowArena (its buckets views of it, grown without a copy; written in
# place by put_states): none until CUDA graphs over CUDA's virtual memory are measured on a GPU (examples/gpu_check.py
# --parts memory --modes compiled)
ON_ARENA: tuple[str, ...] = ()


# How passes run compiled: in every bucket (compile=True), or in each bucket where a compiled pass measured cheaper
# than an eager one (the default where compiling pays: see compiles)
ALWAYS, WHERE_CHEAPER = "always", "where cheaper"


class CompiledPasses:
    """A model's forward pass compiled once per bucket of (rows, width, capacity): CUDA graphs on a GPU, inductor's
    kernels on a CPU. One per model (:func:`compiled_passes`), shared by every cache of it; says on stderr, once a
    bucket, what compiling it cost. :meth:`pays` says whether a bucket's compiled passes are the cheaper here."""

    def __init__(self, model: torch.nn.Module, cache_argument: str, device: torch.device) -> None:
        self._model = weakref.ref(model)  # (kept by the model's entry in _PASSES: a strong one would keep it forever)
        self.cache_argument, self.device = cache_argument, device
        # one graph per bucket, many buckets: more than dynamo keeps by default for one function
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        # CUDA graphs on a GPU; on a CPU the weights folded into the code (inductor's freezing), so that its linear
        # layers take them prepacked, as eager passes do (specula.verifier.packed)
        settings = (
            {}
            if BACKEND != "inductor"
            else {"mode": "reduce-overhead"}
            if device.type == "cuda"
            else {"options": {"freezing": True}}
        )
        self._compiled = torch.compile(_forward, dynamic=False, fullgraph=True, backend=BACKEND, **settings)
        self.shapes: set[tuple[int, ...]] = set()  # the buckets compiled so far
        self.compile_seconds = 0.0
        self.compiling = False  # whether the last pass compiled its bucket (no measure of what a pass costs)

    def __call__(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask, capacity: int) -> torch.Tensor:
        """The logits (``[R, W, vocab]``) of a pass over ``tokens`` (``[R, W]``) at ``positions`` (``[R, W]``) with
        ``mask`` (``[R, 1, W, capacity]``)."""
        shape = (*tokens.shape, capacity)
        self.compiling = shape not in self.shapes
        started = time.perf_counter()
        logits = self._compiled(self.model, self.cache_argument, cache, tokens, positions, mask)
        if self.compiling:
            self.shapes.add(shape)
            seconds = time.perf_counter() - started
            self.compile_seconds += seconds
            print(
                f"specula: compiled the passes of {shape[0]} row(s) x {shape[1]} token(s) over {shape[2]} cached in "
                f"{seconds:.1f} s",
                file=sys.stderr,
            )
        # (CUDA graphs reuse their output's memory at the next replay: a copy outlives it)
        return logits.clone() if tokens.device.type == "cuda" else logits

    @property
    def model(self) -> torch.nn.Module:
        return self._model()

    def pays(self, shape: tuple[int, int, int], compare: Callable[[], float]) -> bool:
        """Whether compiled passes of the bucket ``shape`` (rows, width, capacity) cost less than eager ones here:
        ``compare()`` (a compiled pass's time over an eager one's) measured once per machine, model and bucket, and
        kept, so that which passes run compiled (which may change their rounding) does not follow the clock."""
        from .exactness import model_key

        weight = self.model.get_input_embeddings().weight
        key = store.key(
            self.device,
            "compiled pass",
            model_key(self.model),
            weight.dtype,
            self.model.config._attn_implementation,
            *shape,
        )
        return store.shared().get(key, lambda: round(compare(), 3)) < 1.0


def _forward(
    model: torch.nn.Module, cache_argument: str, cache, tokens: torch.Tensor, positions: torch.Tensor, mask
) -> torch.Tensor:
    return model(
        input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True, **{cache_argument: cache}
    ).logits


_PASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_passes(model: torch.nn.Module, cache_argument: str, device: torch.device) -> CompiledPasses:
    """The model's :class:`CompiledPasses` (made on first use, dropped with the model)."""
    if model not in _PASSES:
        _PASSES[model] = CompiledPasses(model, cache_argument, device)
    return _PASSES[model]


# Compiled passes are chosen by default where launching a one-token pass's kernels takes the host more than this
# share of the pass's time: the device waits on the host, and CUDA graphs launch the whole pass at once.
HOST_BOUND = 0.5
CONTEXT = 256  # tokens of cache the timed one-token passes follow
REPEATS = 5


def compiles(model: torch.nn.Module, compile: bool | None, exact: bool) -> str | None:
    """How ``model``'s passes run compiled: ``compile=True`` in every bucket (:data:`ALWAYS`; with row-exact
    verification refused: compiled passes verify the ordinary way), ``False`` in none (``None``); by default, where
    a pass is mostly the host's work on this device (:func:`host_bound`) in each bucket where compiled passes
    measure cheaper (:data:`WHERE_CHEAPER`), never under row-exact verification."""
    if compile and exact:
        raise ValueError(
            "compile=True (--compile) runs ordinary verification passes; it cannot be combined with "
            "exact=True (--exact): drop one of them."
        )
    if compile is not None:
        return ALWAYS if compile else None
    return WHERE_CHEAPER if not exact and host_bound(model) else None


def host_bound(model: torch.nn.Module) -> bool:
    """Whether launching a one-token pass of ``model`` takes the host more than :data:`HOST_BOUND` of the pass's
    time on its GPU (measured once per machine and model, kept). On a CPU, where the host computes the pass itself,
    no: compiling there is asked for (``compile=True``)."""
    device, dtype = model_device(model), model.get_input_embeddings().weight.dtype
    if device.type == "cpu":
        return False
    from .exactness import model_key

    key = store.key(device, "host share", model_key(model), dtype, CONTEXT)
    host, wall = store.shared().get(key, lambda: _host_share(model))
    return pays_to_compile(host, wall)


def pays_to_compile(host: float, wall: float) -> bool:
    """Whether passes whose kernels took the host ``host`` seconds to launch, of ``wall`` seconds until the device
    finished them, gain by being launched at once (a CUDA graph).

    >>> pays_to_compile(0.021, 0.025), pays_to_compile(0.005, 0.060)   # a small model on an H100; a large one
    (True, False)
    """
    return host > HOST_BOUND * wall


@torch.no_grad()
def _host_share(model: torch.nn.Module) -> list[float]:
    """The seconds a one-token pass after :data:`CONTEXT` tokens takes to launch, and until its GPU is done: the
    lower medians of :data:`REPEATS`."""
    from transformers import DynamicCache

    device = model_device(model)
    ids = torch.randint(
        3,
        model.get_input_embeddings().weight.shape[0],
        (CONTEXT + REPEATS + 1,),
        generator=torch.Generator().manual_seed(0),
    ).to(device)
    cache = {
        cache_argument(model, inspect.signature(model.forward).parameters): DynamicCache(
            config=model.config.get_text_config(decoder=True)
        )
    }
    model(input_ids=ids[None, :CONTEXT], use_cache=True, **cache)
    host, wall = [], []
    for i in range(CONTEXT, CONTEXT + REPEATS + 1):
        synchronize(device)
        started = CLOCK()
        model(input_ids=ids[None, i : i + 1], use_cache=True, **cache)
        host.append(CLOCK() - started)
        synchronize(device)
        wall.append(CLOCK() - started)
    return [lower_median(host[1:]), lower_median(wall[1:])]


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has done the work queued on it (a CPU computes as it is asked)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
