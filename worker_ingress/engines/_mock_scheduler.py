"""The mocker's core: the scheduler of one data-parallel rank over its KV-block pool (sans-IO;
the pool and its prefix cache are :class:`~worker_ingress.engines._kv_pool.KvBlockPool`).

:class:`RankScheduler` is plain objects, no clock, no I/O: the caller adds and aborts sequences,
asks for the next step, sleeps for its simulated duration, then applies it. The Trio shell that
does so, one step loop per rank, is :class:`~worker_ingress.engines._mocker.MockerEngine`.
:class:`GpuStepModel` gives the step times of a real GPU (see docs/mocker.md for the performance
model and where it comes from).

Rules of a sequence (one request) inside a rank:

1. Tokens. A sequence has ``num_tokens`` = prompt tokens + tokens generated so far, and
   ``num_computed`` of them have their KV computed. A step computes ``num_tokens - num_computed``
   tokens for it, at most what the step's token budget allows (chunked prefill); a decoding
   sequence computes exactly one (the token it generated last). When a step brings
   ``num_computed`` up to ``num_tokens``, the sequence emits its next token, as vLLM does: the
   step that finishes a prefill also produces the first output token.
2. States. WAITING (in the FIFO waiting queue, no blocks) -> RUNNING (in the batch, holds
   blocks) -> FINISHED (all ``max_tokens`` emitted; blocks released at once). ABORTED (the
   caller closed the generator) can happen from any live state and releases the blocks at once.
   RUNNING -> WAITING is a preemption. Released blocks are free capacity at once; the named ones
   stay cached until their space is needed (rule 8).
3. Prefill vs decode. A sequence is "prefilling" from admission (or re-admission after a
   preemption) until the step that brings ``num_computed`` to ``num_tokens``; afterwards it is
   "decoding". ``active_prefill_tokens`` sums ``num_tokens - num_computed`` over all prefilling
   sequences, waiting ones included.
4. KV blocks. A sequence holds ``ceil(tokens with KV / block_size)`` blocks; blocks are taken
   when a step is scheduled for the tokens it will compute, so a step never runs without its
   KV. At most ``prompt + max_tokens - 1`` tokens ever have KV (the last generated token is never
   fed back), and a request needing more blocks than the rank has is refused before admission.
5. One step of a rank. The token budget is ``max_num_batched_tokens``. First every decoding
   running sequence gets its one token (oldest first, while budget lasts), then the partially
   prefilled running sequences get chunks, then waiting sequences are admitted in FIFO order
   while the batch has fewer than ``max_num_seqs`` sequences and budget is left.
6. Out of blocks. A RUNNING sequence that needs a block that is not free preempts the newest
   running sequence (LIFO, vLLM's default recompute preemption): its blocks are released and it
   goes to the head of the waiting queue, to be prefilled again (prompt and generated tokens,
   less what is still cached) later.
   This repeats until the block is free or the sequence preempted itself. A WAITING sequence
   never preempts: when its first chunk does not fit, it and everyone behind it wait (FIFO, no
   overtaking), and no waiting sequence is admitted in a step that preempted. The oldest running
   sequence can therefore always progress, so the rank never deadlocks.
7. Load. ``active_decode_blocks`` and ``kv_used_blocks`` are both the blocks held by running
   (and transferring, rule 9) sequences, a block shared by several counted once; cached blocks
   nobody holds are free capacity (:mod:`worker_ingress.engines._kv_pool` keeps the pool and
   its rules).
8. Prefix cache (on unless ``prefix_caching=False``). A sequence carries the names of its prompt's
   full blocks. When it is admitted (again, after a preemption) it holds its longest cached
   prefix at once, those tokens count as computed and only the rest is prefilled; at least one
   token is always computed, as vLLM does, so the last block of a prompt cached whole is
   computed again. The space it needs is its first chunk's new blocks plus the cached blocks
   nobody held. A block is named, and enters the cache, when a step completes its tokens; a
   preempted, finished or aborted sequence's named blocks stay cached, evictable, its tenant's
   (whose blocks go first when space is needed: rules 7 and 8 of the pool). Its
   ``cached_tokens`` are those found at its first admission (0 with caching off), and with
   caching on that admission adds its prompt tokens to :attr:`RankScheduler.queried_tokens`
   and its cached ones to :attr:`RankScheduler.hit_tokens`.
9. Hand-offs (a decode worker's request, ``handed_off``). The prompt's KV is received from a
   prefill worker, not prefilled: the sequence never counts in ``active_prefill_tokens``. It
   waits in the FIFO queue like any; admitted (a batch place and the blocks of its whole prompt,
   the last partial block included, free), it becomes TRANSFERRING: it holds those blocks, and
   a batch place, from the transfer's start, and no step computes for it. The caller reports
   the transfer's end (:meth:`RankScheduler.finish_transfer`); the sequence then runs as a
   decoding one whose prompt is all present, like a full prefix-cache hit: its next step
   computes the prompt's last token and emits the first output, as a decode does. Its blocks
   are named as its steps complete them (rule 8). A preemption throws the received KV away:
   the sequence is prefilled again like any other; a transferring sequence is never preempted,
   and a transfer ends, so the rank still never deadlocks. Aborting frees its blocks in every
   state, in the middle of its transfer too.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from typing import Final

import msgspec

from shim_common.wire import RankLoad
from worker_ingress.engines._kv_pool import SHARED_TENANT, KvBlockPool, PoolEvent

__all__ = ["GpuStepModel", "MockSequence", "RankScheduler", "ScheduledStep", "SequenceState"]

#: Waiting entries of cancelled sequences are dropped lazily; the queue is rebuilt once this many
#: (and at least as many as live ones) pile up, so a cancel costs O(1) amortised.
_COMPACT_DEAD_WAITING: Final = 64


# ----------------------------------------------------------------------------- performance model


class GpuStepModel(msgspec.Struct, frozen=True, kw_only=True):
    """Wall time of one engine step on a real GPU, before the speedup ratio.

    The defaults are the polynomial timing model of NVIDIA Dynamo's mocker (docs/mocker.md):
    prefill milliseconds are a quadratic in the prompt tokens the step computes, decode
    milliseconds a quadratic in the fraction of the KV cache in use, and a step that does both
    costs the sum, as Dynamo's vLLM-style scheduler charges it.
    """

    prefill_ms_per_token_squared: float = 4.209989e-07
    prefill_ms_per_token: float = 1.518344e-02
    prefill_ms_base: float = 1.650142e01
    decode_ms_per_kv_fraction_squared: float = -25.74
    decode_ms_per_kv_fraction: float = 54.01
    decode_ms_base: float = 5.74
    #: No step is shorter than this, so a step always advances the clock.
    min_step_ms: float = 1.0

    def prefill_ms(self, prefill_tokens: int) -> float:
        """Milliseconds to compute ``prefill_tokens`` prompt tokens in one step (0 for none)."""
        if prefill_tokens <= 0:
            return 0.0
        t = float(prefill_tokens)
        return (
            self.prefill_ms_per_token_squared * t * t
            + self.prefill_ms_per_token * t
            + self.prefill_ms_base
        )

    def decode_ms(self, kv_fraction: float) -> float:
        """Milliseconds of the token-emitting part of a step at a KV-cache use in [0, 1]."""
        f = min(max(kv_fraction, 0.0), 1.0)
        ms = (
            self.decode_ms_per_kv_fraction_squared * f * f
            + self.decode_ms_per_kv_fraction * f
            + self.decode_ms_base
        )
        return max(ms, self.min_step_ms)

    def step_seconds(self, *, prefill_tokens: int, emitting: int, kv_fraction: float) -> float:
        """Seconds of one step that computes ``prefill_tokens`` and emits ``emitting`` tokens."""
        ms = self.prefill_ms(prefill_tokens)
        if emitting > 0:
            ms += self.decode_ms(kv_fraction)
        return max(ms, self.min_step_ms) / 1000.0


# ----------------------------------------------------------------------------- sans-IO core


class SequenceState(enum.Enum):
    """Where a sequence is in its life (rule 2 of the module docstring)."""

    WAITING = "waiting"
    #: A hand-off's KV is arriving (rule 9): blocks held, no step computes for it.
    TRANSFERRING = "transferring"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class MockSequence:
    """One request inside a rank: its token counters, the blocks it holds, its state."""

    __slots__ = (
        "block_names",
        "blocks",
        "cached_tokens",
        "generated",
        "handed_off",
        "max_tokens",
        "named",
        "num_computed",
        "num_tokens",
        "preemptions",
        "prefill_done",
        "prompt_tokens",
        "state",
        "tenant",
    )

    def __init__(
        self,
        *,
        prompt_tokens: int,
        max_tokens: int,
        block_names: Sequence[int] = (),
        handed_off: bool = False,
        tenant: str = SHARED_TENANT,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        #: The prompt's KV comes from a hand-off (rule 9) until a preemption throws it away.
        self.handed_off = handed_off
        #: Whose request it is: the cache blocks it names or lets go are this tenant's
        #: (:mod:`worker_ingress.engines._kv_pool`, rule 7).
        self.tenant = tenant
        #: The names of the prompt's full blocks (empty: nothing of it is cached or shared).
        self.block_names = block_names
        #: Of :attr:`blocks`, the leading ones that are named (held in the cache).
        self.named = 0
        #: Prompt tokens found in the cache at the first admission (``None`` before it).
        self.cached_tokens: int | None = None
        self.max_tokens = max_tokens
        self.num_tokens = prompt_tokens
        self.num_computed = 0
        self.generated = 0
        self.blocks = 0
        #: A handed-off prompt is never prefilled: it waits for no prefill (rule 9).
        self.prefill_done = handed_off
        self.preemptions = 0
        self.state = SequenceState.WAITING

    @property
    def done(self) -> bool:
        """Whether the sequence has left the rank (finished or aborted)."""
        return self.state is SequenceState.FINISHED or self.state is SequenceState.ABORTED

    @property
    def pending_prefill(self) -> int:
        """Its share of ``active_prefill_tokens`` (rule 3)."""
        if self.prefill_done or self.done:
            return 0
        return self.num_tokens - self.num_computed


class ScheduledStep:
    """What one step computes: ``(sequence, tokens)`` pairs and the step's simulated duration."""

    __slots__ = ("decode_sequences", "duration", "emitting", "entries", "prefill_tokens")

    def __init__(
        self,
        entries: list[tuple[MockSequence, int]],
        *,
        prefill_tokens: int,
        decode_sequences: int,
        emitting: int,
        duration: float,
    ) -> None:
        self.entries = entries
        #: Tokens computed for prefilling sequences (the chunked-prefill part of the budget).
        self.prefill_tokens = prefill_tokens
        #: Decoding sequences that get their one token.
        self.decode_sequences = decode_sequences
        #: Sequences that emit a token (or finish) when the step completes.
        self.emitting = emitting
        #: Simulated seconds on the modelled GPU, before the speedup ratio.
        self.duration = duration


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class RankScheduler:
    """The scheduler and KV-block pool of one data-parallel rank (sans-IO; see module rules).

    Drive it with :meth:`add` / :meth:`abort` as requests come and go, and with
    :meth:`schedule` then :meth:`complete` for each step, sleeping for the step's duration in
    between. Counters are kept incrementally so a step costs O(sequences it touches).
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        model: GpuStepModel | None = None,
        prefix_caching: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.model = model if model is not None else GpuStepModel()
        self.pool = KvBlockPool(num_blocks, caching=prefix_caching)
        self.prefill_tokens = 0
        #: Prompt tokens looked up in the cache, and of those found there (rule 8).
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.preemptions = 0
        self.live_sequences = 0
        self._running: list[MockSequence] = []
        self._waiting: deque[MockSequence] = deque()
        self._dead_waiting = 0
        #: Hand-offs whose KV is arriving (rule 9), in admission order (a dict: O(1) removal).
        self._transferring: dict[MockSequence, None] = {}
        #: Transfers that started since :meth:`take_started_transfers` was last called.
        self._transfers_started: list[MockSequence] = []

    # --- inspection --------------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        """Blocks held by running sequences, a shared block once (rule 7)."""
        return self.pool.held

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included."""
        return self.pool.free

    @property
    def prefix_caching(self) -> bool:
        """Whether prompt blocks are cached and reused (rule 8)."""
        return self.pool.caching

    @property
    def running(self) -> Sequence[MockSequence]:
        """The batch, oldest admission first."""
        return self._running

    @property
    def waiting(self) -> list[MockSequence]:
        """The live waiting sequences, head first (a copy: O(queue), for inspection)."""
        return [s for s in self._waiting if not s.done]

    @property
    def waiting_count(self) -> int:
        """Live sequences in the waiting queue."""
        return len(self._waiting) - self._dead_waiting

    @property
    def transferring(self) -> list[MockSequence]:
        """Hand-offs whose KV is arriving (rule 9), oldest first (a copy)."""
        return list(self._transferring)

    def load(self, dp_rank: int) -> RankLoad:
        """This rank's load as the event plane publishes it."""
        return RankLoad(
            dp_rank=dp_rank,
            active_decode_blocks=self.used_blocks,
            active_prefill_tokens=self.prefill_tokens,
            kv_used_blocks=self.used_blocks,
        )

    def recount(self) -> tuple[int, int]:
        """Blocks in use and prefill tokens counted from scratch (to check the counters): a
        named block held by several sequences counts once."""
        live = [s for s in self._waiting if not s.done] + self._running + self.transferring
        anonymous = sum(s.blocks - s.named for s in live)
        named = {name for s in live for name in s.block_names[: s.named]}
        return anonymous + len(named), sum(s.pending_prefill for s in live)

    def take_kv_events(self) -> list[PoolEvent]:
        """What entered and left this rank's cache since the last call, in order."""
        return self.pool.take_events()

    def max_kv_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """Most tokens a request ever has KV for (rule 4)."""
        return prompt_tokens + max(max_tokens - 1, 0)

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a request can ever run on this rank (its peak KV fits the whole cache)."""
        peak = self.max_kv_tokens(prompt_tokens, max_tokens)
        return _blocks_for(peak, self.block_size) <= self.num_blocks

    # --- requests coming and going -----------------------------------------------------------

    def add(self, seq: MockSequence) -> None:
        """Queue a new sequence at the tail of the waiting queue."""
        seq.state = SequenceState.WAITING
        self._waiting.append(seq)
        self.prefill_tokens += seq.pending_prefill
        self.live_sequences += 1

    def abort(self, seq: MockSequence) -> None:
        """Drop a sequence at once, freeing its blocks; a no-op once it has left."""
        if seq.done:
            return
        self.prefill_tokens -= seq.pending_prefill
        was_running = seq.state is SequenceState.RUNNING
        was_transferring = seq.state is SequenceState.TRANSFERRING
        seq.state = SequenceState.ABORTED
        self.live_sequences -= 1
        if was_running:
            self._running.remove(seq)
            self._free(seq)
        elif was_transferring:
            del self._transferring[seq]
            self._free(seq)
        else:
            # Left in the deque and skipped later: removing from the middle would cost O(queue).
            self._dead_waiting += 1
            self._maybe_compact_waiting()

    def finish_transfer(self, seq: MockSequence) -> None:
        """A hand-off's KV has arrived: the sequence joins the batch, decoding (rule 9); a
        no-op unless it is transferring (it was aborted meanwhile)."""
        if seq.state is not SequenceState.TRANSFERRING:
            return
        del self._transferring[seq]
        seq.state = SequenceState.RUNNING
        seq.num_computed = max(seq.num_tokens - 1, 0)
        self._running.append(seq)

    def take_started_transfers(self) -> list[MockSequence]:
        """The hand-offs admitted since the last call, whose transfers the caller now times."""
        started = self._transfers_started
        self._transfers_started = []
        return started

    # --- one step ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Choose the work of the next step and take its blocks; ``None`` when idle."""
        budget = self.max_num_batched_tokens
        scheduled: dict[MockSequence, int] = {}
        preempted_any = False

        # Pass 1: one token for every decoding sequence, oldest first (rule 5).
        index = 0
        while index < len(self._running) and budget > 0:
            seq = self._running[index]
            index += 1
            if not seq.prefill_done:
                continue
            granted, preempted_now, budget = self._grow(seq, 1, scheduled, budget)
            preempted_any |= preempted_now
            if granted:
                scheduled[seq] = 1
                budget -= 1

        # Pass 2: chunks for the partially prefilled running sequences, in batch order.
        index = 0
        while index < len(self._running):
            seq = self._running[index]
            index += 1
            if seq.prefill_done or seq in scheduled:
                continue
            chunk = min(seq.num_tokens - seq.num_computed, budget)
            if chunk <= 0 and seq.num_tokens > seq.num_computed:
                break
            granted, preempted_now, budget = self._grow(seq, chunk, scheduled, budget)
            preempted_any |= preempted_now
            if granted:
                scheduled[seq] = chunk
                budget -= chunk

        # Pass 3: admit waiting sequences in FIFO order, unless this step preempted (rule 6).
        if not preempted_any:
            self._admit_waiting(scheduled, budget)

        if not scheduled:
            return None
        prefill_tokens = 0
        decode_sequences = 0
        emitting = 0
        for seq, tokens in scheduled.items():
            if seq.prefill_done:
                decode_sequences += 1
            else:
                prefill_tokens += tokens
            if seq.num_computed + tokens == seq.num_tokens:
                emitting += 1
        duration = self.model.step_seconds(
            prefill_tokens=prefill_tokens,
            emitting=emitting,
            kv_fraction=self.used_blocks / self.num_blocks,
        )
        return ScheduledStep(
            list(scheduled.items()),
            prefill_tokens=prefill_tokens,
            decode_sequences=decode_sequences,
            emitting=emitting,
            duration=duration,
        )

    def complete(self, step: ScheduledStep) -> list[MockSequence]:
        """Apply a step whose time has passed; return the sequences that emitted or finished.

        Sequences aborted while the step ran are skipped: their blocks are already free.
        """
        progressed: list[MockSequence] = []
        finished_any = False
        for seq, tokens in step.entries:
            if seq.state is not SequenceState.RUNNING:
                continue
            seq.num_computed += tokens
            if not seq.prefill_done:
                self.prefill_tokens -= tokens
            if seq.named < len(seq.block_names):
                self._name_computed_blocks(seq)
            if seq.num_computed < seq.num_tokens:
                continue
            seq.prefill_done = True
            if seq.generated < seq.max_tokens:
                seq.generated += 1
                seq.num_tokens += 1
            if seq.generated >= seq.max_tokens:
                seq.state = SequenceState.FINISHED
                self._free(seq)
                self.live_sequences -= 1
                finished_any = True
            progressed.append(seq)
        if finished_any:
            self._running = [s for s in self._running if s.state is SequenceState.RUNNING]
        return progressed

    # --- internals ---------------------------------------------------------------------------

    def _grow(
        self,
        seq: MockSequence,
        tokens: int,
        scheduled: dict[MockSequence, int],
        budget: int,
    ) -> tuple[bool, bool, int]:
        """Take the blocks ``seq`` needs to compute ``tokens`` more, preempting if needed.

        Returns whether ``seq`` got them (it may have preempted itself), whether anyone was
        preempted, and the budget after returning the tokens of preempted, already-scheduled
        sequences.
        """
        need = _blocks_for(seq.num_computed + tokens, self.block_size) - seq.blocks
        preempted = False
        while need > self.free_blocks:
            victim = self._running.pop()
            returned = scheduled.pop(victim, 0)
            budget += returned
            self._preempt(victim)
            preempted = True
            if victim is seq:
                return False, True, budget
        if need > 0:
            seq.blocks += need
            self.pool.allocate(need)
        return True, preempted, budget

    def _admit_waiting(self, scheduled: dict[MockSequence, int], budget: int) -> None:
        block_size = self.block_size
        while self._waiting and len(self._running) + len(self._transferring) < self.max_num_seqs:
            seq = self._waiting[0]
            if seq.done:
                self._waiting.popleft()
                self._dead_waiting -= 1
                continue
            if seq.handed_off:
                if not self._start_transfer(seq):
                    return
                continue
            # Rule 8: the longest cached prefix, leaving at least one token to compute.
            hit, revived = self.pool.match(seq.block_names, (seq.num_tokens - 1) // block_size)
            cached = hit * block_size
            remaining = seq.num_tokens - cached
            chunk = min(remaining, budget)
            if chunk <= 0 and remaining > 0:
                return
            fresh = _blocks_for(cached + chunk, block_size) - hit
            if fresh + revived > self.free_blocks:
                return
            self._waiting.popleft()
            seq.state = SequenceState.RUNNING
            self._running.append(seq)
            if hit:
                self.pool.acquire(seq.block_names[:hit])
                seq.named = hit
                seq.num_computed = cached
                self.prefill_tokens -= cached
            if seq.cached_tokens is None:
                seq.cached_tokens = cached
                if self.pool.caching:
                    self.queried_tokens += seq.prompt_tokens
                    self.hit_tokens += cached
            seq.blocks = hit + fresh
            self.pool.allocate(fresh)
            scheduled[seq] = chunk
            budget -= chunk

    def _start_transfer(self, seq: MockSequence) -> bool:
        # Rule 9: the whole prompt's blocks from the transfer's start, or wait (FIFO).
        need = _blocks_for(seq.num_tokens, self.block_size)
        if need > self.free_blocks:
            return False
        self._waiting.popleft()
        seq.state = SequenceState.TRANSFERRING
        seq.blocks = need
        self.pool.allocate(need)
        self._transferring[seq] = None
        self._transfers_started.append(seq)
        return True

    def _preempt(self, seq: MockSequence) -> None:
        # Recompute preemption: everything computed is thrown away and prefilled again.
        self.prefill_tokens += seq.num_tokens - seq.pending_prefill
        seq.handed_off = False
        self._free(seq)
        seq.num_computed = 0
        seq.prefill_done = False
        seq.preemptions += 1
        seq.state = SequenceState.WAITING
        self._waiting.appendleft(seq)
        self.preemptions += 1

    def _free(self, seq: MockSequence) -> None:
        # Named blocks stay cached, evictable once nobody holds them; the rest go back.
        pool = self.pool
        if seq.named:
            pool.release(seq.block_names[: seq.named], seq.tenant)
        pool.free_anonymous(seq.blocks - seq.named)
        seq.blocks = 0
        seq.named = 0

    def _name_computed_blocks(self, seq: MockSequence) -> None:
        # Rule 8: every prompt block whose tokens are all computed now enters the cache.
        if not self.pool.caching:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_names))
        names = seq.block_names
        commit = self.pool.commit
        tenant = seq.tenant
        while seq.named < full:
            index = seq.named
            commit(names[index - 1] if index else None, names[index], tenant)
            seq.named = index + 1

    def _maybe_compact_waiting(self) -> None:
        if self._dead_waiting >= _COMPACT_DEAD_WAITING and self._dead_waiting * 2 >= len(
            self._waiting
        ):
            self._waiting = deque(s for s in self._waiting if not s.done)
            self._dead_waiting = 0
