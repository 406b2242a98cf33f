"""Packing the step benchmark's rank on threads: arena_contents' requests and uploads, faster.

`pack_parallel` packs each (stage module, packed layer) on its own thread (the NumPy work
releases the GIL) through one `SharedFetch` (a tensor several tasks ask for is drawn once), and
puts the pieces back in arena_contents' order, so the arena is laid out and filled the same way
(tests/test_bench_step_cpu.py compares both on tiny, byte for byte). Repeating views (ffn_tiled's
experts) stay views: `repeats` tells the uploader to send one repeat.
"""
from __future__ import annotations

import importlib
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from executor.wiring import arena_contents, packed_layers, weight_prefix

PACK_WORKERS_ENV = "HOPDEC_PACK_WORKERS"   # threads packing the weights (default: every core)
# per-layer packing tasks by module, longest first (one core: a layer's experts ~7 s, an Engram
# layer's mhc ~9 s after PREFETCH, attention ~4 s; a list-scheduling estimate on 16 threads
# gives 13 s this way, 17 s with mhc last)
PACK_ORDER = ("executor.stages.ffn_tiled", "executor.stages.mhc", "executor.stages.attn_proj",
              "executor.stages.attn_index")
# drawn first, each on its own thread: the two largest global tensors (331 MB of bf16 rows each
# on rank 0, ~3 s to draw), which mhc's globals task and every mhc per-layer task ask for first
PREFETCH = ("embed.weight", "head.weight")
# stage modules whose weights() ignore `layers` (global weights only: main_proj, the Markov head):
# packed whole as one task, since their names do not split by layer
WHOLE_MODULES = ("executor.stages.dspark",)
LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


def pack_workers() -> int:
    """PACK_WORKERS_ENV if set (a positive integer), else every core."""
    value = os.environ.get(PACK_WORKERS_ENV, "").strip()
    if not value:
        return os.cpu_count() or 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{PACK_WORKERS_ENV}={value!r}: expected a positive number of threads")
    return int(value)


class SharedFetch:
    """`fetch` for many threads: each name is made once (the first caller makes it, later ones
    wait for it), so what every per-layer task asks for (embed, head) is drawn once. Arrays come
    back read-only: one array may now reach several packers, and none may write it."""

    def __init__(self, fetch):
        self._fetch, self._lock, self._made = fetch, threading.Lock(), {}

    def __call__(self, name: str) -> np.ndarray:
        with self._lock:
            future = self._made.get(name)
            mine = future is None
            if mine:
                future = self._made[name] = Future()
        if mine:
            try:
                array = np.asarray(self._fetch(name)).view()
                array.flags.writeable = False
                future.set_result(array)
            except BaseException as exc:  # noqa: BLE001 - every waiter raises it too
                future.set_exception(exc)
        return future.result()


def pack_parallel(cfg, tp: int, rank: int, fetch, max_rows: int, modules, layer_map,
                  workers: int):
    """`arena_contents(cfg, tp, rank, fetch, max_rows, modules, layer_map)`, the same requests and
    uploads in the same order, with every (module, packed layer) packed on its own thread.

    A stage module's weights(layers=reps) is its globals (those of layers=[]), then each layer's
    arrays in layer order, then any later globals; so each layer is packed alone (layers=[i]:
    its leading globals are dropped, fetched once through SharedFetch; a generator is closed at
    the first global after the layer's arrays, so only that one is made again, e.g. attn_proj's
    first RoPE table, ~2 s) and the pieces are put back in that order. A module that does not
    split so is an error (the CPU test checks the stage modules on tiny); WHOLE_MODULES, whose
    weights are globals only, are packed whole by one task."""
    requests, _ = arena_contents(cfg, tp, rank, fetch, max_rows, (), layer_map)  # checks the map
    mods = [importlib.import_module(name) for name in modules]
    for mod in mods:
        if hasattr(mod, "buffers"):
            requests += [b.request() for b in mod.buffers(cfg, tp, max_rows)]
    reps = set(layer_map.values())
    specs = [s for s in packed_layers(cfg) if s.index in reps or s.is_dspark]
    fetch = SharedFetch(fetch)
    packers = [mod for mod in mods if hasattr(mod, "weights")]
    with ThreadPoolExecutor(workers, thread_name_prefix="pack") as pool:
        try:
            # globals first (the per-layer tasks wait for what they fetch), then longest first
            for name in PREFETCH:
                pool.submit(fetch, name)
            heads = {m: pool.submit(lambda m=m: list(m.weights(cfg, tp, rank, fetch, layers=[])))
                     for m in packers}
            split = [m for m in sorted(packers, key=_pack_order)
                     if m.__name__ not in WHOLE_MODULES]
            parts = {(m, s.index): pool.submit(_layer_part, m, cfg, tp, rank, fetch, s)
                     for m in split for s in specs}
            packed = [item for m in packers for item in (
                _serial_order(m, heads[m].result(),
                              [(s.index, parts[m, s.index].result()) for s in specs])
                if m in split else heads[m].result())]
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    return requests, _layer_slices(requests, packed, layer_map)


def _pack_order(mod) -> int:
    return PACK_ORDER.index(mod.__name__) if mod.__name__ in PACK_ORDER else len(PACK_ORDER)


@dataclass(frozen=True)
class LayerPart:
    """A module's weights(layers=[i]): the names of the globals made before layer i's arrays,
    those arrays, and the first global after them (None: none)."""

    lead: tuple[str, ...]
    arrays: list
    stop: str | None


def _layer_part(mod, cfg, tp: int, rank: int, fetch, spec) -> LayerPart:
    prefix, lead, arrays = weight_prefix(cfg, spec), [], []
    weights = iter(mod.weights(cfg, tp, rank, fetch, layers=[spec.index]))
    for name, array in weights:
        if name.startswith(prefix):
            arrays.append((name, array))
        elif arrays:
            if hasattr(weights, "close"):   # a generator: its later globals are never made
                weights.close()
            return LayerPart(tuple(lead), arrays, name)
        else:
            lead.append(name)
    return LayerPart(tuple(lead), arrays, None)


def _serial_order(mod, heads: list, parts: list[tuple[int, LayerPart]]) -> list:
    """weights(layers=every packed layer) from weights(layers=[]) and the per-layer parts."""
    names = [name for name, _ in heads]
    split = None
    for layer, part in parts:
        if not part.arrays:
            continue
        k = len(part.lead)
        later = names[k] if k < len(names) else None
        if names[:k] != list(part.lead) or part.stop != later or split not in (None, k):
            raise RuntimeError(f"{mod.__name__}.weights(layers=[{layer}]) packs {list(part.lead)}"
                               f" before the layer's arrays and {part.stop!r} after them; its "
                               f"globals are {names}: not globals, one layer's arrays, the rest "
                               f"of the globals (pack it with {PACK_WORKERS_ENV}=1)")
        split = k
    split = len(names) if split is None else split
    return heads[:split] + [item for _, part in parts for item in part.arrays] + heads[split:]


def _layer_slices(requests: list, packed: list, layer_map) -> list:
    """arena_contents' slices: each packed array in its own slice and in those of the layers it
    represents (the same array object); appends the requests, returns the uploads. Repeating
    views stay views (arena_contents makes them contiguous: the same bytes)."""
    copies: dict[int, list[int]] = {}
    for layer, rep in sorted(layer_map.items()):
        if layer != rep:
            copies.setdefault(rep, []).append(layer)
    uploads = []
    for name, array in packed:
        array = array if repeats(array) else np.ascontiguousarray(array)   # see upload_all
        per_layer = LAYER_NAME.fullmatch(name)
        names = [name] if per_layer is None else [
            f"layers.{i}.{per_layer[2]}"
            for i in (int(per_layer[1]), *copies.get(int(per_layer[1]), ()))]
        for slice_name in names:
            requests.append((slice_name, max(array.nbytes, 1),
                             f"{array.dtype} {list(array.shape)}"))
            uploads.append((slice_name, array))
    return uploads


def repeats(array) -> bool:
    """Whether `array` is one block repeated along its first axis (a stride-0 view)."""
    return array.ndim > 1 and array.shape[0] > 1 and array.strides[0] == 0
