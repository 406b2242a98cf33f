"""Per-CTA timelines of the routed-MoE w13 -> w2 pair: records parsed, phases summarised, overlap.

The timeline builds (kernels/moe_timeline.py) have thread 0 of each CTA write a record of
mk.TIMELINE_RECORD_BYTES: [smid u32, pad] then per mk.TIMELINE_EVENTS (%globaltimer ns u64,
%clock64 u64). An event a CTA never reached (no item: the landed / epilogue events) stays 0 (the
buffer is zeroed before the launch) and is left out of every statistic. NumPy only: the
devicecheck case (executor/moe_chain.py) downloads the records and calls `summarise`; the CPU
test feeds it synthetic ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from executor import timeline
from kernels import moe_kernel_ref as mk

EVENTS = mk.TIMELINE_EVENTS
LAYOUT = timeline.Layout(smid_word=0, pairs_word=2, smid_bits=32)   # [smid u32, pad], pairs
assert LAYOUT.words(len(EVENTS)) == mk.TIMELINE_RECORD_BYTES // 8
# Phases: (name, from event, to event).
PHASES = (("prologue", "entry", "wait_begin"), ("wait", "wait_begin", "wait_end"),
          ("first_load", "wait_end", "first_landed"), ("stream", "first_landed", "last_landed"),
          ("tail", "last_landed", "epilogue"), ("epilogue", "epilogue", "exit"),
          ("total", "entry", "exit"))


@dataclass(frozen=True)
class Records:
    """One kernel's records: smid [n], globaltimer ns [n, events], clock64 [n, events] (int64;
    0 = not reached)."""

    name: str
    smid: np.ndarray
    ns: np.ndarray
    clock: np.ndarray

    @classmethod
    def parse(cls, name: str, raw: np.ndarray, ctas: int) -> Records:
        """raw: the stamps buffer's bytes (at least ctas records)."""
        need = ctas * mk.TIMELINE_RECORD_BYTES
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        if raw.size < need:
            raise ValueError(f"{name}: {raw.size} bytes of stamps, need {ctas} records of "
                             f"{mk.TIMELINE_RECORD_BYTES} B = {need}")
        words = raw[:need].view(np.int64).reshape(ctas, mk.TIMELINE_RECORD_BYTES // 8)
        return cls(name, *LAYOUT.decode(words, EVENTS, name, complete=False))

    def event(self, name: str) -> np.ndarray:
        """ns of `name` per CTA, NaN where not reached."""
        t = self.ns[:, EVENTS.index(name)].astype(np.float64)
        return np.where(t > 0, t, np.nan)

    def cycles(self, name: str) -> np.ndarray:
        c = self.clock[:, EVENTS.index(name)].astype(np.float64)
        return np.where(self.ns[:, EVENTS.index(name)] > 0, c, np.nan)


def spread(values) -> dict:
    """p10 / median / p90 / n of the finite values (NaN-filled when there are none)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"p10": float("nan"), "median": float("nan"), "p90": float("nan"), "n": 0}
    p10, med, p90 = np.percentile(v, [10, 50, 90])
    return {"p10": float(p10), "median": float(med), "p90": float(p90), "n": int(v.size)}


def _extent(values) -> dict:
    """`spread` plus min and max (NaN when nothing is finite)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    lo, hi = (float(v.min()), float(v.max())) if v.size else (float("nan"), float("nan"))
    return spread(v) | {"min": lo, "max": hi}


def timer_resolution_ns(kernels) -> float:
    """The smallest positive step between distinct %globaltimer values of all stamps (its
    update period when enough stamps fall in successive ticks; NaN with < 2 distinct)."""
    ticks = timeline.timer_ticks(np.concatenate([k.ns[k.ns > 0].reshape(-1) for k in kernels]))
    return float(ticks[1]) if ticks else float("nan")


def summarise(w13: Records, w2: Records) -> dict:
    """Per kernel: each phase's duration across CTAs (us, by %globaltimer; and cycles by
    %clock64, exact within a CTA) and each event's time from the pair's first entry (us); the
    overlap: w2 CTAs that entered before w13's last exit, how long the two overlapped, and the
    timer's resolution and the SM clock the stamps imply."""
    t0 = np.nanmin(np.concatenate([w13.event("entry"), w2.event("entry")]))
    out = {"timer_resolution_ns": timer_resolution_ns([w13, w2]), "kernels": {}}
    for rec in (w13, w2):
        phases = {name: spread((rec.event(b) - rec.event(a)) / 1e3) for name, a, b in PHASES}
        cycles = {name: spread(rec.cycles(b) - rec.cycles(a)) for name, a, b in PHASES}
        at = {e: _extent((rec.event(e) - t0) / 1e3) for e in EVENTS}
        dt = rec.event("exit") - rec.event("entry")
        dc = rec.cycles("exit") - rec.cycles("entry")
        ghz = spread(np.where(dt >= 5000, dc / dt, np.nan))["median"]   # >= 5 us: timer ticks
        out["kernels"][rec.name] = {"ctas": int(rec.smid.size),
                                    "sms": int(np.unique(rec.smid).size),
                                    "phases_us": phases, "phases_cycles": cycles,
                                    "events_us": at, "sm_clock_ghz": ghz}
    w13_end = np.nanmax(w13.event("exit"))
    w2_in = w2.event("entry")
    early = w2_in < w13_end
    out["overlap"] = {
        "w13_last_exit_us": float((w13_end - t0) / 1e3),
        "w2_first_entry_us": float((np.nanmin(w2_in) - t0) / 1e3),
        "w2_ctas_entered_under_w13": int(early.sum()),
        "w2_ctas": int(w2_in.size),
        "overlap_us": float(max(0.0, (w13_end - np.nanmin(w2_in)) / 1e3)),
        "w2_wait_us": spread((w2.event("wait_end") - w2.event("wait_begin")) / 1e3),
        "w2_sms_shared_with_w13": int(np.intersect1d(w2.smid[early], w13.smid).size),
    }
    return out


def metric_lines(label: str, summary: dict) -> list[tuple[str, float, str]]:
    """(metric, value, unit) rows for the devicecheck table: each phase's median [p10, p90] as
    three rows would flood it, so median and p90 of each phase, the overlap, the timer."""
    rows = [(f"{label}: %globaltimer resolution", summary["timer_resolution_ns"], "ns")]
    for name, k in summary["kernels"].items():
        for phase, s in k["phases_us"].items():
            what = f"{label} {name} {phase} median (p10..p90 {s['p10']:.2f}..{s['p90']:.2f})"
            rows.append((what, s["median"], "us"))
        rows.append((f"{label} {name} last exit", k["events_us"]["exit"]["max"], "us"))
    ov = summary["overlap"]
    rows += [(f"{label}: w2 CTAs entered under w13 (of {ov['w2_ctas']})",
              ov["w2_ctas_entered_under_w13"], "ctas"),
             (f"{label}: w13 -> w2 overlap", ov["overlap_us"], "us")]
    return rows
