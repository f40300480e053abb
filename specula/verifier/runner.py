"""A causal LM fed one block of new tokens at a time, with a KV cache that can be rolled back: the verifier's target,
and a small drafter's own model."""

from __future__ import annotations

import abc
import contextlib
import inspect
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from ..machine import store
from ..machine.timing import lower_median, time_pass
from . import static
from .adapters import adapter_layers, per_row
from .attend import DTYPES, attend_kernel, attend_serial
from .cache_layers import (
    PreallocatedHybridLayer,
    PreallocatedLayer,
    RowArena,
    RowPrefill,
    arena_granule,
    row_writes,
)
from .gqa import unrepeated_kv_heads
from .indexer import PerQueryIndexers
from .int8 import int8_matmul
from .invariant import KEY_BLOCK, STEP_WIDTH, NotFlat, chunked_products, invariant_attention, product_rows
from .packed import PASS, PREFILL, STEP, packed_for
from .recurrent import (
    STEP_BY_STEP,
    RecurrentRows,
    Snapshot,
    Stepwise,
    crop_attention,
    has_recurrent_state,
    restore,
    snapshot,
    stop_recording,
)
from .row_exact import is_half_precision, row_exact_for
from .static import ALWAYS, CompiledPasses, StaticLayer, bucket_of, buckets_up_to, compiled_passes, static_layers
from .support import (
    UnsupportedModelError,
    cache_argument,
    check_batchable,
    check_cache_length,
    check_plain_states,
    check_recurrent_rows,
    check_rollback,
    check_split_independent,
    check_standard_cache,
    context_limit,
    describe,
    model_device,
    multi_token_failure,
)
from .threads import thread_choice
from .tree_mask import ancestry_of, block_mask, parents_of, paths_of

# Attention kernels for multi-token passes on a GPU: every backend but cuDNN's. cuDNN builds an execution plan for
# each new (query, key) shape, and a verification pass has a new one every step (the cache grows, the draft length
# varies), which made steps dearer than they need be (docs/hardware.md, GPUs). One-token steps keep torch's own
# choice, as model.generate has it.
_VERIFY_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
REPEATS = 5  # interleaved timings of a bucket's compiled and eager passes, whose ratio decides between them
KERNELS = (attend_kernel, attend_serial, int8_matmul)  # numba's, whose machine code a process loads at a first call


def _untimed() -> tuple[int, int]:
    """What makes a pass no measure of its cost where it changes during the pass: the measurements the store made,
    and the kernels' signatures loaded (each one's first call in a process reads its machine code from disk)."""
    return store.shared().made, sum(len(kernel.signatures) for kernel in KERNELS)


@contextlib.contextmanager
def _as_they_are() -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """An ordinary pass: its logits are used as they are."""
    yield lambda logits: logits


class CachedModel(abc.ABC):
    """A HF causal LM with its own rollback-able KV cache, fed one block of new tokens a row at a time: the one
    interface of the loop's target and of a draft model, whatever the cache's shape. Two shapes implement it:
    :class:`OneSequence`, one request held alone as ``model.generate`` holds it, and :class:`RaggedRows`, a batch whose
    rows keep their own lengths (also one row whose blocks are trees of drafts, or passes compiled at static shapes).

    The cache is transformers' ``DynamicCache`` built from the model's config, exactly as ``model.generate`` builds
    it, with past recording switched on: sliding-window layers (Gemma-3, Mistral ...) then keep the states a rollback
    needs until the rollback trims them back to the window, so speculation works past the window too. Its plain
    full-attention layers are replaced by :class:`PreallocatedLayer` (other layer kinds are kept as they are).

    Args:
        model: the target model.
        rollback: whether the caller will roll the cache back; a model whose cache cannot be rolled back is then
            refused after the prefill instead of silently producing wrong tokens.
        capacity: how many tokens a row is expected to hold (prompt + new tokens); it grows past it if needed.
        row_exact: compute every position of a pass over several tokens after a filled cache bit for bit as a
            one-token step computes it (:class:`specula.verifier.row_exact.RowExact`).
        cheap_steps: one-token steps after a filled cache are computed the cheapest way on this machine, as
            ordinary passes are (attention: :mod:`specula.verifier.gqa`, weights: :mod:`specula.verifier.packed`),
            and prompts' prefills with the weights packed where that is faster, not as ``model.generate``'s: for
            ordinary verification, whose output need not have its bits.
        invariant: ordinary passes and one-token steps after a filled cache round every row alike whatever the
            pass's width and batch mates (:mod:`specula.verifier.invariant`; with ``cheap_steps``).
        any_threads: with ``invariant``, they round alike on any thread count too (checked:
            :func:`specula.verifier.invariant.any_threads`), so their thread count follows the load
            (:mod:`specula.verifier.threads`), as fp32 passes' does.
    """

    slots = 1  # requests held at once
    batch = 1  # rows in use
    takes_trees = False  # whether a row's block may be a tree of drafts

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        rollback: bool,
        capacity: int = 256,
        row_exact: bool = False,
        cheap_steps: bool = False,
        invariant: bool = False,
        any_threads: bool = False,
    ) -> None:
        check_standard_cache(model)
        if invariant:  # (attention then reads its padded keys from the buffers as they are: no copy)
            capacity = -(-capacity // KEY_BLOCK) * KEY_BLOCK
        self.model, self.capacity, self.can_roll_back = model, capacity, rollback
        self.stepwise: Stepwise | None = None  # recurrent layers computed one token at a time (else fed again)
        self.cache = self._new_cache()
        self.recurrent = rollback and has_recurrent_state(self.cache)
        if self.recurrent and (row_exact or model.config.model_type in STEP_BY_STEP):
            self.stepwise = Stepwise(model, self.cache)
            if not self.stepwise.covers(self.cache):
                raise UnsupportedModelError(
                    f"{describe(model)} keeps recurrent state in layers specula cannot compute one token at a time, "
                    "which row-exact verification (bf16/fp16) needs. Decode it in float32 for model.generate's exact "
                    "output, or pass exact=False (--no-exact) to verify the ordinary way (greedy output may "
                    "then leave model.generate's after a near-tie)."
                )
        # sparse attention: the keys of each query picked as its one-token step picks them
        self.indexers = PerQueryIndexers(model) if rollback and PerQueryIndexers.needed(self.cache) else None
        check_plain_states(model)
        if rollback:
            check_split_independent(model, self.cache, self.indexers)
        self.forward_parameters = inspect.signature(model.forward).parameters
        self.cache_argument = cache_argument(model, self.forward_parameters)
        self.device = model_device(model)
        self.accepts_logits_to_keep = "logits_to_keep" in self.forward_parameters
        self.cached_tokens = 0  # (a batch: its longest row's)
        self.row_exact = row_exact_for(model) if row_exact else None
        self.invariant = invariant and not row_exact and not self.recurrent
        # (verification passes with prepacked weights; invariant: wherever oneDNN packs, untimed)
        self.packed = None if row_exact else packed_for(model, timed=not self.invariant)
        self.unrepeated = model.config._attn_implementation == "sdpa" and self.device.type == "cpu"
        self.cheap_steps = cheap_steps and self.device.type == "cpu" and not row_exact
        # ordinary passes with the thread count measured faster: in fp32, and in bf16/fp16 invariant passes checked to
        # round alike on any thread count (elsewhere their rounding, which the thread count may change, must not
        # follow the clock)
        free = not is_half_precision(model) or (self.invariant and any_threads)
        self.threads = thread_choice(model) if free and not row_exact else None
        # (prefills too in fp32; in bf16/fp16 a prefill's products round otherwise on one thread: docs/hardware.md)
        self.prefill_threads = self.threads if not is_half_precision(model) else None
        # (invariant: the most rows a linear layer's product may take at once, a wider pass's computed in chunks)
        self.product_rows = product_rows(model, self._products, self.packed is not None) if self.invariant else None
        self.compiled: CompiledPasses | None = None
        self.adapter_layers = adapter_layers(model)  # (LoRA layers: an adapter a row, specula.verifier.adapters)
        self._block_lengths: list[int] = []
        self._made = (0, 0)  # what made passes untimed before the last pass (_untimed; see timed)

    def _new_cache(self) -> DynamicCache:
        """An empty cache as ``model.generate`` builds it, its full-attention layers preallocated, recording the past
        where rollbacks will be asked for."""
        cache = DynamicCache(config=self.model.config.get_text_config(decoder=True))
        cache.layers = [
            PreallocatedLayer(self.capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
        ]
        if self.can_roll_back:
            cache.activate_past_recording()
            stop_recording(cache)  # (recurrent layers: put back whole, see rollback)
        return cache

    @abc.abstractmethod
    def start_row(
        self, index: int, token_ids: torch.Tensor, adapter: str | None = None, positions: int = 1
    ) -> torch.Tensor:
        """Make row ``index`` (at most the number of rows in use) a new request whose prompt is ``token_ids`` (1-D):
        its prompt is computed alone, as ``model.generate`` computes it, and its states become that row's cache;
        its passes take the PEFT adapter named ``adapter`` (``None``: the active one; :mod:`.adapters`). Returns
        the logits of its last ``positions`` positions (``[positions, vocab]``)."""

    @abc.abstractmethod
    def truncate_row(self, index: int, length: int) -> None:
        """Row ``index`` forgets all but its first ``length`` tokens."""

    def forward_rows(
        self,
        blocks: list[torch.Tensor],
        num_logits: list[int],
        trees: list[list[int] | None] | None = None,
        argmax_only: bool = False,
    ) -> list[torch.Tensor]:
        """Append ``blocks[b]`` (1-D) to row ``b``'s cache; return each row's logits at the last ``num_logits[b]``
        positions of its block (``[num_logits[b], vocab]``; ``argmax_only``: only their argmax is used, see
        :meth:`specula.verifier.row_exact.RowExact.applied`). ``trees[b]``, where given (:attr:`takes_trees`), makes
        row ``b``'s block a tree: ``trees[b][i]`` is the block index of token ``i``'s parent (``-1`` for the first),
        and each token sees the row's cache and its own ancestors only, at the position of its depth."""
        if (
            self.invariant
            and len(blocks) == 1
            and len(blocks[0]) == 1
            and self.cached_tokens
            and not (trees or [None])[0]
        ):
            # (invariant: a single row's step as a pass over its token twice, the second position dropped)
            blocks, num_logits = [blocks[0].repeat(STEP_WIDTH)], [STEP_WIDTH]
            self._block_lengths, self._made = [STEP_WIDTH], _untimed()
            return [self._pass(blocks, num_logits, trees, argmax_only)[0][:1]]
        self._block_lengths, self._made = [len(block) for block in blocks], _untimed()
        return self._pass(blocks, num_logits, trees, argmax_only)

    @abc.abstractmethod
    def _pass(
        self, blocks: list[torch.Tensor], num_logits: list[int], trees: list[list[int] | None] | None, argmax_only: bool
    ) -> list[torch.Tensor]:
        """:meth:`forward_rows`'s pass."""

    @abc.abstractmethod
    def keep_rows(self, kept: list[int], paths: list[list[int] | None] | None = None) -> None:
        """After :meth:`forward_rows`: row ``b`` keeps the first ``kept[b]`` tokens of its block, or where
        ``paths[b]`` is given (a tree's accepted path: ascending block indices from 0), those tokens, moved into
        place; the rest of its block is forgotten."""

    @abc.abstractmethod
    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows of the batch (in this order): finished requests cost nothing afterwards."""

    @abc.abstractmethod
    def _used(self) -> int:
        """The most tokens a row in use holds."""

    def hold(self, rows: int, tokens: int) -> None:
        """Hold the cache's buffers to ``rows`` rows of ``tokens`` each (a memory budget's; never under what the rows
        in use hold): trimmed to it now, and grown no further than it needs."""
        for layer in self.cache.layers:
            if isinstance(layer, PreallocatedLayer):
                layer.ceiling = (rows, tokens)
        self._fit()

    def _fit(self) -> None:
        """Buffers at most twice as long as the rows in use need (or as the capacity asked for): what a long request
        took is given back once it left its slot."""
        end = max(self._used(), self.capacity)
        for layer in self.cache.layers:
            if isinstance(layer, PreallocatedLayer):
                layer.fit(end)

    @contextlib.contextmanager
    def _ordinary(self, shape: tuple[int, int], offsets: np.ndarray | None = None) -> Iterator[None]:
        """An ordinary pass (``shape``: rows, tokens a row; one of one: a one-token step with ``cheap_steps``):
        prepacked weights, key/value heads not repeated, the thread count measured cheaper (passes over several
        tokens), each where this machine gains by it (``offsets``: a flat pass's rows, :meth:`RaggedRows.flat`)."""
        step = shape == (1, 1)
        rows = shape[0] * shape[1] if offsets is None else int(offsets[-1])  # (the rows of its linear layers' products)
        with (
            self._products(STEP if step else PASS),
            chunked_products(self.model, self.product_rows)
            if self.invariant and rows > self.product_rows
            else contextlib.nullcontext(),
            invariant_attention(offsets)
            if self.invariant
            else unrepeated_kv_heads()
            if self.unrepeated
            else contextlib.nullcontext(),
            self.threads.applied(shape) if self.threads and not step else contextlib.nullcontext(),
        ):
            yield

    def _products(self, kind: int = PASS) -> contextlib.AbstractContextManager:
        """The linear layers as a pass (:data:`PASS`), a one-token step or a prefill computes them."""
        return self.packed.applied(kind) if self.packed else contextlib.nullcontext()

    @contextlib.contextmanager
    def _prefilling(self, tokens: int) -> Iterator[None]:
        """A prompt's prefill of ``tokens`` tokens: with weights packed where that is faster, in ordinary decoding
        (``cheap_steps``); in fp32 with the thread count the load calls for (:mod:`.threads`; a prefill's shape has
        no rows, so that its times are not a pass's)."""
        with (
            self._products(PREFILL) if self.cheap_steps else contextlib.nullcontext(),
            self.prefill_threads.applied((0, tokens)) if self.prefill_threads else contextlib.nullcontext(),
        ):
            yield

    @property
    def compiling(self) -> bool:
        """Whether the last pass compiled its shape's code (so that its time is no measure of what a pass costs)."""
        return self.compiled is not None and self.compiled.compiling

    @property
    def timed(self) -> bool:
        """Whether the last pass (:meth:`forward_rows`, and its :meth:`keep_rows` so far) ran as passes of its shape
        run, so that its time measures what one costs: not where it calibrated kernels (made a measurement for the
        store: row-exact groupings, packed weights, attention), compiled its shape's code or loaded a kernel's."""
        return _untimed() == self._made and not self.compiling

    @property
    def feeds_again(self) -> bool:
        """Whether a rollback may feed tokens again (recurrent state not computed step by step): a second pass."""
        return self.recurrent and self.stepwise is None

    def flat_rows(self) -> bool:
        """Whether passes over the rows in use run flat where their blocks differ in length (:meth:`flat`)."""
        return False

    def flat(self, blocks: list[torch.Tensor], trees: list[list[int] | None] | None) -> bool:
        """Whether a pass over these blocks computes each row's tokens only, unpadded (one row of queries)."""
        return False


class OneSequence(CachedModel):
    """One request held alone, as ``model.generate`` holds it: fed one block at a time, rolled back by cropping
    (recurrent state: stepped token by token where it must be, else undone and its kept tokens fed again).

    Args (``options``: :class:`CachedModel`'s):
        positions: ``[1, capacity]`` position id of every sequence slot (prompt slots follow its attention mask);
            ``None`` lets the model number the tokens 0, 1, 2, ...
        attention_mask: ``[1, capacity]`` mask of every slot, or ``None`` when the prompt has no padding.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **options,
    ) -> None:
        super().__init__(model, **options)
        self.positions = positions if "position_ids" in self.forward_parameters else None
        self.attention_mask = attention_mask
        self._undo: tuple[Snapshot, torch.Tensor] | None = (
            None  # recurrent: the states before the last pass, its tokens
        )
        self.adapter: str | None = None  # the request's PEFT adapter (None: the active one)

    def start_row(
        self, index: int, token_ids: torch.Tensor, adapter: str | None = None, positions: int = 1
    ) -> torch.Tensor:
        """:meth:`forward` on an emptied cache (``index``: 0)."""
        self.adapter = adapter
        if self.recurrent:  # (a recurrent state cannot be rolled back to nothing: a new one)
            self.cache, self.cached_tokens, self._undo = self._new_cache(), 0, None
        else:
            self.rollback(self.cached_tokens)
        return self.forward(token_ids, positions)

    def truncate_row(self, index: int, length: int) -> None:
        self.rollback(self.cached_tokens - length)

    def forward(self, token_ids: torch.Tensor, num_logits: int, argmax_only: bool = False) -> torch.Tensor:
        """Append ``token_ids`` (1-D) to the cache; return the logits of its last ``num_logits`` positions
        (``argmax_only``: only their argmax is used, see :meth:`specula.verifier.row_exact.RowExact.applied`).

        Checks what the loop relies on, and raises :class:`UnsupportedModelError` naming the model otherwise: the
        cache holds exactly the tokens fed (a model that ignores the cache or adds tokens of its own is refused), a
        pass over several tokens after a filled cache works, and (with ``rollback``) the cache can be rolled back.
        """
        start, end = self.cached_tokens, self.cached_tokens + token_ids.shape[0]
        inputs = {"input_ids": token_ids[None], self.cache_argument: self.cache, "use_cache": True}
        if self.positions is not None:
            inputs["position_ids"] = self.positions[:, start:end]
            if inputs["position_ids"].shape[1] < end - start:  # (an invariant step past the last position kept)
                inputs["position_ids"] = self.positions[:, start : start + 1] + torch.arange(
                    end - start, device=self.device
                )
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask[:, :end]
            if inputs["attention_mask"].shape[1] < end:
                inputs["attention_mask"] = torch.nn.functional.pad(
                    inputs["attention_mask"], (0, end - self.attention_mask.shape[1]), value=1
                )
        if self.accepts_logits_to_keep:
            inputs["logits_to_keep"] = num_logits
        verifies = start > 0 and token_ids.shape[0] > 1  # (a pass over several tokens after a filled cache)
        if self.stepwise is not None:
            self.stepwise.forget()
        elif self.recurrent and start > 0:
            self._undo = (snapshot(self.cache), token_ids) if token_ids.shape[0] > 1 else None
        multi_token_on_gpu = token_ids.shape[0] > 1 and token_ids.device.type == "cuda"
        exact = self.row_exact is not None and verifies
        step = start > 0 and token_ids.shape[0] == 1 and self.cheap_steps
        try:
            with (
                sdpa_kernel(_VERIFY_BACKENDS) if multi_token_on_gpu and not exact else contextlib.nullcontext(),
                self.row_exact.applied(self.cache, argmax_only=argmax_only) if exact else _as_they_are() as finish,
                self._ordinary((1, len(token_ids))) if (verifies and not exact) or step else contextlib.nullcontext(),
                self.stepwise.applied(self.cache) if self.stepwise and verifies else contextlib.nullcontext(),
                self.indexers.applied() if self.indexers and verifies else contextlib.nullcontext(),
                per_row(self.adapter_layers, [self.adapter]),
                self._prefilling(len(token_ids)) if start == 0 else contextlib.nullcontext(),
            ):
                logits = finish(self.model(**inputs).logits)[0, -num_logits:]
        except Exception as error:
            if start == 0 or token_ids.shape[0] == 1 or isinstance(error, torch.OutOfMemoryError):
                raise
            raise multi_token_failure(self.model, token_ids.shape[0], error) from error
        self.cached_tokens = end
        check_cache_length(self.model, self.cache, self.cached_tokens, "a forward pass")
        if start == 0 and self.can_roll_back:
            check_rollback(self.model, self.cache, stepwise=self.stepwise is not None)
        return logits

    def _pass(
        self, blocks: list[torch.Tensor], num_logits: list[int], trees: list[list[int] | None] | None, argmax_only: bool
    ) -> list[torch.Tensor]:
        return [self.forward(blocks[0], num_logits[0], argmax_only)]

    def keep_rows(self, kept: list[int], paths: list[list[int] | None] | None = None) -> None:
        self.rollback(self._block_lengths[0] - kept[0])

    def select_rows(self, rows: list[int]) -> None:
        """Nothing: the one row leaves only when decoding ends."""

    def _used(self) -> int:
        return self.cached_tokens

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` cached tokens. Always called after a forward pass, even with 0, because
        that is when sliding-window layers drop the states past recording kept for a possible rollback. Recurrent
        state is rolled back only within the last pass: to the state after the last token kept, which a step-by-step
        pass kept, or else to the state before the pass, the tokens kept fed again."""
        if self.stepwise is not None and num_tokens:
            self.stepwise.put_back(self.cache, self._pass_length(num_tokens) - num_tokens)
        elif self.recurrent and num_tokens:
            self._undo_last_pass(num_tokens)
            return
        if self.can_roll_back and self.cached_tokens:  # (an empty sliding-window cache cannot be cropped)
            crop_attention(self.cache, num_tokens) if self.recurrent else self.cache.crop(-num_tokens)
        self.cached_tokens -= num_tokens
        if num_tokens:
            check_cache_length(self.model, self.cache, self.cached_tokens, "a rollback")

    def _pass_length(self, num_tokens: int) -> int:
        """Recurrent state: how many tokens the last pass fed, which a rollback of ``num_tokens`` must not exceed."""
        fed = len(self._undo[1]) if self._undo is not None else self.stepwise.tokens() if self.stepwise else 0
        if num_tokens > fed:
            raise UnsupportedModelError(
                f"{describe(self.model)} keeps recurrent state, which specula rolls back only within the last pass "
                f"(here {num_tokens} tokens back); use it as the target, one request at a time."
            )
        return fed

    def _undo_last_pass(self, num_tokens: int) -> None:
        """Recurrent state: undo the last pass, then feed its first tokens again, all but the last ``num_tokens``."""
        self._pass_length(num_tokens)
        kept, fed = self._undo
        crop_attention(self.cache, len(fed))
        restore(self.cache, kept)
        self.cached_tokens -= len(fed)
        if len(fed) > num_tokens:
            self.forward(fed[: len(fed) - num_tokens], 1)
        self._undo = None


class RaggedRows(CachedModel):
    """Requests held as rows of one batch, each keeping its own length (``starts``): each prompt is prefilled alone
    (:meth:`start_row`), and the verifier passes the model its own 4D attention mask and position ids, so that rows
    accepting different numbers of tokens stay exact, and a row's block may be a tree of drafts. Sliding-window
    layers keep every state too; the mask hides what is past their window.

    Args (``options``: :class:`CachedModel`'s):
        slots: how many requests it holds at once (one: a request whose blocks are trees, or compiled passes).
        compiled: passes after a prompt's prefill have static shapes (rows and tokens a row padded to ``max_width``'s
            and ``slots``' buckets, attention over the whole cache) and run compiled (:mod:`specula.verifier.static`):
            ``"always"``, or ``"where cheaper"`` (in each bucket where a compiled pass measured cheaper than an eager
            one; kept); ordinary verification. Models whose cache layers are not all attention (recurrent state) are
            refused with :class:`UnsupportedModelError`.
        max_width: the most tokens a row of a compiled pass holds (its last token and the longest draft).
    """

    takes_trees = True  # (recurrent layers: stepped, each token from its parent's state)

    def __init__(
        self, model: torch.nn.Module, *, slots: int = 1, compiled: str | None = None, max_width: int = 65, **options
    ) -> None:
        super().__init__(model, **options)
        self.slots, self.batch = slots, 0
        self.rows_state: RecurrentRows | None = None  # a batch's recurrent states
        self.adapters: list[str | None] = [None] * slots  # each row's PEFT adapter (None: the active one)
        for i, layer in enumerate(self.cache.layers):
            if type(layer) is DynamicSlidingWindowLayer:
                self.cache.layers[i] = PreallocatedLayer(self.capacity)
                self.cache.layers[i].sliding_window = layer.sliding_window
            elif type(layer) is LinearAttentionAndFullAttentionLayer:
                self.cache.layers[i] = PreallocatedHybridLayer(self.capacity, layer.number_of_states)
        windows = {layer.sliding_window for layer in self.cache.layers if isinstance(layer, PreallocatedLayer)}
        self.window = max(windows - {None}, default=None)  # (the cache gives every sliding layer the config's)
        self.mixed = len(windows) > 1  # full-attention and sliding-window layers: a mask for each (by layer type)
        self.attends = bool(windows)  # (a model of recurrent layers only takes no mask, no positions)
        other = sorted(
            {
                type(layer).__name__
                for layer in self.cache.layers
                if type(layer) not in (PreallocatedLayer, PreallocatedHybridLayer, LinearAttentionLayer, DummyLayer)
            }
        )
        check_batchable(model, other, self.forward_parameters, self.attends)
        if has_recurrent_state(self.cache):
            self.stepwise = self.stepwise or Stepwise(model, self.cache)
            check_recurrent_rows(model, self.stepwise.rows_of(self.cache))
            self.rows_state = RecurrentRows(self.cache, self.slots)
        self.attention = model.config._attn_implementation
        self.starts = torch.zeros(self.slots, dtype=torch.long, device=self.device)  # [slots]: each row's tokens
        self.dtype = next(model.parameters()).dtype
        if compiled:
            self._begin_static(self.capacity, max_width, compiled)
        arena = slots > 1 and self.rows_state is None and (not compiled or self.device.type in static.ON_ARENA)
        self.arena = self._arena() if arena else None
        self.flat_passes = (  # (see flat)
            self.invariant
            and self.device.type == "cpu"
            and self.dtype in DTYPES
            and self.attention == "sdpa"
            and self.window is None
            and self.attends
            and self.compiled is None
            and self.indexers is None
            and self.arena is None
            and not other
        )

    def _arena(self) -> RowArena | None:
        """One buffer for the full-attention layers' rows where the device takes memory chunk by chunk
        (:class:`RowArena`), as long as the model's positions go (a row only holds what it wrote)."""
        layers = [layer for layer in self.cache.layers if type(layer) in (PreallocatedLayer, StaticLayer)]
        if not layers or arena_granule(self.device) is None:
            return None
        arena = RowArena(len(layers), self.slots, max(self.capacity, context_limit(self.model) or 0))
        for index, layer in enumerate(layers):
            layer.arena = (arena, index)
        return arena

    def _begin_static(self, capacity: int, max_width: int, how: str) -> None:
        """Passes of static shapes, compiled: the rows' buffers :class:`~specula.verifier.static.StaticLayer` (of a
        capacity rounded up to a power of two, so that few capacities, each a shape of its own, ever occur)."""
        if (
            self.row_exact is not None
            or self.rows_state is not None
            or self.indexers is not None
            or not static_layers(self.cache, 1 << (capacity - 1).bit_length())
        ):
            raise UnsupportedModelError(
                f"{describe(self.model)} cannot run compiled passes: specula compiles models whose cache layers all "
                "hold attention, with ordinary verification (not exact=True); pass compile=False (--no-compile)."
            )
        self.row_buckets, self.width_buckets = buckets_up_to(self.slots), buckets_up_to(max_width)
        self.compiled = compiled_passes(self.model, self.cache_argument, self.device)
        self.compile_always = how == ALWAYS

    def start_row(
        self, index: int, token_ids: torch.Tensor, adapter: str | None = None, positions: int = 1
    ) -> torch.Tensor:
        self.adapters[index] = adapter
        if self.arena is not None:  # (what the request before it in this slot wrote)
            self.arena.release(index)
        alone = DynamicCache(config=self.model.config.get_text_config(decoder=True))
        alone.layers = [  # (full attention written straight into the row; other layers copied after)
            RowPrefill(layer, index, self.slots)
            if type(computed) is DynamicLayer and isinstance(layer, PreallocatedLayer)
            else computed
            for layer, computed in zip(self.cache.layers, alone.layers)
        ]
        inputs = {"input_ids": token_ids[None], self.cache_argument: alone, "use_cache": True}
        if self.accepts_logits_to_keep:
            inputs["logits_to_keep"] = positions
        with per_row(self.adapter_layers, [adapter]), self._prefilling(len(token_ids)):
            logits = self.model(**inputs).logits[0, -positions:]
        for layer, computed in zip(self.cache.layers, alone.layers):
            if isinstance(layer, PreallocatedLayer) and not isinstance(computed, RowPrefill):
                layer.put_row(index, computed.keys, computed.values, self.slots, len(token_ids))
        if self.rows_state is not None:
            self.rows_state.put_row(index, alone)
        self.starts[index] = len(token_ids)
        self.batch = max(self.batch, index + 1)
        self._set_rows()
        self._fit()
        return logits

    def truncate_row(self, index: int, length: int) -> None:
        self.starts[index] = length
        if index < self.batch:
            self._set_rows()

    def copy_prefix(self, source: int, index: int, length: int) -> None:
        """Make row ``index`` hold the first ``length`` tokens of row ``source`` (their states do not depend on
        later tokens)."""
        if self.rows_state is not None:
            raise UnsupportedModelError(
                f"{describe(self.model)} keeps recurrent state, which holds no prefix of a row."
            )
        if self.arena is not None:
            self.arena.copy(source, index, length)
        for layer in self.cache.layers:
            if isinstance(layer, PreallocatedLayer):
                layer.copy_row(source, index, length)
        self.starts[index], self.adapters[index] = length, self.adapters[source]
        self.batch = max(self.batch, index + 1)
        self._set_rows()

    def _set_rows(self) -> None:
        """Tell the cache layers which rows are in use and where each writes next."""
        starts = self.starts[: self.batch]
        self.cached_tokens = int(starts.max())
        for layer in self.cache.layers:
            if isinstance(layer, PreallocatedLayer):
                layer.rows, layer.row_starts, layer.length = self.batch, starts, self.cached_tokens
                layer._expose()
        if self.rows_state is not None:
            self.rows_state.expose(self.batch)

    def _pass(
        self, blocks: list[torch.Tensor], num_logits: list[int], trees: list[list[int] | None] | None, argmax_only: bool
    ) -> list[torch.Tensor]:
        named = any(self.adapters[: self.batch])  # (adapters chosen per row: eager passes)
        if self.compiled is not None and not named and self._compiled_pays(blocks, num_logits, trees):
            return self._forward_static(blocks, num_logits, trees)
        if self.flat(blocks, trees):
            try:
                return self._forward_flat(blocks, num_logits)
            except NotFlat:  # (a layer's attention is not the kernel's: padded from now on, this pass again)
                self.flat_passes = False
        return self._forward_eager(blocks, num_logits, trees, argmax_only)

    def flat_rows(self) -> bool:
        return self.flat_passes and not any(self.adapters[: self.batch])

    def flat(self, blocks: list[torch.Tensor], trees: list[list[int] | None] | None) -> bool:
        """A pass over these blocks runs flat: its rows' tokens one after another, unpadded, so that it
        computes the tokens it verifies and no more (a row's drafts do not make the others wider). Invariant
        passes on a CPU attend with specula's kernel, which takes each row's tokens where they are
        (:mod:`.attend`); so blocks of different lengths, chains, no adapter named, every layer full attention."""
        return (
            self.flat_rows()
            and len(blocks) > 1
            and len({len(block) for block in blocks}) > 1
            and not any(tree is not None for tree in trees or [])
        )

    def _forward_flat(self, blocks: list[torch.Tensor], num_logits: list[int]) -> list[torch.Tensor]:
        """:meth:`forward_rows` as a flat pass (:meth:`flat`): one row of ``T`` queries, the rows' blocks in turn."""
        lengths = self._block_lengths
        starts = self.starts[: self.batch]
        offsets = np.cumsum([0, *lengths])  # [B + 1]: where each row's tokens start
        counts = torch.tensor(lengths, device=self.device)
        owner = torch.repeat_interleave(torch.arange(len(blocks), device=self.device), counts)  # [T]: its row
        within = torch.arange(int(offsets[-1]), device=self.device) - torch.as_tensor(offsets[:-1])[owner]  # [T]
        positions = starts[owner] + within  # [T]: each token's position in its row
        end = int(starts.max()) + max(lengths)  # every slot a query may see
        mask = torch.arange(end, device=self.device) <= positions[:, None]  # [T, keys]: its row's up to itself
        wanted = torch.cat([torch.arange(o - k, o) for o, k in zip(offsets[1:].tolist(), num_logits)])  # [kept]
        inputs = {
            "input_ids": torch.cat(blocks)[None],  # [1, T]
            self.cache_argument: self.cache,
            "use_cache": True,
            "attention_mask": mask[None, None],  # [1, 1, T, keys]
            "position_ids": positions[None],  # [1, T]
        }
        if self.accepts_logits_to_keep:
            inputs["logits_to_keep"] = wanted
        with self._ordinary((len(blocks), max(lengths)), offsets), self._writing((end, owner[None], positions[None])):
            logits = self.model(**inputs).logits[0]  # [kept or T, vocab]
        if not self.accepts_logits_to_keep:
            logits = logits[wanted]
        self.cached_tokens = end
        check_cache_length(self.model, self.cache, self.cached_tokens, "a forward pass")
        return list(logits.split(num_logits))

    def _forward_eager(
        self, blocks: list[torch.Tensor], num_logits: list[int], trees: list[list[int] | None] | None, argmax_only: bool
    ) -> list[torch.Tensor]:
        """:meth:`forward_rows`, each row's block padded to the longest only."""
        lengths = self._block_lengths
        n = max(lengths)
        starts = self.starts[: self.batch]
        tokens = _padded_blocks(blocks, n)  # [B, n], padded at the end
        ancestry, depth = ancestry_of(trees or [None] * len(blocks), n, self.device)  # [B, n, n]; [B, n]
        positions = starts[:, None] + depth  # [B, n]
        keys = torch.arange(int(starts.max()) + n, device=self.device)  # every slot a query may see
        mask = block_mask(
            starts, keys, ancestry, depth, positions, self.window, self.attention == "eager", self.dtype, self.mixed
        )
        first = [length - wanted for length, wanted in zip(lengths, num_logits)]  # [B]: first position wanted
        keep = n - min(first)
        inputs = {
            "input_ids": tokens,
            self.cache_argument: self.cache,
            "use_cache": True,
            "attention_mask": mask,
            "position_ids": positions,
        }
        if self.accepts_logits_to_keep:
            inputs["logits_to_keep"] = keep
        # a single request's one-token step (a tree proposer sending nothing) is model.generate's own: the model
        # derives its mask (no sliding window to hide: every layer sees the whole row)
        one_token_step = len(blocks) == 1 and n == 1 and self.window is None
        if one_token_step or not self.attends:
            del inputs["attention_mask"]
        if not self.attends:
            del inputs["position_ids"]
        # row-exact: every token as its row's one-token step computes it, whatever the other rows
        exact = _as_they_are()
        if self.row_exact and not one_token_step:
            ends = (positions + 1).tolist()  # [B][n]: the keys each token's one-token step sees
            exact = self.row_exact.applied(self.cache, ends, paths_of(ancestry, trees) if trees else None, argmax_only)
        stepwise = self.stepwise is not None and n > 1
        if self.stepwise is not None:
            self.stepwise.forget()
        parents = parents_of(trees, n) if trees and any(tree is not None for tree in trees) else None  # [B][n]
        # an ordinary pass over several tokens, or an ordinary one-token step
        fast = (not one_token_step and not self.row_exact) or (one_token_step and self.cheap_steps)
        with (
            exact as finish,
            self._ordinary((len(blocks), n)) if fast else contextlib.nullcontext(),
            self.stepwise.applied(self.cache, parents) if stepwise else contextlib.nullcontext(),
            per_row(self.adapter_layers, self.adapters[: self.batch]),
            self._writing(row_writes(starts, n, len(keys))),
        ):
            logits = finish(self.model(**inputs).logits)[:, -keep:]  # [B, keep, vocab]
        self.cached_tokens = len(keys)
        check_cache_length(self.model, self.cache, self.cached_tokens, "a forward pass")
        return [logits[b, first[b] - (n - keep) : lengths[b] - (n - keep)] for b in range(self.batch)]

    @contextlib.contextmanager
    def _writing(self, writes: tuple[int, torch.Tensor, torch.Tensor]) -> Iterator[None]:
        """Within the block, the batch's layers write where ``writes`` says (:func:`row_writes`: made once a pass, not
        once a layer)."""
        layers = [layer for layer in self.cache.layers if isinstance(layer, PreallocatedLayer)]
        for layer in layers:
            layer.row_writes = writes
        try:
            yield
        finally:
            for layer in layers:
                layer.row_writes = None

    def _compiled_pays(
        self, blocks: list[torch.Tensor], num_logits: list[int], trees: list[list[int] | None] | None
    ) -> bool:
        """Whether this pass runs compiled: always, or where its bucket's compiled passes measured cheaper than eager
        ones (timed here on first use, on these very blocks, interleaved; what they wrote past the rows' ends is not
        kept)."""
        if self.compile_always:
            return True
        rows, width = bucket_of(len(blocks), self.row_buckets), bucket_of(max(map(len, blocks)), self.width_buckets)
        capacity = self._make_room(len(blocks), width)

        def compare() -> float:
            static = lambda: self._forward_static(blocks, num_logits, trees)  # noqa: E731
            eager = lambda: self._forward_eager(blocks, num_logits, trees, argmax_only=False)  # noqa: E731
            static(), eager()  # (compiling, and eager kernels' first use)
            ratios = [time_pass(static, self.device) / time_pass(eager, self.device) for _ in range(REPEATS)]
            self._set_rows()
            return lower_median(ratios)

        return self.compiled.pays((rows, width, capacity), compare)

    def _make_room(self, batch: int, width: int) -> int:
        """Room in every row's buffers for a pass ``width`` tokens wide after the longest of ``batch`` rows; the
        capacity then."""
        for layer in self.cache.layers:
            layer._grow(int(self.starts[:batch].max()) + width)
        return self.cache.layers[0].capacity

    def _forward_static(
        self, blocks: list[torch.Tensor], num_logits: list[int], trees: list[list[int] | None] | None
    ) -> list[torch.Tensor]:
        """:meth:`forward_rows` as a compiled pass of the smallest bucket that holds it: ``R`` rows (the batch's, then
        padding rows that start at 0 and write where no row is in use) of ``W`` tokens (a block padded with its
        last token, which no token of the block sees)."""
        batch, lengths = len(blocks), self._block_lengths
        rows, width = bucket_of(batch, self.row_buckets), bucket_of(max(lengths), self.width_buckets)
        starts = torch.zeros(rows, dtype=torch.long, device=self.device)  # [R]
        starts[:batch] = self.starts[:batch]
        tokens = torch.zeros(rows, width, dtype=torch.long, device=self.device)  # [R, W]
        for b, block in enumerate(blocks):
            tokens[b, : len(block)], tokens[b, len(block) :] = block, block[-1]
        capacity = self._make_room(batch, width)
        if self.arena is not None:  # (padding rows too: they write their first tokens)
            self.arena.read(rows, capacity)
            self.arena.room_rows(starts, int(starts.max()) + width, width)
        for layer in self.cache.layers:
            layer.row_starts = starts
        trees = (trees or [None] * batch) + [None] * (rows - batch)
        ancestry, depth = ancestry_of(trees, width, self.device)  # [R, W, W]; [R, W]
        positions = starts[:, None] + depth  # [R, W]
        keys = torch.arange(capacity, device=self.device)  # every slot: what no row wrote yet is masked
        mask = block_mask(
            starts, keys, ancestry, depth, positions, self.window, self.attention == "eager", self.dtype, self.mixed
        )
        for layer in self.cache.layers:
            layer.static = True
        try:
            logits = self.compiled(self.cache, tokens, positions, mask, capacity)  # [R, W, vocab]
        finally:
            for layer in self.cache.layers:
                layer.static = False
        self.cached_tokens = int(starts[:batch].max()) + width
        return [logits[b, length - wanted : length] for b, (length, wanted) in enumerate(zip(lengths, num_logits))]

    def keep_rows(self, kept: list[int], paths: list[list[int] | None] | None = None) -> None:
        for b, path in enumerate(paths or []):
            if path is not None and path != list(range(len(path))):
                start = int(self.starts[b])
                source = start + torch.tensor(path, device=self.device)
                for layer in self.cache.layers:
                    if isinstance(layer, PreallocatedLayer):
                        for buffer in (layer._key_buffer, layer._value_buffer):
                            buffer[b, :, start : start + len(path)] = buffer[b, :, source]
        if self.stepwise is not None and self.stepwise.tokens():  # (a tree's path: the state after its last token)
            self.stepwise.put_back(
                self.cache, [path[-1] + 1 if path else k for path, k in zip(paths or [None] * len(kept), kept)]
            )
        self.starts[: self.batch] += torch.tensor(kept, device=self.device)
        self._set_rows()

    def select_rows(self, rows: list[int]) -> None:
        if rows == list(range(self.batch)):
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.arena is not None:
            self.arena.select(rows, self.starts[: self.batch].tolist())
        for layer in self.cache.layers:
            if isinstance(layer, PreallocatedLayer):
                layer.select_rows(index)  # (before the starts move: the layers read the rows' lengths from them)
        self.starts[: len(rows)] = self.starts[index]
        self.adapters[: len(rows)] = [self.adapters[row] for row in rows]
        if self.rows_state is not None:
            self.rows_state.select_rows(index)
        self.batch = len(rows)
        if rows:
            self._set_rows()
        self._fit()

    def _used(self) -> int:
        return int(self.starts[: self.batch].max()) if self.batch else 0


def cached_model(
    model: torch.nn.Module,
    *,
    slots: int = 1,
    trees: bool = False,
    compiled: str | None = None,
    max_width: int = 65,
    positions: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **options,
) -> CachedModel:
    """The cache shape for ``slots`` requests at once: :class:`RaggedRows` where there are several, where a row's
    blocks may be ``trees`` or where passes run ``compiled``; else :class:`OneSequence` (``positions`` and
    ``attention_mask`` are its). ``options``: :class:`CachedModel`'s."""
    if slots > 1 or trees or compiled:
        return RaggedRows(model, slots=slots, compiled=compiled, max_width=max_width, **options)
    return OneSequence(model, positions=positions, attention_mask=attention_mask, **options)


def _padded_blocks(blocks: list[torch.Tensor], n: int) -> torch.Tensor:
    """``[B, n]``: each block padded at the end with its last token."""
    if all(len(block) == n for block in blocks):
        return torch.stack(blocks)
    return torch.stack([torch.cat([b, b[-1:].expand(n - len(b))]) for b in blocks])
