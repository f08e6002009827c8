"""The one timing runner of the benchmarks: candidates measured interleaved, A B A B ...

Every benchmark compares candidates (the ring against a single-process kernel, a compiled call
against the eager one, one exchange against another) whose times are only meaningful as ratios
within one run on one machine: the load of a shared machine comes and goes within seconds, and a
GPU's clocks and caches drift. So the candidates are run in rounds, each round calling every
candidate once in a fixed order (``A B C A B C ...``), and each candidate's statistics come from
the same rounds: a disturbance that lasts a round touches all of them.

API (seconds throughout):

- :func:`interleave` ``(candidates, rounds, warmup=0, *, before=None, clock=None)`` runs
  ``warmup`` rounds that are not recorded, then ``rounds`` recorded ones, and returns
  :class:`Samples`: per candidate the time of every recorded call (``times``), its process CPU
  seconds (``cpu``, all threads) and the floats the call returned as a mapping (``extra``, e.g. the
  time of its forward or inside its kernel). A candidate is a callable of no arguments, or a
  :class:`Candidate` whose ``setup`` runs untimed before each call and gives its arguments.
  ``before`` runs untimed before every call (``torch.distributed.barrier`` in rank processes, so
  every rank starts the call together).
- :func:`measure` ``(fn, warmup, repeat, ...)``: one candidate's times (:func:`interleave` of one).
- Clocks: :class:`WallClock` (``time.perf_counter``, the default) and :class:`CudaClock` (CUDA
  events recorded around the call, the device synchronised after it, so the time is the
  device's and includes the host's launches); :func:`clock_for` picks one for a device.
- :func:`summarize` ``(times, baseline=None)``: per candidate :class:`Stats`: count, fastest,
  median, slowest, spread (``(slowest - fastest) / median``) and, with a named ``baseline``
  measured in the same run, the ratios of the median and of the fastest to the baseline's.
- :func:`timing_row` ``(config, slowest)``: a configuration's row of a report: its fastest and
  median round (``time``, ``time_median``), their spread and every round's time.
- :func:`across_ranks` ``(per_rank, reduce=max)``: per recorded round, one value over the ranks
  (``max``: the slowest rank, the time of a collective call; ``sum``: work summed over ranks).
- :func:`write_json` ``(path, data)``: the ``--json`` output of a benchmark, written atomically
  (its directory created).

Nothing here is a timed assertion: the benchmarks print and write figures.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

__all__ = [
    "Candidate",
    "Clock",
    "CudaClock",
    "Samples",
    "Stats",
    "WallClock",
    "across_ranks",
    "clock_for",
    "cuda_median_ms",
    "interleave",
    "measure",
    "median",
    "summarize",
    "timing_row",
    "write_json",
]


class Clock(Protocol):
    """Times one call: ``start()`` just before it, ``stop()`` just after, in seconds."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


class WallClock:
    """Host wall time (``time.perf_counter``): CPU work is synchronous, so the call's own time."""

    def __init__(self) -> None:
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self._t0


class CudaClock:
    """CUDA events recorded on the current stream around the call; ``stop`` synchronises the
    device, so the time is the device's for the call, the host's launches included."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._events: tuple[Any, Any] | None = None

    def start(self) -> None:
        cuda = self._torch.cuda
        # Work queued before the call is not the call's: the device is idle when it starts.
        cuda.synchronize()
        self._events = (cuda.Event(enable_timing=True), cuda.Event(enable_timing=True))
        self._events[0].record()

    def stop(self) -> float:
        assert self._events is not None, "CudaClock.stop() without start()"
        start, stop = self._events
        stop.record()
        self._torch.cuda.synchronize()
        return start.elapsed_time(stop) / 1e3


def clock_for(device: Any = None) -> Clock:
    """:class:`CudaClock` for a CUDA device (a ``torch.device`` or its name), else
    :class:`WallClock`."""
    kind = getattr(device, "type", None) or str(device or "cpu").split(":")[0]
    return CudaClock() if kind == "cuda" else WallClock()


@dataclass(frozen=True)
class Candidate:
    """A timed ``fn(*setup())``: ``setup`` (untimed, before every call) makes its arguments, e.g.
    fresh leaves of the inputs for a forward + backward."""

    fn: Callable[..., Any]
    setup: Callable[[], Sequence[Any]] | None = None


@dataclass
class Samples:
    """What :func:`interleave` recorded, per candidate name, one entry per recorded round."""

    times: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def stats(self, baseline: str | None = None) -> dict[str, Stats]:
        """:func:`summarize` of the times."""
        return summarize(self.times, baseline)

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts and lists: what a rank process returns to the driver."""
        return asdict(self)


def interleave(
    candidates: Mapping[str, Callable[[], Any] | Candidate],
    rounds: int,
    warmup: int = 0,
    *,
    before: Callable[[], Any] | None = None,
    clock: Clock | None = None,
) -> Samples:
    """``warmup`` unrecorded rounds, then ``rounds`` recorded ones; every round calls each
    candidate once, in the mapping's order.

    A call is timed by ``clock`` (:class:`WallClock` by default) from just before to just after
    the candidate; ``before`` and a :class:`Candidate`'s ``setup`` run untimed before it. The
    process CPU seconds of the call are recorded beside its time. A call that returns a mapping
    adds its values to ``extra[name][key]`` (recorded rounds only). An exception in a candidate
    propagates: a benchmark does not report a comparison with a candidate missing.
    """
    if rounds < 0 or warmup < 0:
        raise ValueError(f"rounds and warmup must be >= 0, got {rounds}, {warmup}")
    clock = clock or WallClock()
    samples = Samples(
        times={name: [] for name in candidates},
        cpu={name: [] for name in candidates},
        extra={name: {} for name in candidates},
    )
    for round_ in range(warmup + rounds):
        recorded = round_ >= warmup
        for name, candidate in candidates.items():
            fn, setup = (
                (candidate.fn, candidate.setup)
                if isinstance(candidate, Candidate)
                else (candidate, None)
            )
            args = tuple(setup()) if setup is not None else ()
            if before is not None:
                before()
            cpu0 = time.process_time()
            clock.start()
            result = fn(*args)
            elapsed = clock.stop()
            cpu = time.process_time() - cpu0
            del args
            if not recorded:
                continue
            samples.times[name].append(elapsed)
            samples.cpu[name].append(cpu)
            if isinstance(result, Mapping):
                for key, value in result.items():
                    samples.extra[name].setdefault(key, []).append(float(value))
    return samples


def measure(
    fn: Callable[[], Any] | Candidate,
    warmup: int,
    repeat: int,
    *,
    before: Callable[[], Any] | None = None,
    clock: Clock | None = None,
) -> list[float]:
    """Seconds of ``repeat`` recorded calls of one candidate after ``warmup`` unrecorded ones."""
    return interleave({"fn": fn}, repeat, warmup, before=before, clock=clock).times["fn"]


def cuda_median_ms(fn: Callable[[], Any], warmup: int, repeat: int) -> float:
    """Median milliseconds of ``repeat`` calls of ``fn`` after ``warmup``, each timed with CUDA
    events (:class:`CudaClock`)."""
    return median(measure(fn, warmup, repeat, clock=CudaClock())) * 1e3


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


@dataclass(frozen=True)
class Stats:
    """One candidate's recorded times (seconds): ``spread`` is ``(max - min) / median``; the
    ratios are to the baseline's median and fastest (None without a baseline)."""

    n: int
    min: float
    median: float
    max: float
    spread: float
    ratio: float | None = None
    ratio_min: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    times: Mapping[str, Sequence[float]], baseline: str | None = None
) -> dict[str, Stats]:
    """Per candidate the :class:`Stats` of its times; with ``baseline`` (a name in ``times``,
    measured in the same rounds), the ratios of each candidate's median and fastest to it."""
    if baseline is not None and baseline not in times:
        raise KeyError(f"baseline {baseline!r} is not a candidate: {sorted(times)}")
    base = None
    if baseline is not None:
        base = (median(times[baseline]), min(times[baseline]))
    out = {}
    for name, values in times.items():
        if not values:
            raise ValueError(f"candidate {name!r} has no recorded times")
        mid, lo, hi = median(values), min(values), max(values)
        out[name] = Stats(
            n=len(values),
            min=lo,
            median=mid,
            max=hi,
            spread=(hi - lo) / mid if mid > 0 else 0.0,
            ratio=mid / base[0] if base else None,
            ratio_min=lo / base[1] if base else None,
        )
    return out


def timing_row(config: Any, slowest: list[float]) -> dict[str, Any]:
    """The timing of one configuration in a benchmark's rows, its other figures to be added:
    ``config``, the fastest (``time``, the least disturbed round, the one reported) and median
    (``time_median``) of ``slowest`` (per recorded round, the slowest rank's seconds), their
    ``spread``, and ``times``: ``slowest`` itself."""
    stats = summarize({"time": slowest})["time"]
    return {
        "config": config,
        "time": stats.min,
        "time_median": stats.median,
        "spread": stats.spread,
        "times": slowest,
    }


def across_ranks(
    per_rank: Sequence[Sequence[float]], reduce: Callable[[Sequence[float]], float] = max
) -> list[float]:
    """Per recorded round, ``reduce`` over the ranks' values of that round: with ``max`` the
    slowest rank (a collective call ends when its slowest rank does), with ``sum`` the ranks'
    work together."""
    lengths = {len(values) for values in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks recorded different numbers of rounds: {sorted(lengths)}")
    return [reduce(list(column)) for column in zip(*per_rank)]


def write_json(path: str, data: Any) -> None:
    """``data`` as JSON at ``path``, its directory created; written to a temporary file and
    renamed, so a reader never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
