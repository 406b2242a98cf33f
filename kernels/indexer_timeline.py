"""Timeline builds of the step's indexer kernels: per-CTA %smid, %globaltimer, %clock64 stamps.

Each class here is a production kernel (kernels/indexer.py, kernels/indexer_topk_cluster.py) with
one more pointer parameter, `stamps`, before its first 32-bit parameter (ik.timeline_twin), passed
to the production body (`run`), which then has thread 0 of each CTA write its stamp row
(ik.TIMELINE_POINTS[kind]). The production kernels call the same body with stamps None, so no
stamp reaches their cubins (byte-identical: checked against the previous build). Built as
"<name>_timeline" (`TIMELINE_OF`: the kernels of the dense ratio-2 chain and of the reindex
chain) and launched only by the devicecheck family attn_timeline (executor/attn_timeline.py).
"""
from __future__ import annotations

from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, cute

from kernels import indexer_kernel_ref as ik
from kernels.indexer import IndexerPrepSm90, IndexerScoresSm90, IndexerTopkSm90
from kernels.indexer_topk_cluster import IndexerTopkCandidatesClusterSm90

# (kind, mode, ratio) of the production kernels that get a timeline twin: the layers 2/8/14 chain
# (prep, scores, top-k entries at ratio 2) and the reindex layers' chain (candidates, ratio 1).
TIMELINE_OF = (("prep", "dense", 2), ("scores", "dense", 2), ("topk", "entries", 2),
               ("prep", "candidates", 1), ("scores", "candidates", 1),
               ("topkc", "candidates", 1))


class IndexerPrepTimelineSm90(IndexerPrepSm90):
    @cute.jit
    def __call__(self, q: cute.Pointer, w_raw: cute.Pointer, positions: cute.Pointer,
                 seq_index: cute.Pointer, cands: cute.Pointer, qfrag: cute.Pointer,
                 qscale: cute.Pointer, qw: cute.Pointer, plan: cute.Pointer,
                 stamps: cute.Pointer, rows: Int32, num_cands: Int32, weight_scale: Float32,
                 stream: cuda.CUstream):
        self.kernel(q, w_raw, positions, seq_index, cands, qfrag, qscale, qw, plan, stamps, rows,
                    num_cands, weight_scale).launch(
            grid=[1, 1, 1], block=list(self.spec.block), smem=self.spec.smem_bytes,
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, q: cute.Pointer, w_raw: cute.Pointer, positions: cute.Pointer,
               seq_index: cute.Pointer, cands: cute.Pointer, qfrag: cute.Pointer,
               qscale: cute.Pointer, qw: cute.Pointer, plan: cute.Pointer, stamps: cute.Pointer,
               rows: Int32, num_cands: Int32, weight_scale: Float32):
        self.run(q, w_raw, positions, seq_index, cands, qfrag, qscale, qw, plan, rows, num_cands,
                 weight_scale, stamps.toint())


class IndexerScoresTimelineSm90(IndexerScoresSm90):
    @cute.jit
    def __call__(self, qfrag: cute.Pointer, qscale: cute.Pointer, qw: cute.Pointer,
                 plan: cute.Pointer, keys: cute.Pointer, block_tables: cute.Pointer,
                 cands: cute.Pointer, seq_index: cute.Pointer, scores: cute.Pointer,
                 stamps: cute.Pointer, rows: Int32, ld: Int32, max_pages: Int32,
                 num_cands: Int32, stream: cuda.CUstream):
        self.kernel(qfrag, qscale, qw, plan, keys, block_tables, cands, seq_index, scores, stamps,
                    rows, ld, max_pages, num_cands).launch(
            grid=[self.spec.max_ctas, 1, 1], block=list(self.spec.block),
            smem=self.spec.smem_bytes, stream=stream, use_pdl=True,
            min_blocks_per_mp=ik.SCORE_CTAS_PER_SM, preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, qfrag: cute.Pointer, qscale: cute.Pointer, qw: cute.Pointer,
               plan: cute.Pointer, keys: cute.Pointer, block_tables: cute.Pointer,
               cands: cute.Pointer, seq_index: cute.Pointer, scores: cute.Pointer,
               stamps: cute.Pointer, rows: Int32, ld: Int32, max_pages: Int32,
               num_cands: Int32):
        self.run(qfrag, qscale, qw, plan, keys, block_tables, cands, seq_index, scores, rows, ld,
                 max_pages, num_cands, stamps.toint())


class IndexerTopkTimelineSm90(IndexerTopkSm90):
    @cute.jit
    def __call__(self, scores: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
                 cands: cute.Pointer, out: cute.Pointer, stamps: cute.Pointer, rows: Int32,
                 ld: Int32, num_cands: Int32, stream: cuda.CUstream):
        self.kernel(scores, positions, seq_index, cands, out, stamps, rows, ld, num_cands).launch(
            grid=[rows, 1, 1], block=list(self.spec.block), smem=self.spec.smem_bytes,
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, scores: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
               cands: cute.Pointer, out: cute.Pointer, stamps: cute.Pointer, rows: Int32,
               ld: Int32, num_cands: Int32):
        self.run(scores, positions, seq_index, cands, out, rows, ld, num_cands, stamps.toint())


class IndexerTopkCandidatesClusterTimelineSm90(IndexerTopkCandidatesClusterSm90):
    @cute.jit
    def __call__(self, scores: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
                 cands: cute.Pointer, out: cute.Pointer, stamps: cute.Pointer, rows: Int32,
                 ld: Int32, num_cands: Int32, stream: cuda.CUstream):
        self.kernel(scores, positions, seq_index, cands, out, stamps, rows, ld, num_cands).launch(
            grid=[self.C, rows, 1], block=list(self.spec.block), cluster=[self.C, 1, 1],
            smem=self.spec.smem_bytes, stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, scores: cute.Pointer, positions: cute.Pointer, seq_index: cute.Pointer,
               cands: cute.Pointer, out: cute.Pointer, stamps: cute.Pointer, rows: Int32,
               ld: Int32, num_cands: Int32):
        self.run(scores, positions, seq_index, cands, out, rows, ld, num_cands, stamps.toint())


_CLASSES = {"prep": IndexerPrepTimelineSm90, "scores": IndexerScoresTimelineSm90,
            "topk": IndexerTopkTimelineSm90}


def kernel_class(spec: ik.IndexerSpec):
    """The timeline class of a timeline spec (TIMELINE_OF kinds only)."""
    if not spec.timeline or (spec.kind, spec.mode, spec.ratio) not in TIMELINE_OF:
        raise ValueError(f"{spec.name}: no timeline build (have {TIMELINE_OF})")
    if spec.kind == "topkc":
        return IndexerTopkCandidatesClusterTimelineSm90
    return _CLASSES[spec.kind]
