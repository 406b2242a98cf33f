"""The setup the emulated DSpark round tests share: the tiny synthetic checkpoint's reference model
and caches beside emulated ranks that hold the DSpark buffers."""
from __future__ import annotations

from ref_model import tiny_checkpoint

from executor.emulate.ranks import EmulatedRanks
from executor.reference.kvcache import KVCaches
from executor.reference.step import ReferenceModel
from executor.reference.weights import rank_weights_from_checkpoint


class EmulatedDSparkRanks:
    """A fresh reference model at `tp` over the tiny synthetic checkpoint, its caches (`max_seqs`
    state lines of 128 positions) and `tp` emulated ranks with the DSpark buffers, wired with
    `modules` (None: the ranks' default stage modules). Subclasses wire the plans they test."""

    def __init__(self, bundle_dir, tp: int, max_seqs: int, modules=None):
        self.ckpt = ckpt = tiny_checkpoint()
        self.cfg = cfg = ckpt.config
        self.model = ReferenceModel(
            cfg, tuple(rank_weights_from_checkpoint(ckpt, tp, r) for r in range(tp)))
        self.caches = KVCaches.allocate(cfg, max_seqs=max_seqs, max_context=128)
        self.ranks = EmulatedRanks(ckpt, bundle_dir, tp, self.caches, modules=modules,
                                   dspark=True)
