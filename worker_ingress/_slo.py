"""SLO-aware admission: the effective engine limit L and the early-refusal bound (sans-IO).

:class:`SloController` is a plain object: the gate's sans-IO state
(:class:`~worker_ingress._admission_state.AdmissionState`, which alone drives it) feeds it
observations and the time (Trio seconds, any monotonic clock) and reads two integers back: the
effective limit L that the gate enforces in place of N, and the queue bound B past which an
arrival is refused early. It owns no clock, no task and no lock, so it is tested synchronously
with any timeline.

Rules
=====

1. Bounds. ``min_limit <= L <= max_limit`` (``--adaptive-min-limit`` and N) at every instant. L
   starts at N: until the worker has evidence that N serves requests late, it behaves as without
   an objective.
2. Samples. Only a request that produced a first output (or an overdue one, rule 3) is a
   sample, with three timestamps:
   arrival (at the frontend, when the frontend said how long the request spent there before
   the gate; else at the gate), start in the engine, first output. Rejected, displaced,
   cancelled and timed-out requests never report one, so they cannot mislead the law. The law
   reads the **in-engine** time to first token (start to first output); the queue wait, and the
   time in the frontend, are governed by the early refusal (rules 6 and 7), and reacting to
   them with L would be backwards: a long wait calls for refusing earlier, not for starting
   fewer requests. A request that started
   before L last changed is not a sample of the new L (it was admitted under the old one, and
   its time in the engine says nothing about the new level), so it is left out.
3. Windows. Samples collect in a window. A request still in the engine without a first output
   but older than the engine's share of S (rule 4's ``T``) is *overdue*: it counts among the
   window's samples at its age so far, since its first output is late whatever it turns out to
   be. A window closes at the first :meth:`~SloController.update` after it has lasted
   ``window_seconds`` **and** holds ``min_samples`` samples, or as soon as it holds
   ``max_samples`` (memory is bounded). With too few samples the window stays open and L
   holds; nothing is decided on noise. One exception: a window that has lasted
   ``starve_seconds`` with the limit in use (arrivals wait) and no request in the engine late
   for its first output (no overdue open sample) is *starved*: its slots are held by requests
   past their first output (a ``max_tokens`` of thousands), which no sample will ever show. It
   closes and raises L by the additive step (under a fresh ceiling; a ceiling at L + 1 or
   below is forgotten: it was set by what held the slots, not by a slow engine), so one long
   request cannot hold a lowered limit down for as long as it runs.
4. The law, applied when a window closes, with ``p`` the window's 90th percentile of in-engine
   time to first token and ``T = engine_share * S`` the engine's share of the objective:

   - ``p > T`` (the engine is over-subscribed): multiplicative decrease by the gradient,
     ``L <- max(min_limit, min(L - 1, max(floor(L * min_decrease_factor), floor(U * T / p))))``
     with ``U`` the most requests that ran at once in the window (at most L: cutting the unused
     part of a limit that was never reached would change nothing). The first decrease from N
     (no ceiling, no probe) may cut three steps at once, to ``floor(N * min_decrease_factor **
     3)`` at the least: an overload that starts at N is met within one window near the level
     the engine sustains, instead of spending its first seconds halving from N. The
     old L becomes the *ceiling*: a level known to be too high, not tried again while it is
     fresh. A ceiling lives ``first_probe_seconds``; each failed probe doubles that, up to
     ``probe_seconds``, and a window whose limit was not in use resets it. When the window
     before raised L, the decrease goes back to the level it was raised from instead (that
     level was fine a window ago), and the ceiling is the level just above it: a failed probe
     costs one step up and one back, and from then on increases are single steps.
   - ``p <= comfort * T`` and the limit was in use (some arrival had to wait in the queue, or was
     refused, during the window): increase toward the level where the engine would just be
     comfortable if its time grew in proportion to L,
     ``L <- min(N, ceil(L * recovery_factor), max(L + max(1, floor(L * increase_share)),
     floor(L * comfort * T / p)))``, capped, while the ceiling is fresh, at ``ceiling - 1``.
     After a failed probe (until a window is comfortable at or above the level that failed, or
     the limit is not in use) the increase is the additive step alone: a knee in the engine's
     curve is found by single steps, never jumped over again and again. So a limit that an
     attack of long prompts drove down comes back within a few windows of its end, yet a
     steady load near a knee sees one step up and one back per ceiling life.
   - ``p <= comfort * T`` and the limit was not in use (nobody waited): recovery,
     ``L <- min(N, max(L + 1, ceil(L * recovery_factor)))``, and the ceiling is forgotten (the
     load that set it has gone). L is not binding then, so raising it changes nothing now; it
     only stops a past overload from capping the worker once the load has fallen.
   - otherwise (between ``comfort * T`` and ``T``: the dead band) L holds.

   Every step is bounded: ``floor(L * min_decrease_factor) <= L' <= ceil(L * recovery_factor)``,
   but for the first decrease from N, ``floor(N * min_decrease_factor ** 3) <= L'``.
   On a steady load L settles in the dead band or one below the ceiling, and once the failed
   probes have doubled its life, moves again at most once per ``probe_seconds`` (one probe of
   the ceiling), never in a sawtooth.
5. Start rate. Every finished request reports how long it held its slot. Their exponentially
   weighted mean ``hold`` gives the rate at which a saturated gate starts requests, ``L / hold``
   (Little's law: L requests in the engine, each leaving after ``hold`` on average). It needs no
   measurement of idle time and does not collapse when the load pauses. One hold counts at most
   ``hold_outlier`` times the mean so far: a single request of thousands of tokens moves the
   mean as a few ordinary ones would, instead of closing the queue for everyone after it.
6. Early refusal. Requests start from a saturated queue at the rate ``r = L / hold``, so an
   arrival with ``k`` requests queued ahead of it starts after ``k + 1`` starts, which take
   ``(k + 1) / r`` on average, give or take ``sqrt(k + 1) / r`` (starts as a Poisson stream),
   and then waits ``e``, the engine's 90th-percentile time to first token (of the last closed
   window). It has room for its first token within S when the 90th percentile of its wait fits:
   ``(x + z * sqrt(x)) / r + e <= S`` with ``x = k + 1`` and ``z = 1.28``. The largest such ``x``
   is the queue bound ``B = floor(((sqrt(z^2 + 4 R) - z) / 2)^2)`` with ``R = (S - e) * r``, and
   the gate refuses an arrival that would queue behind B or more requests
   (:attr:`SloController.queue_bound`, refreshed when a window closes). The objective is the
   client's: an arrival that already spent ``w`` of S in a frontend is judged against the bound
   of ``S - w`` (:meth:`SloController.queue_bound_after`, from the same ``r`` and ``e``), and
   one with no room left for its wait at all (rule 7) is refused whatever the queue. Under a
   sustained overload the queue stays full, so every admitted request is admitted at position
   B: the bound must serve the percentile of the objective, not its mean. B is at least 1 while
   the engine's p90 leaves any room (``e < S``): one request waiting in the dispatcher's hand
   keeps the engine from idling between a finish and the next arrival, and rule 7 refuses it
   if its wait runs out; with no room at all B is 0. Before the first hold time B is unbounded
   (no evidence, no refusal).
7. Deadline. A queued request whose wait leaves no more room for its first token within S is
   refused: the deadline is S minus the engine's median time to first token (of the last closed
   window; S itself before the first), so a request that has waited S is refused at the latest.
   Starting it would spend a slot on a request that is late anyway, and under overload another
   request, queued later, can use that slot in time. The gate's state names the deadline when a
   request joins the queue (:attr:`SloController.queue_deadline`), and its Trio shell arms it.

Theory of operation
-------------------

The objective is on arrival-to-first-output time: queue wait plus in-engine time. The two parts
answer to different knobs. In-engine time grows with L once the engine's batch is saturated
(chunked prefill queues prefill inside the engine: past the knee, a larger L adds waiting, not
throughput); queue wait grows with the queue, which only refusal can shorten. So L is steered on
in-engine time against a fixed share of S (half by default), which leaves the rest of S to the
queue, and the queue is bounded by the expected wait, not by a count. The reference point is
the objective itself, never a measured minimum: a minimum taken from the fastest requests
collapses a limit under mixed request sizes, and the objective is what the operator asked for.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final

__all__ = ["UNBOUNDED_QUEUE", "SloController", "SloTuning", "percentile"]

#: :attr:`SloController.queue_bound` before there is any evidence: larger than any queue.
UNBOUNDED_QUEUE: Final = 2**31 - 1
#: The standard normal's 90th percentile: the spread allowed for in a queued request's wait.
_Z90: Final = 1.2816


@dataclasses.dataclass(frozen=True, kw_only=True)
class SloTuning:
    """The law's constants (rules 3 to 5 of the module). The defaults are what the benchmark
    (``bench/bench_slo.py``) was run with; they are not flags on purpose: the operator states an
    objective, not a controller.

    Raises:
        ValueError: A constant outside its range.
    """

    #: Shortest window; it closes only once it also holds ``min_samples`` samples.
    window_seconds: float = 1.0
    #: Fewer samples than this: the window stays open and L holds.
    min_samples: int = 16
    #: A window closes at once with this many samples (memory bound).
    max_samples: int = 4096
    #: Share of the objective the engine's 90th-percentile time to first token may take.
    engine_share: float = 0.5
    #: L grows only while that percentile is under ``comfort`` times the engine's share.
    comfort: float = 0.75
    #: The most one decrease can cut: L never falls below this fraction of itself in one step.
    min_decrease_factor: float = 0.5
    #: Additive increase: ``max(1, floor(L * increase_share))`` per window.
    increase_share: float = 0.05
    #: Recovery while the limit is not in use: at most this factor per window.
    recovery_factor: float = 2.0
    #: A level that proved too high is not tried again for this long.
    probe_seconds: float = 30.0
    #: A ceiling that no probe has confirmed caps the increase this long; each failed probe
    #: doubles it, up to ``probe_seconds``.
    first_probe_seconds: float = 2.0
    #: A window this old whose limit is in use but that holds too few samples, none of them
    #: overdue, closes as comfortable: the slots are held by requests past their first output.
    starve_seconds: float = 3.0
    #: One finished request's hold counts at most this many times the mean so far (rule 5).
    hold_outlier: float = 4.0
    #: Weight of each new hold time in the start-rate estimate.
    hold_smoothing: float = 0.05

    def __post_init__(self) -> None:
        checks = {
            "window_seconds": self.window_seconds > 0,
            "min_samples": self.min_samples >= 1,
            "max_samples": self.max_samples >= self.min_samples,
            "engine_share": 0 < self.engine_share <= 1,
            "comfort": 0 < self.comfort < 1,
            "min_decrease_factor": 0 < self.min_decrease_factor < 1,
            "increase_share": 0 <= self.increase_share < 1,
            "recovery_factor": self.recovery_factor >= 1,
            "probe_seconds": self.probe_seconds >= 0,
            "first_probe_seconds": 0 <= self.first_probe_seconds <= self.probe_seconds,
            "starve_seconds": self.starve_seconds >= self.window_seconds,
            "hold_outlier": self.hold_outlier >= 1,
            "hold_smoothing": 0 < self.hold_smoothing <= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SloTuning.{name} out of range: {getattr(self, name)!r}")


def percentile(ordered: list[float], share: float) -> float:
    """The nearest-rank ``share`` quantile (0 < share <= 1) of an ascending, non-empty list."""
    rank = max(1, math.ceil(share * len(ordered)))
    return ordered[rank - 1]


class SloController:
    """The effective limit L and the early-refusal bound B for one gate (rules at the top).

    Args:
        objective: S, seconds (> 0): the time-to-first-token objective.
        max_limit: N (>= 1): L never exceeds it, and starts there.
        min_limit: The floor of L (1 <= min_limit <= N).
        now: The time the controller starts (its first window opens then).
        tuning: The law's constants.

    Raises:
        ValueError: An argument out of range.
    """

    __slots__ = (
        "_binding",
        "_ceiling",
        "_ceiling_life",
        "_ceiling_since",
        "_engine_samples",
        "_failed_level",
        "_hold",
        "_limit_since",
        "_peak_running",
        "_pending",
        "_raised_from",
        "_start_rate",
        "_total_samples",
        "_window_start",
        "engine_ttft_p50",
        "engine_ttft_p90",
        "limit",
        "max_limit",
        "min_limit",
        "objective",
        "queue_bound",
        "ttft_p90",
        "tuning",
        "windows",
    )

    def __init__(
        self,
        *,
        objective: float,
        max_limit: int,
        min_limit: int = 1,
        now: float,
        tuning: SloTuning | None = None,
    ) -> None:
        if not (objective > 0 and math.isfinite(objective)):
            raise ValueError(f"objective must be a finite number of seconds > 0, got {objective}")
        if max_limit < 1:
            raise ValueError(f"max_limit must be >= 1, got {max_limit}")
        if not 1 <= min_limit <= max_limit:
            raise ValueError(f"min_limit must be in [1, {max_limit}], got {min_limit}")
        #: S, seconds.
        self.objective: Final = objective
        #: N.
        self.max_limit: Final = max_limit
        self.min_limit: Final = min_limit
        self.tuning: Final = tuning if tuning is not None else SloTuning()
        #: L in force.
        self.limit = max_limit
        #: B: an arrival that would queue behind this many requests or more is refused.
        self.queue_bound = UNBOUNDED_QUEUE
        #: Percentiles of the last closed window (seconds; NaN before the first).
        self.engine_ttft_p50 = math.nan
        self.engine_ttft_p90 = math.nan
        self.ttft_p90 = math.nan
        #: Windows closed so far.
        self.windows = 0
        self._window_start = now
        self._engine_samples: list[float] = []
        self._total_samples: list[float] = []
        self._binding = False
        self._peak_running = 0
        self._ceiling: int | None = None
        self._ceiling_since = now
        self._ceiling_life = self.tuning.first_probe_seconds
        # The last level a probe found too high (None: none lately): increases toward the
        # gradient stop below it, and only single steps probe it again.
        self._failed_level: int | None = None
        self._hold: float | None = None
        self._limit_since = now
        # Requests in the engine without a first output yet, oldest start first (a dict keeps
        # insertion order, and starts are observed in time order).
        self._pending: dict[object, float] = {}
        #: L before the last window's increase; None when the last window did not raise it.
        self._raised_from: int | None = None
        # r = L / hold when the last window closed (rule 6; None before the first hold).
        self._start_rate: float | None = None

    # -- observations ---------------------------------------------------------------------------

    def observe_backlog(self) -> None:
        """An arrival had to wait in the queue, or was refused for want of room: the limit is
        in use in this window."""
        self._binding = True

    def observe_start(self, request: object, *, started: float, running: int = 0) -> None:
        """A request entered the engine; until its first output it is an open sample (rule 2).

        Args:
            request: Any hashable token that names the request in the later calls.
            started: When it entered the engine.
            running: Requests in the engine with it (the most in a window is what a decrease
                starts from when the limit was not reached).
        """
        self._pending[request] = started
        if running > self._peak_running:
            self._peak_running = running

    def observe_first_output(
        self, request: object, *, arrived: float, started: float, first_output: float
    ) -> None:
        """A request produced its first output: one sample (rule 2).

        Args:
            request: The token given to :meth:`observe_start`.
            arrived: When it arrived: at the frontend, when the frontend said how long the
                request spent there before the gate, else at the gate (rule 2).
            started: When it entered the engine (``>= arrived``).
            first_output: When the engine produced its first output (``>= started``).
        """
        self._pending.pop(request, None)
        if started < self._limit_since or len(self._engine_samples) >= self.tuning.max_samples:
            return
        self._engine_samples.append(max(0.0, first_output - started))
        self._total_samples.append(max(0.0, first_output - arrived))

    def observe_finish(self, request: object, *, started: float, finished: float) -> None:
        """A request left the engine after holding its slot from ``started`` (rule 5).

        One that never produced a first output (cancelled, failed) is no sample: its open
        sample is dropped.
        """
        self._pending.pop(request, None)
        hold = max(0.0, finished - started)
        if self._hold is None:
            self._hold = hold
        else:
            # Rule 5: one very long request (a max_tokens of thousands) moves the mean as a few
            # ordinary ones would, not enough to close the queue for everyone else.
            hold = min(hold, self.tuning.hold_outlier * self._hold)
            self._hold += self.tuning.hold_smoothing * (hold - self._hold)

    # -- decisions ------------------------------------------------------------------------------

    @property
    def hold_seconds(self) -> float | None:
        """The smoothed time a request holds its slot; ``None`` before the first finish."""
        return self._hold

    @property
    def queue_deadline(self) -> float:
        """Seconds a request may wait in the queue (rule 7)."""
        median = self.engine_ttft_p50
        if math.isnan(median):
            return self.objective
        return max(0.0, self.objective - median)

    @property
    def ceiling(self) -> int | None:
        """The level last found too high, while it still caps the increase."""
        return self._ceiling

    def update(self, now: float) -> bool:
        """Close the window if it is due (rule 3) and apply the law (rule 4).

        Cheap when no window is due (two comparisons), so the gate's state may call it on every
        event (:meth:`~worker_ingress._admission_state.AdmissionState.tick`).

        Args:
            now: The current time, on the clock of the other calls.

        Returns:
            Whether L or B changed.
        """
        tuning = self.tuning
        if now - self._window_start < tuning.window_seconds and (
            len(self._engine_samples) < tuning.max_samples
        ):
            return False
        overdue = self._overdue(now)
        starved = False
        if len(self._engine_samples) + len(overdue) < tuning.min_samples:
            # Rule 3: too few samples hold L, unless the limit is in use, nothing in the engine
            # is late for its first output, and that has lasted: then the slots are held by
            # requests past their first output, which no sample will ever show.
            starved = (
                self._binding and not overdue and now - self._window_start >= tuning.starve_seconds
            )
            if not starved:
                return False
        before = (self.limit, self.queue_bound)
        if self._ceiling is not None and now - self._ceiling_since >= self._ceiling_life:
            self._ceiling = None
        if starved:
            self.limit = self._starved_limit()
        else:
            engine = sorted(self._engine_samples + overdue)
            self.engine_ttft_p50 = percentile(engine, 0.5)
            self.engine_ttft_p90 = percentile(engine, 0.9)
            if self._total_samples:
                self.ttft_p90 = percentile(sorted(self._total_samples), 0.9)
            self.limit = self._next_limit(self.engine_ttft_p90, now)
        if self.limit != before[0]:
            # Whatever started before now was admitted under the old L: not a sample of the new.
            self._limit_since = now
            self._pending.clear()
        self.queue_bound = self._bound()
        self.windows += 1
        self._window_start = now
        self._engine_samples = []
        self._total_samples = []
        self._binding = False
        self._peak_running = 0
        return (self.limit, self.queue_bound) != before

    # -- internals ------------------------------------------------------------------------------

    def _next_limit(self, p90: float, now: float) -> int:
        tuning = self.tuning
        limit = self.limit
        raised_from, self._raised_from = self._raised_from, None
        target = tuning.engine_share * self.objective
        if p90 > target:
            # The first decrease from N (no level known to be too high yet) goes straight to the
            # gradient: the first seconds of an overload are not spent halving from N.
            first = limit == self.max_limit and self._ceiling is None and raised_from is None
            least = tuning.min_decrease_factor ** (3 if first else 1)
            factor = max(least, target / p90)
            # The epsilon keeps a float such as 0.15 / 0.2 = 0.7499... from costing a whole step.
            # From what ran, when that stayed under L (cutting an unused limit changes nothing),
            # but never below the largest cut of one step.
            used = min(limit, self._peak_running) if self._peak_running else limit
            cut = max(math.floor(limit * least), math.floor(used * factor + 1e-9))
            lowered = max(self.min_limit, min(limit - 1, cut))
            top = limit
            if raised_from is not None:
                # A failed probe: back to the level it left, which was fine a window ago, and
                # nothing above that is tried until the next probe (the step may have jumped
                # over levels never measured). A load that has grown meanwhile is cut next.
                lowered = max(self.min_limit, min(raised_from, limit - 1))
                top = raised_from + 1
                # The level above is confirmed too high once more: probed less often.
                self._ceiling_life = min(tuning.probe_seconds, 2 * self._ceiling_life)
                self._failed_level = limit
            if lowered < limit:
                self._ceiling = top
                self._ceiling_since = now
            return lowered
        comfortable = tuning.comfort * target
        if p90 > comfortable:
            return limit
        ceiling = self._ceiling
        failed = self._failed_level
        if failed is not None and limit >= failed:
            # Comfortable at or above the level that failed: the load has changed.
            self._failed_level = failed = None
        if not self._binding:
            self._failed_level = None
            self._ceiling = None
            self._ceiling_life = tuning.first_probe_seconds
            raised = min(self.max_limit, max(limit + 1, math.ceil(limit * tuning.recovery_factor)))
        else:
            # Toward the level where the engine would just be comfortable (at most
            # proportionally slower there), by at least the additive step and at most the
            # recovery factor.
            step = limit + max(1, math.floor(limit * tuning.increase_share))
            toward = math.floor(limit * comfortable / p90) if p90 > 0 else self.max_limit
            most = math.ceil(limit * tuning.recovery_factor)
            if failed is not None:
                toward = limit  # a probe failed at this load: single steps only
            raised = min(self.max_limit, most, max(step, toward))
            if ceiling is not None:
                raised = min(raised, max(limit, ceiling - 1))
        if raised > limit:
            self._raised_from = limit
        return raised

    def _starved_limit(self) -> int:
        # Rule 3: a starved window raises L by the additive step, under a fresh ceiling.
        limit = self.limit
        raised = min(self.max_limit, limit + max(1, math.floor(limit * self.tuning.increase_share)))
        if self._ceiling is not None and self._ceiling - 1 > limit:
            raised = min(raised, self._ceiling - 1)
        elif self._ceiling is not None:
            # The ceiling was set by what the requests holding the slots now did: no evidence
            # about the level above, so one step is tried.
            self._ceiling = None
        self._raised_from = None
        return raised

    def _overdue(self, now: float) -> list[float]:
        # Open samples already past the engine's share of S: whatever their first output will
        # be, it is late, and waiting for it would only delay the decision.
        horizon = now - self.tuning.engine_share * self.objective
        ages: list[float] = []
        for started in self._pending.values():
            if started >= horizon or len(ages) >= self.tuning.max_samples:
                break
            ages.append(now - started)
        return ages

    def queue_bound_after(self, waited: float) -> int:
        """B for an arrival that already spent ``waited`` seconds of S before the gate (rule 6
        with ``S - waited``, on the ``r`` and ``e`` of the last closed window); at most B."""
        if waited <= 0:
            return self.queue_bound
        return self._bound(self.objective - waited)

    def _bound(self, objective: float | None = None) -> int:
        if objective is None:
            hold = self._hold
            self._start_rate = None if hold is None or hold <= 0 else self.limit / hold
            objective = self.objective
        rate = self._start_rate
        if rate is None:
            return UNBOUNDED_QUEUE
        engine = 0.0 if math.isnan(self.engine_ttft_p90) else self.engine_ttft_p90
        room = (objective - engine) * rate
        if room <= 0:
            return 0
        z = _Z90
        starts = ((math.sqrt(z * z + 4 * room) - z) / 2) ** 2
        # At least one: a request ready in the dispatcher's hand keeps the engine from idling
        # between a finish and the next arrival; the deadline refuses it if its wait runs out.
        return min(UNBOUNDED_QUEUE, max(1, math.floor(starts + 1e-9)))
