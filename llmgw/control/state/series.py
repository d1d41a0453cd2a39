"""
Curves of the last hour in bounded memory (DESIGN §21): plain data, no
clock and no I/O; L{llmgw.control.shell.series} samples into them.

A L{SeriesFamily} holds a few metrics for a bounded set of names (models,
nodes, API keys): one ring of sample times, and per name one fixed-size
ring of values per metric, all written at the same slot. A sample may be
written in parts over several reactor turns (L{SeriesFamily.begin},
L{SeriesFamily.write}, L{SeriesFamily.commit}); readers see it only once
it is committed, whole. Memory is fixed
by the number of points and the cap on names whatever is reported: a name
past the cap is folded into an C{other} name (for the metrics that add up)
or left out, and a name that got no value for a whole window is dropped.

The helpers below turn what gateways and agents report (counters that only
grow, histogram buckets) into what is drawn: rates per second and
quantiles over the last step.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping, Sequence

#: Seconds between two samples.
STEP_S = 10.0
#: Seconds of curves kept.
KEEP_S = 3600.0
#: The name past-the-cap names are summed into, where the family has one.
OTHER = "_other"

Values = Sequence[float | None]


def points_for(keep_s: float, step_s: float) -> int:
    """
    How many points a ring holds so that it spans C{keep_s} seconds at
    one point every C{step_s}: both ends included.
    """
    if step_s <= 0 or keep_s < step_s:
        raise ValueError(f"keep {keep_s} s must be at least one step ({step_s} s), and the step above 0")
    return int(math.ceil(keep_s / step_s)) + 1


class _Pass:
    """A family's sample being written: its time and slot, what it wrote so far."""

    __slots__ = ("t", "slot", "seen", "new", "folded")

    def __init__(self, t: float, slot: int):
        self.t = t
        self.slot = slot
        #: Names written, each with the tick it is written at.
        self.seen: dict[str, int] = {}
        #: Rings of names new in this sample, held aside until it is published.
        self.new: dict[str, tuple[array, ...]] = {}  # type: ignore[type-arg]
        #: The additive metrics' sums of names past the cap.
        self.folded: list[float | None] | None = None


class SeriesFamily:
    """
    Rings of C{points} values for each of C{metrics}, per name, sampled at
    shared times; at most C{max_names} names.

    Values are stored as C{typecode} (C{array}'s codes): C{"f"} floats, or
    an unsigned code with C{scale} (a value v is kept as C{round(v *
    scale)}, clamped to the code's range; its top value means "no value"),
    which halves the memory of curves that need no more precision, such
    as a percentage in hundredths.

    @param other: the name names past the cap are folded into, summing the
        C{additive} metrics (the others get no value there); C{None}: they
        are left out.
    """

    def __init__(self, metrics: Sequence[str], points: int, max_names: int, typecode: str = "f",
                 scale: float = 1.0, other: str | None = OTHER, additive: Iterable[str] | None = None):
        if points < 2 or max_names < 1:
            raise ValueError("a family holds at least two points and one name")
        self.metrics = tuple(metrics)
        self.points = points
        self.max_names = max_names
        self.typecode = typecode
        self.scale = scale
        self.other = other
        add = set(self.metrics if additive is None else additive)
        self._additive = tuple(m in add for m in self.metrics)
        self._float = typecode in ("f", "d")
        self._missing: float | int = math.nan
        self._top = 0
        if not self._float:
            self._top = 2 ** (8 * array(typecode).itemsize) - 2
            self._missing = self._top + 1
        #: Sample times, ring-ordered like every value ring.
        self.times = array("d", [math.nan]) * points
        self._ticks = 0
        self._rings: dict[str, tuple[array, ...]] = {}  # type: ignore[type-arg]
        self._last: dict[str, int] = {}
        #: Names refused (left out or folded) since the family was made.
        self.refused = 0
        self._pass: _Pass | None = None

    # -- writing ------------------------------------------------------------------------

    @property
    def slot(self) -> int:
        """The slot of the newest sample (-1 before any)."""
        return (self._ticks - 1) % self.points if self._ticks else -1

    def _blank(self) -> tuple[array, ...]:  # type: ignore[type-arg]
        blank = array(self.typecode, [self._missing])
        return tuple(blank * self.points for _ in self.metrics)

    def _ring(self, name: str) -> tuple[array, ...]:  # type: ignore[type-arg]
        rings = self._rings[name] = self._blank()
        return rings

    def _encode(self, value: float) -> float | int:
        if self._float:
            return value
        return min(max(round(value * self.scale), 0), self._top)

    def add(self, t: float, rows: Mapping[str, Values]) -> None:
        """
        One sample at time C{t}: for each name, its value per metric (in
        C{metrics}' order; C{None} for none). Names not in C{rows} get no
        value at C{t}; one without a value for C{points} samples is dropped.
        The same as L{begin}, L{write} and L{commit} at once.
        """
        self.begin(t)
        self.write(rows)
        self.commit()

    def begin(self, t: float) -> None:
        """
        Start the sample at time C{t}, to be written by L{write} in as many
        parts as wanted and published by L{commit}. Until then readers see
        the samples before it and nothing of it: the slot it is written
        into (the oldest sample's, once the rings are full) has no time, so
        no reader reads it, and names new in it are held aside. A sample
        begun and not committed is abandoned (L{abandon}).
        """
        if self._pass is not None:
            self.abandon()
        slot = self._ticks % self.points
        self.times[slot] = math.nan
        self._pass = _Pass(t, slot)

    def write(self, rows: Mapping[str, Values]) -> None:
        """
        Part of the sample begun (L{begin}): C{rows} as for L{add}. A name
        written twice keeps its second values.
        """
        p = self._pass
        if p is None:
            raise RuntimeError("a family's sample is written between begin() and commit()")
        slot = p.slot
        rings_by = self._rings
        new = p.new
        seen = p.seen
        tick = self._ticks
        for name, values in rows.items():
            rings = rings_by.get(name) or new.get(name)
            if rings is None:
                if len(rings_by) + len(new) >= self.max_names or name == self.other:
                    self.refused += 1
                    if self.other is not None:
                        folded = p.folded
                        if folded is None:
                            folded = p.folded = [None] * len(self.metrics)
                        for i, v in enumerate(values):
                            if v is not None and self._additive[i]:
                                prev = folded[i]
                                folded[i] = v if prev is None else prev + v
                    continue
                rings = new[name] = self._blank()
            for ring, v in zip(rings, values, strict=True):
                ring[slot] = self._missing if v is None or v != v else self._encode(v)
            seen[name] = tick

    def commit(self) -> None:
        """
        Publish the sample begun (L{begin}) at once: its time, its values,
        its new names; names it did not write get no value at its time, and
        one without a value for C{points} samples is dropped.
        """
        p, self._pass = self._pass, None
        if p is None:
            raise RuntimeError("a family's sample is committed after begin()")
        slot = p.slot
        tick = self._ticks
        rings_by = self._rings
        last = self._last
        seen = p.seen
        rings_by.update(p.new)
        if p.folded is not None and self.other is not None:
            rings = rings_by.get(self.other) or self._ring(self.other)
            for ring, v in zip(rings, p.folded, strict=True):
                ring[slot] = self._missing if v is None else self._encode(v)
            seen[self.other] = tick
        last.update(seen)
        self._ticks += 1
        self.times[slot] = p.t
        if len(last) == len(seen):
            return  # every name was written this time
        gone = []
        missing = self._missing
        for name, at in last.items():
            if at != tick:
                if tick - at >= self.points:
                    gone.append(name)
                else:
                    for ring in rings_by[name]:
                        ring[slot] = missing
        for name in gone:
            del rings_by[name], last[name]

    def abandon(self) -> None:
        """
        Forget the sample begun (L{begin}), if any: nothing of it is
        published, and the next sample is written into its slot.
        """
        self._pass = None

    @property
    def writing(self) -> bool:
        """Whether a sample is begun and not yet committed."""
        return self._pass is not None

    # -- reading ------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The names held, sorted."""
        return sorted(self._rings)

    def __len__(self) -> int:
        return len(self._rings)

    def slots_since(self, since: float) -> list[int]:
        """
        The slots of samples taken after C{since}, oldest first.
        """
        if not self._ticks:
            return []
        n = min(self._ticks, self.points)
        first = (self._ticks - n) % self.points
        times = self.times
        slots = [(first + i) % self.points for i in range(n)]
        return [s for s in slots if times[s] > since]

    def _decode(self, raw: float) -> float | None:
        if self._float:
            return None if raw != raw else round(float(raw), 4)
        return None if raw == self._missing else round(raw / self.scale, 4)

    def latest(self, name: str, metric: int = 0) -> float | None:
        """C{name}'s newest value of its C{metric}th metric (C{None}: none)."""
        rings = self._rings.get(name)
        if rings is None or not self._ticks:
            return None
        return self._decode(rings[metric][self.slot])

    def points_of(self, name: str, slots: Sequence[int], times: Sequence[float]) -> dict[str, list[list[float]]]:
        """
        C{name}'s curves at C{slots} (L{slots_since}) as C{{metric: [[t, v],
        ...]}}, C{times} being those slots' times as given to the reader;
        points without a value are left out.
        """
        rings = self._rings.get(name)
        if rings is None:
            return {}
        out: dict[str, list[list[float]]] = {}
        for metric, ring in zip(self.metrics, rings, strict=True):
            pts = []
            for s, t in zip(slots, times, strict=True):
                v = self._decode(ring[s])
                if v is not None:
                    pts.append([t, v])
            out[metric] = pts
        return out

    def read(self, since: float, names: Iterable[str] | None = None) -> dict[str, dict[str, list[list[float]]]]:
        """
        C{{name: {metric: [[t, v], ...]}}} for the samples after C{since},
        for C{names} (default: all held).
        """
        slots = self.slots_since(since)
        times = [compact_time(self.times[s]) for s in slots]
        chosen = self.names() if names is None else [n for n in names if n in self._rings]
        return {n: self.points_of(n, slots, times) for n in chosen}

    def nbytes(self) -> int:
        """The bytes of the rings' values (not counting the objects around them)."""
        per = sum(r.itemsize * len(r) for rings in self._rings.values() for r in rings)
        return per + self.times.itemsize * len(self.times)


def compact_time(t: float) -> float:
    """C{t} to the millisecond, whole seconds as an integer (shorter JSON)."""
    r = round(t, 3)
    return int(r) if r.is_integer() else r


def rates(previous: dict[str, float], totals: Mapping[str, float], dt: float,
          new_from_zero: bool = False) -> dict[str, float]:
    """
    Per second over the last C{dt} seconds, for each counter in C{totals}
    that C{previous} (the totals one step ago) also has, or with
    C{new_from_zero} any (for counters made at their first count, so that
    one new in the step counted from zero); C{previous} then holds
    C{totals}. A counter that went down (its source restarted) counts its
    new total as what happened in the step. No rates for C{dt} 0 (a first
    look).
    """
    out: dict[str, float] = {}
    if dt > 0:
        for name, total in totals.items():
            before = previous.get(name, 0.0 if new_from_zero else None)
            if before is not None:
                delta = total - before if total >= before else total
                out[name] = delta / dt
    previous.clear()
    previous.update(totals)
    return out


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """
    The C{q} quantile (0 to 1) of observations counted per bucket
    (C{counts}, not cumulative, one more than C{bounds}: the last is
    C{+Inf}), interpolated linearly within its bucket as Prometheus's
    C{histogram_quantile} does; the highest bound when it falls in the
    C{+Inf} bucket; C{None} without observations.
    """
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, n in enumerate(counts):
        if n > 0 and seen + n >= rank:
            if i >= len(bounds):
                return bounds[-1] if bounds else None
            lower = bounds[i - 1] if i > 0 else 0.0
            return lower + (bounds[i] - lower) * (rank - seen) / n
        seen += n
    return bounds[-1] if bounds else None


def bucket_deltas(previous: dict[str, list[float]], now: Mapping[str, Sequence[float]],
                  new_from_zero: bool = False) -> dict[str, list[float]]:
    """
    Each histogram's bucket counts added since the last call (C{previous},
    which then holds C{now}). One seen for the first time gives its counts
    with C{new_from_zero} (a histogram made at its first observation),
    else none; one whose counts went down gives none.
    """
    out: dict[str, list[float]] = {}
    for name, counts in now.items():
        before = previous.get(name)
        if before is None and new_from_zero:
            out[name] = list(counts)
        elif before is not None and len(before) == len(counts):
            delta = [a - b for a, b in zip(counts, before, strict=True)]
            if min(delta) >= 0:
                out[name] = delta
    previous.clear()
    previous.update({name: list(counts) for name, counts in now.items()})
    return out
