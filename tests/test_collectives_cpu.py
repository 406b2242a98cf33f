"""CPU tests of the collectives: the one-shot reference and layout, the path table, the NVLS rule,
IPC payload validation, and the spawn launcher (exchange, errors, a dying rank, the deadline).

The launcher tests spawn real processes (no GPU): the rank programs live in this module, which the
children import through the sys.path that spawn hands them.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from collectives import ipc
from collectives.allreduce import DEFAULT_TABLE, PathTable
from collectives.launcher import RankFailure, run_ranks
from collectives.nccl import NVLS_VARIABLE, NcclError, check_count, require_nvls_disabled
from kernels import allreduce_ref as ref
from kernels.common_ref import BF16

RNG = np.random.default_rng()


def _inputs(world, rows, width):
    return [(RNG.standard_normal((rows, width), np.float32) * 3).astype(BF16)
            for _ in range(world)]


# ---- reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize("world", ref.WORLD_SIZES)
def test_reference_is_the_rank_ordered_fp32_fold_within_its_error_budget(world):
    """The fold of `world` bf16 values in fp32 has error <= (world-1) * 2**-24 * sum|x| (each add
    rounds once); then one bf16 rounding (2**-8 relative). Checked against float64 for every
    element, and the order is the one the kernel uses (not a pairwise or reversed sum)."""
    xs = _inputs(world, 33, 512)
    got = ref.allreduce_ref(xs).astype(np.float64)
    exact = ref.allreduce_f64(xs)
    abs_sum = sum(np.abs(x.astype(np.float64)) for x in xs)
    bound = 2.0**-8 * np.abs(exact) + world * 2.0**-24 * abs_sum + 2.0**-133
    assert (np.abs(got - exact) <= bound).all()
    fold = xs[0].astype(np.float32)
    for x in xs[1:]:
        fold = fold + x.astype(np.float32)
    np.testing.assert_array_equal(ref.rank_sum_f32(xs), fold)


def test_residual_reference_rounds_once():
    xs, res = _inputs(4, 9, 256), (RNG.standard_normal((9, 256), np.float32) * 50).astype(BF16)
    acc = ref.rank_sum_f32(xs)
    want = (res.astype(np.float32) + acc).astype(BF16)
    np.testing.assert_array_equal(ref.allreduce_residual_ref(xs, res).view(np.uint16),
                                  want.view(np.uint16))
    with pytest.raises(TypeError, match="residual must be bf16"):
        ref.allreduce_residual_ref(xs, res.astype(np.float32))


def test_negative_zero_is_sent_as_positive_zero():
    x = np.array([[-0.0, 0.0, -1.0, np.nan]], np.float32).astype(BF16)
    bits = ref.sanitize_ref(x).view(np.uint16)
    assert bits[0, 0] == 0 and bits[0, 1] == 0 and bits[0, 2] == x.view(np.uint16)[0, 2]
    assert np.isnan(ref.sanitize_ref(x)[0, 3].astype(np.float32))
    zeros = [np.full((1, 8), -0.0, np.float32).astype(BF16)] * 4
    assert (ref.allreduce_ref(zeros).view(np.uint16) == 0).all()     # +0.0, never the sentinel


def test_spec_layout_grid_and_bad_input():
    spec = ref.make_spec(4, 5120, "residual")
    assert spec.name == "allreduce_oneshot_w4_d5120_residual"
    assert [n for n, _ in spec.params][:3] == ["inp", "residual", "out"]
    assert spec.slot_bytes == 192 * 5120 * 2
    assert spec.buffer_bytes == ref.GENERATIONS * 4 * spec.slot_bytes
    offsets = {spec.slot_offset(g, s) for g in range(2) for s in range(4)}
    assert len(offsets) == 8 and max(offsets) + spec.slot_bytes == spec.buffer_bytes
    assert spec.grid(1) == (3, 1, 1) and spec.grid(192) == (ref.MAX_CTAS, 1, 1)
    with pytest.raises(ValueError, match="exceeds the buffer capacity"):
        spec.grid(193)
    with pytest.raises(ValueError, match="positive integer"):
        spec.grid(0)
    for bad in ((3, 5120, "none"), (4, 5121, "none"), (4, 5120, "rmsnorm")):
        with pytest.raises(ValueError):
            ref.make_spec(*bad)
    assert ref.oneshot_bytes(2, 5120, 4) == 2 * 5120 * 2 * 14


def test_family_specs_follow_tp_and_width():
    from kernels.allreduce_ref import make_gather_spec, make_pick_spec, make_spec
    pytest.importorskip("cutlass")
    from kernels import allreduce
    from loader.config import ModelConfig
    cfg = ModelConfig.preset("v41-flash")
    assert [s.name for s in allreduce.specs(cfg, 4)] == [
        make_spec(4, 5120).name, make_spec(4, 5120, "residual").name,
        make_pick_spec(4, 5120).name, make_gather_spec(4, 5120, 6 * 256).name,
        make_gather_spec(4, 5120, 3200).name]      # the sharded wkv's 2 pieces of 3200 a rank
    assert allreduce.specs(cfg, 1) == []


# ---- path table ---------------------------------------------------------------------------------

def test_path_table_is_a_lookup_over_every_row_count():
    assert PathTable().entries == DEFAULT_TABLE
    assert {PathTable().path(r) for r in range(1, 193)} == {"oneshot"}     # measured, run 35
    t = PathTable(((32, "oneshot"), (192, "nccl")))
    assert [t.path(r) for r in (1, 32)] == ["oneshot", "oneshot"]
    assert [t.path(r) for r in (33, 192)] == ["nccl", "nccl"]
    for bad in (0, 193, True, 2.0):
        with pytest.raises(ValueError):
            t.path(bad)
    for entries in ((), ((8, "oneshot"), (8, "nccl")), ((8, "twoshot"),), ((8.0, "nccl"),)):
        with pytest.raises(ValueError):
            PathTable(entries)


def test_path_table_agreement_across_ranks():
    t, other = PathTable(), PathTable(((16, "oneshot"), (192, "nccl")))
    t.agree(lambda p: [p, p, p, p], rank=0)
    with pytest.raises(ValueError, match=r"differs on rank\(s\) \[2\]"):
        t.agree(lambda p: [p, p, other.fingerprint(), p], rank=0)


# ---- NCCL rules ---------------------------------------------------------------------------------

def test_nvls_is_forced_off(monkeypatch):
    monkeypatch.delenv(NVLS_VARIABLE, raising=False)
    require_nvls_disabled()
    assert os.environ[NVLS_VARIABLE] == "0"
    require_nvls_disabled()                               # "0" stays accepted
    for value in ("1", "2", ""):
        monkeypatch.setenv(NVLS_VARIABLE, value)
        with pytest.raises(NcclError, match="multicast"):
            require_nvls_disabled()


def test_count_validation():
    assert check_count(5120, "bf16") == 5120
    for count, dtype in ((0, "bf16"), (True, "f32"), (4, "fp8"), (2.0, "bf16")):
        with pytest.raises(ValueError):
            check_count(count, dtype)


# ---- IPC payloads -------------------------------------------------------------------------------

def test_ipc_payloads_are_validated_by_rank_world_and_size():
    handles = [os.urandom(ipc.HANDLE_BYTES) for _ in range(4)]
    payloads = [ipc.pack_handle(r, 4, 4096, h) for r, h in enumerate(handles)]
    assert ipc.unpack_handles(payloads, 1, 4, 4096) == handles
    with pytest.raises(ipc.PeerSetupError, match="expected rank 1 of 4, 4096 B"):
        ipc.unpack_handles([payloads[0], payloads[0]] + payloads[2:], 0, 4, 4096)
    with pytest.raises(ipc.PeerSetupError, match="says rank 0 of world 4 with a 4096-byte"):
        ipc.unpack_handles(payloads, 0, 4, 8192)
    with pytest.raises(ipc.PeerSetupError, match="returned 3 payloads"):
        ipc.unpack_handles(payloads[:3], 0, 4, 4096)
    with pytest.raises(ValueError, match="64 bytes"):
        ipc.pack_handle(0, 4, 4096, b"short")


def test_ipc_vote_names_the_failed_rank():
    answers = {}

    def exchange(p):
        answers["len"] = len(p)
        return [p, ipc._vote_payload(False, "cuIpcOpenMemHandle failed"), p]
    with pytest.raises(ipc.PeerSetupError, match="rank 1: fail: cuIpcOpenMemHandle failed"):
        ipc._vote(exchange, 0, True, "")
    assert answers["len"] == ipc.VOTE_BYTES


# ---- launcher (spawned processes, no GPU) -------------------------------------------------------

def program_gather(ctx, salt):
    got = ctx.exchange(f"{salt}:{ctx.rank}".encode())
    ctx.barrier()
    return [g.decode() for g in got]


def program_raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise KeyError("rank one refuses")
    return ctx.rank


def program_die_then_exchange(ctx):
    if ctx.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.exchange(b"x")
    return "unreachable"


def program_sleep(ctx, seconds):
    time.sleep(seconds if ctx.rank == 1 else 0)
    return ctx.rank


def test_launcher_exchange_is_an_all_gather_in_rank_order():
    salt = RNG.integers(1 << 30)
    results = run_ranks(program_gather, 3, devices=[0, 0, 0], args=(salt,), timeout_s=60)
    assert all(r.ok for r in results), [r.describe() for r in results]
    assert all(r.value == [f"{salt}:{k}" for k in range(3)] for r in results)


def test_launcher_reports_a_rank_exception_with_its_type():
    results = run_ranks(program_raise_on_rank1, 2, devices=[0, 0], timeout_s=60)
    assert results[0].ok and results[0].value == 0
    assert not results[1].ok and results[1].error_type == "KeyError"
    assert "rank one refuses" in results[1].error and "Traceback" in results[1].traceback


def test_a_dead_rank_fails_the_others_exchange_instead_of_hanging():
    t0 = time.monotonic()
    results = run_ranks(program_die_then_exchange, 3, devices=[0, 0, 0], timeout_s=60)
    assert time.monotonic() - t0 < 30
    assert results[0].error_type == "RankDied" and results[0].exitcode == -signal.SIGKILL
    for r in results[1:]:
        assert r.error_type == RankFailure.__name__ and "rank 0 died" in r.error, r.describe()


def test_launcher_deadline_kills_a_stuck_rank():
    results = run_ranks(program_sleep, 2, devices=[0, 0], args=(60,), timeout_s=8)
    assert results[0].ok
    assert results[1].error_type == "TimeoutError" and "within 8 s" in results[1].error


def test_launcher_rejects_a_device_list_of_the_wrong_length():
    with pytest.raises(ValueError, match="needs 2 device ordinals"):
        run_ranks(program_gather, 2, devices=[0])
