"""Cache layers that a pass writes into in place and a rollback only moves the end of: full attention, and layers
with both linear and full attention."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from ..machine import vmm
from ..machine.memory import Pages, give_back_freed

PAGED = ("cpu",)  # devices where a buffer's memory is taken page by page as rows write it (machine.memory.Pages)
ARENA = ("cuda",)  # devices where a batch's layers share one buffer taken chunk by chunk (RowArena)


def arena_granule(device: torch.device) -> int | None:
    """The bytes a :class:`RowArena` on ``device`` takes at once (None: no arena there)."""
    if device.type not in ARENA:
        return None
    return Pages.granule if device.type == "cpu" else vmm.granularity(device)


def row_moves(rows: list[int]) -> tuple[list[tuple[int, int]], bool]:
    """The rows that move when a batch keeps ``rows`` (in this order) as (to, from), and whether one moves where
    another moves from (then each is copied before any is written).

    >>> row_moves([0, 3, 2]), row_moves([2, 0])
    (([(1, 3)], False), ([(0, 2), (1, 0)], True))
    """
    moved = [(row, source) for row, source in enumerate(rows) if source != row]
    return moved, bool({source for _, source in moved} & {row for row, _ in moved})


class RowArena:
    """The keys and values of every full-attention layer of a batch in one buffer, each row's tokens together:
    ``[slots, capacity, layers, 2, heads, dim]``, of which each layer reads its keys and values as views
    ``[slots, heads, capacity, dim]``. Its memory is taken as rows write it and given back as rows leave (on a GPU,
    CUDA's virtual memory: :class:`~specula.machine.vmm.DevicePages`), so a row costs its own tokens whatever its
    batch mates hold, to a chunk. With every layer's states of a token together, a chunk holds many tokens: worked
    example, SmolLM2-135M in bf16 (30 layers, 3 key/value heads of 64) keeps 23,040 bytes a token, 91 tokens a 2 MiB
    chunk, where a layer's own buffer would take a 2 MiB chunk per 5,461 tokens of each head.

    A row's memory is managed here once for all layers (:meth:`release`, :meth:`copy`, :meth:`select`); the layers
    only read what :meth:`read` made readable and write where :meth:`room` made room."""

    cpu_pages = Pages  # (the CPU's, where tests put an arena there)

    def __init__(self, layers: int, slots: int, capacity: int) -> None:
        self.layers, self.slots, self.capacity = layers, slots, capacity
        self.pages: Pages | vmm.DevicePages | None = None
        self.members = 0  # layers that hold their states here
        self.mapped = [0] * slots  # tokens of each row that may be written
        self.readable = (0, 0)  # (rows, tokens a row) that may be read
        self.kind: tuple | None = None  # (heads, dim, dtype, device) of the states it holds

    def view(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``index``'s keys and values (``[slots, heads, capacity, dim]``), or None where its states are not of
        the shape, dtype and device of the first layer's (that layer keeps buffers of its own)."""
        _, heads, _, dim = like.shape
        kind = (heads, dim, like.dtype, like.device)
        if self.kind is None:
            self.kind, self.token = kind, self.layers * 2 * heads * dim  # (elements a token of a row)
            granule = arena_granule(like.device)
            step = granule // math.gcd(granule, self.token * like.element_size())  # (a row: whole chunks)
            self.capacity = -(-self.capacity // step) * step
            shape = (self.slots, self.capacity, self.layers, 2, heads, dim)
            try:
                cpu = like.device.type == "cpu"  # (tests: the CPU's pages)
                self.pages = (
                    self.cpu_pages(shape, like.dtype) if cpu else vmm.DevicePages(shape, like.dtype, like.device)
                )
            except RuntimeError as error:  # (the driver refused: each layer keeps buffers of its own)
                warnings.warn(f"specula: the batch's cache is held as rectangles, not paged: {error}", stacklevel=2)
        if kind != self.kind or self.pages is None:
            return None
        self.members += 1
        states = self.pages.tensor[:, :, index]  # [slots, capacity, 2, heads, dim]
        return states[:, :, 0].transpose(1, 2), states[:, :, 1].transpose(1, 2)

    def _span(self, row: int, start: int, end: int) -> tuple[int, int]:
        return (row * self.capacity + start) * self.token, (row * self.capacity + end) * self.token

    def read(self, rows: int, tokens: int) -> None:
        """The first ``tokens`` of the first ``rows`` rows may be read (what attention reads: chunks no row wrote
        read as zeros); the tokens at least doubled, so that a growing batch asks rarely."""
        if self.pages is None or (rows <= self.readable[0] and tokens <= self.readable[1]):
            return
        rows, tokens = max(rows, self.readable[0]), min(max(tokens, 2 * self.readable[1]), self.capacity)
        for row in range(rows):
            self.pages.readable(*self._span(row, 0, tokens))
        self.readable = (rows, tokens)

    def room(self, row: int, end: int) -> None:
        """Row ``row``'s first ``end`` tokens may be written."""
        if self.pages is not None and end > self.mapped[row]:
            self.pages.ensure(*self._span(row, self.mapped[row], end))
            self.mapped[row] = end

    def room_rows(self, starts: torch.Tensor, end: int, width: int) -> None:
        """Each row's block of ``width`` tokens after its ``starts`` (``end``: the last of them) may be written."""
        if end > min(self.mapped[: len(starts)]):
            for row, start in enumerate(starts.tolist()):
                self.room(row, start + width)

    def release(self, row: int) -> None:
        """Give back row ``row``'s memory: it reads as zeros again."""
        if self.pages is not None:
            self.pages.release(*self._span(row, 0, self.capacity))
            self.mapped[row] = 0

    def copy(self, source: int, index: int, length: int) -> None:
        """Row ``index`` holds the first ``length`` tokens of row ``source`` (and nothing else)."""
        if self.pages is not None:
            self.release(index)
            self.room(index, length)
            rows = self.pages.tensor
            rows[index, :length] = rows[source, :length]

    def select(self, rows: list[int], lengths: list[int]) -> None:
        """Rows ``rows`` (holding ``lengths`` tokens each) moved to the front; the others given back."""
        if self.pages is None:
            return
        held = self.pages.tensor
        moved, chained = row_moves(rows)
        taken = {source: held[source, : lengths[source]] for _, source in moved}
        taken = {source: states.clone() if chained else states for source, states in taken.items()}
        for row, source in moved:
            self.release(row)
            self.room(row, lengths[source])
            held[row, : lengths[source]] = taken[source]
        for row in range(len(rows), self.slots):
            self.release(row)

    def resident(self) -> int:
        """Bytes of its memory its rows hold now."""
        return 0 if self.pages is None else self.pages.resident()


def row_writes(starts: torch.Tensor, n: int, end: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Where a pass of ``n`` tokens a row, rows starting at ``starts`` (``[B]``) and the longest ending at ``end``,
    writes each row's block: ``(end, rows [B, 1], slots [B, n])``."""
    return (
        end,
        torch.arange(len(starts), device=starts.device)[:, None],
        starts[:, None] + torch.arange(n, device=starts.device),
    )


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer that writes new states into a buffer allocated once, instead of concatenating.

    ``DynamicLayer`` copies its whole cache every step (``torch.cat``), a cost that grows with the context
    (``docs/hardware.md``, KV cache; ``examples/kv_cache.py`` measures it). Here a step writes only its own states, and
    attention reads a view of the filled prefix: the same values, shapes and layout on the last two dimensions, so
    the same logits. A rollback only moves the end. The buffer doubles if ``capacity`` turns out too small.

    A batch's buffers are a rectangle (``[rows, heads, capacity, dim]``) that attention reads whole. On the CPU
    (:data:`PAGED`) each row's memory is only what it wrote (:class:`~specula.machine.memory.Pages`): the rectangle
    holds every slot from the start, a row that leaves or is taken by another request gives its pages back, and a
    short row beside a long one costs its own tokens. On a GPU a batch's layers hold their states in one
    :class:`RowArena`, paged by chunk (its layers' buffers are views of it). Elsewhere the buffers hold the rows in
    use, not every slot: they gain rows (doubling, up to the slots) as requests join and give them back as they leave
    (:meth:`fit`), so a lone long request takes one row's memory, not every slot's.
    """

    follows_rows = True  # (static passes read every slot's rows: their buffers hold all from the start)
    bucketed = False  # an arena's layer reads the arena's whole length (static passes: a bucket of it)
    whole_pages = True  # paged: capacity rounded up so that each row's heads start on a page of their own

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = max(capacity, 1)
        self.length = 0
        self.rows: int | None = None  # rows in use of a batch's buffers (None: all of them)
        self.sliding_window: int | None = None  # the window of a sliding-window layer it stands for (batches)
        self.row_starts: torch.Tensor | None = None  # [rows]: where each row writes its next block (batches)
        # a batch pass's writes, made once for all its layers: (its end, rows [B, 1], their slots [B, n])
        self.row_writes: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self.ceiling: tuple[int, int] | None = None  # (rows, tokens a row) a memory budget holds it to (batches)
        self._pages: dict[str, Pages] = {}  # each buffer's pages, where paged
        self.arena: tuple[RowArena, int] | None = None  # the batch's shared buffer and this layer's place in it

    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor, slots: int | None = None
    ) -> None:
        self.device = key_states.device
        self.length = 0  # (also after transformers' reset())
        self.slots = slots or len(key_states)
        self.paged = self.device.type in PAGED
        views = self.arena[0].view(self.arena[1], key_states) if self.arena else None
        if views is not None:  # (rows' memory: the arena's)
            self._whole = views
            whole = self.arena[0].capacity
            self._bucket(min(self.capacity, whole) if self.bucketed else whole)
        else:
            self.arena = None
            rows = len(key_states) if self.follows_rows and not self.paged else self.slots
            self._replace(lambda name, buffer: self._zeros(name, buffer, self.capacity, rows), key_states, value_states)
        self.is_initialized = True

    def _zeros(self, name: str, like: torch.Tensor, length: int, rows: int | None = None) -> torch.Tensor:
        # zeros, not garbage: in a batch a row's mask covers slots only longer rows wrote, and attention kernels
        # compute q.k before masking, so a NaN bit pattern there would poison the row
        batch, heads, _, dim = like.shape
        shape = (rows or batch, heads, length, dim)
        if self.paged:
            if self.whole_pages:  # (a row gives back all it wrote)
                shape = (rows or batch, heads, Pages.whole(length, dim * like.element_size()), dim)
            self._pages[name] = Pages(shape, like.dtype)
            return self._pages[name].tensor
        return torch.zeros(shape, dtype=like.dtype, device=like.device)

    def hold_rows(self, count: int) -> None:
        """Room for ``count`` rows (doubling, up to the slots)."""
        held = len(self._key_buffer)
        if count > held:
            rows = max(count, min(self.slots, 2 * held, self.ceiling[0] if self.ceiling else self.slots))

            def grown(name: str, buffer: torch.Tensor) -> torch.Tensor:
                bigger = self._zeros(name, buffer, self.capacity, rows)
                bigger[:held] = buffer
                return bigger

            self._replace(grown)

    def _replace(self, new: Callable[[str, torch.Tensor], torch.Tensor], *buffers: torch.Tensor) -> None:
        """Both buffers become ``new(name, buffer)`` (of ``buffers`` where given), and what the old ones held goes
        back to the system at once: freed only, the C heap would keep it (buffers under glibc's mmap threshold), and
        every growth of a batch's cache would leave the resident set at the old size plus the new one."""
        for name, buffer in zip(("_key_buffer", "_value_buffer"), buffers or (self._key_buffer, self._value_buffer)):
            setattr(self, name, new(name, buffer))
        self.capacity = self._key_buffer.shape[2]
        self._expose()
        if self.device.type == "cpu" and not self.paged:
            give_back_freed()

    def _expose(self) -> None:
        self.keys = self._key_buffer[: self.rows, :, : self.length]
        self.values = self._value_buffer[: self.rows, :, : self.length]

    def _row_lengths(self) -> list[int]:
        """The tokens each row of the buffers in use holds."""
        return [self.length] if self.row_starts is None else self.row_starts.tolist()

    def _bucket(self, capacity: int) -> None:
        """Read the arena's first ``capacity`` tokens of each row."""
        self.capacity = capacity
        self._key_buffer, self._value_buffer = (view[:, :, :capacity] for view in self._whole)
        self._expose()

    def _grow(self, end: int) -> None:
        """Make room for ``end`` tokens per row (doubling; an arena's layer reads more of it, and past its length
        leaves it for buffers of its own)."""
        if end > self.capacity and self.arena:
            if end <= self.arena[0].capacity:
                self._bucket(end)
                return
            self.arena = None
            self._replace(lambda name, buffer: buffer.clone())
        if end > self.capacity:
            ceiling = self.ceiling[1] if self.ceiling and not self.paged else 2 * self.capacity
            self.capacity, lengths = max(end, min(2 * self.capacity, ceiling)), self._row_lengths()

            def grown(name: str, buffer: torch.Tensor) -> torch.Tensor:
                longer = self._zeros(name, buffer, self.capacity)
                if self.paged:  # (each row its own tokens: what it did not write takes no memory)
                    for row, length in enumerate(lengths):
                        longer[row, :, :length] = buffer[row, :, :length]
                else:
                    longer[:, :, : self.length] = buffer[:, :, : self.length]
                return longer

            self._replace(grown)

    def _release(self, row: int) -> None:
        """Give back the memory of ``row`` (paged buffers): it reads as zeros again. (An arena's rows: the arena's.)"""
        for pages in self._pages.values():
            size = pages.tensor[0].numel()  # (a row's heads lie together)
            pages.release(row * size, (row + 1) * size)

    def held_bytes(self) -> int:
        """The memory its buffers hold now (paged: the pages rows wrote and did not give back)."""
        if not self.is_initialized:
            return 0
        if self.arena:  # (its share)
            return self.arena[0].resident() // self.arena[0].members
        if self.paged:
            return sum(pages.resident() for pages in self._pages.values())
        return self._key_buffer.nbytes + self._value_buffer.nbytes

    def fit(self, end: int) -> None:
        """Give back the room past ``end`` tokens a row, and the rows past those in use, where the buffers hold over
        twice that (a long request left its slot, requests left the batch), or over a budget's :attr:`ceiling`: the
        memory follows the rows in use. (Paged buffers gave back what rows left as they left.)"""
        if not self.is_initialized or self.paged or self.arena:
            return
        end, held = max(end, self.length), len(self._key_buffer)
        rows = held if self.rows is None or not self.follows_rows else max(self.rows, 1)
        tokens, kept = (end if self.capacity > 2 * end else self.capacity), (rows if held > 2 * rows else held)
        if self.ceiling is not None:
            tokens, kept = max(end, min(tokens, self.ceiling[1])), max(rows, min(kept, self.ceiling[0]))
        if (tokens, kept) != (self.capacity, held):
            self.capacity = tokens
            self._replace(lambda name, buffer: buffer[:kept, :, :tokens].clone())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [B, heads, n, dim]; each row's block goes at its own start in a batch
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        starts, writes = self.row_starts, self.row_writes
        if writes is None or writes[2].shape[1] != n:  # (made here: one sync with the device per layer)
            writes = None
            end = (self.length if starts is None else int(starts.max())) + n
        else:
            end = writes[0]
        self._grow(end)
        if self.arena:  # (what attention reads of the rows in use, and where they write)
            at = starts if starts is not None else torch.tensor([self.length])  # [rows]
            self.arena[0].read(len(at), end)
            self.arena[0].room_rows(at, end, n)
        if starts is None or len(starts) == 1:  # (one row: a plain slice)
            start = self.length if starts is None else end - n
            self._key_buffer[: len(key_states), :, start:end] = key_states
            self._value_buffer[: len(value_states), :, start:end] = value_states
        else:
            _, rows, slots = writes or row_writes(starts, n, end)  # [B, 1], [B, n]
            # (an index_put of these slots only: scatter_ into the whole buffer was far slower, docs/hardware.md)
            self._key_buffer[rows, :, slots] = key_states.transpose(1, 2)  # [B, n, heads, dim]
            self._value_buffer[rows, :, slots] = value_states.transpose(1, 2)
        self.length = end
        self._expose()
        return self.keys, self.values

    def put_row(self, index: int, keys: torch.Tensor, values: torch.Tensor, slots: int, end: int) -> None:
        """Write a request's prompt states (``[1, heads, n, dim]``, computed alone: the last ``n`` of its ``end``
        tokens, fewer than ``end`` where a sliding window kept only its last ones) as row ``index`` of a batch of up
        to ``slots`` rows."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values, slots)
        self.hold_rows(index + 1)
        self._grow(end)
        self._release(index)  # (what the request before it in this slot wrote)
        if self.arena:
            self.arena[0].room(index, end)
        self._key_buffer[index, :, end - keys.shape[-2] : end] = keys[0]
        self._value_buffer[index, :, end - values.shape[-2] : end] = values[0]

    def copy_row(self, source: int, index: int, length: int) -> None:
        """Make row ``index`` hold the first ``length`` tokens of row ``source`` (an arena's rows: the arena copies)."""
        if self.arena:
            return
        self.hold_rows(index + 1)
        self._release(index)
        for buffer in (self._key_buffer, self._value_buffer):
            buffer[index, :, :length] = buffer[source, :, :length]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows, moved to the front (finished requests leave the batch)."""
        if not self.is_initialized:
            return
        moved, chained = row_moves(rows.tolist())
        if self.arena:
            pass  # (the arena moved its rows)
        elif self.paged:  # (each row's own tokens moved, and what rows no longer hold given back)
            lengths, sources = self._row_lengths(), {source for _, source in moved}
            taken = {
                source: [
                    states.clone() if chained else states
                    for states in (
                        buffer[source, :, : lengths[source]] for buffer in (self._key_buffer, self._value_buffer)
                    )
                ]
                for source in sources
            }
            for row, source in moved:
                self._release(row)
                for buffer, states in zip((self._key_buffer, self._value_buffer), taken[source]):
                    buffer[row, :, : lengths[source]] = states
            for row in range(len(rows), len(self._key_buffer)):
                self._release(row)
        elif moved:  # (the rows that move only: where a row left, the last one takes its place)
            to, source = (torch.tensor(side, device=rows.device) for side in zip(*moved))
            for buffer in (self._key_buffer, self._value_buffer):
                buffer[to] = buffer[source]
        self.rows = len(rows)
        self.length = self.length if len(rows) else 0
        self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop() takes minus the number of tokens to remove, got {tokens_to_remove}.")
        if self.is_initialized:
            self.length = max(self.length - abs(tokens_to_remove), 0)
            self._expose()


class RowPrefill(DynamicLayer):
    """A request's prompt computed alone, its keys and values written straight into row ``index`` of a batch's
    full-attention layer (of up to ``slots`` rows) as they are computed, not held apart and copied there: a long
    prompt's states are never held twice. Attention reads that row, as a one-row :class:`PreallocatedLayer` does."""

    def __init__(self, batch: PreallocatedLayer, index: int, slots: int) -> None:
        super().__init__()
        self.batch, self.index, self.slots = batch, index, slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [1, heads, n, dim], the whole prompt (a prefill is one pass)
        n = key_states.shape[-2]
        self.batch.put_row(self.index, key_states, value_states, self.slots, n)
        self.keys, self.values = (
            buffer[self.index : self.index + 1, :, :n] for buffer in (self.batch._key_buffer, self.batch._value_buffer)
        )
        self.is_initialized = True
        return self.keys, self.values


class PreallocatedHybridLayer(LinearAttentionLayer, PreallocatedLayer):
    """A batch's layer holding attention and recurrent state at once (Falcon-H1, Zamba's hybrid layers), as
    transformers' ``LinearAttentionAndFullAttentionLayer`` holds them: its attention a :class:`PreallocatedLayer`, its
    recurrent states rows of :class:`specula.verifier.recurrent.RecurrentRows`."""

    def __init__(self, capacity: int, number_of_states: int) -> None:
        PreallocatedLayer.__init__(self, capacity)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # attention states come positionally (keys, values[, slots]), recurrent ones as keywords
        if args:
            PreallocatedLayer.lazy_initialization(self, *args, **kwargs)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)
