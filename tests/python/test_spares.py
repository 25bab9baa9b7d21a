"""epcomm._spares alone, on CPU tensors (the Buffer makes spares on CUDA only; scen_normal's
spares_steps checks them there through the Buffer): what a dispatch's job makes step by step,
which later call may take each spare, and when the combine output is no longer made."""

import torch

from epcomm._spares import Spares

DEV = torch.device("cpu")


def run_job(sp, stream=7, n=5, E=8, H=16, until=None):
    step = sp.job(stream, n, E, H)
    k = 0
    while (until is None or k < until) and step(k):
        k += 1
    return sp.finish()


def test_a_job_makes_the_combine_output_prefix_and_layout():
    sp = Spares(DEV, 4)
    got = run_job(sp)
    assert got is not None and got[0] == 7 and tuple(got[1].shape) == (5, 16)
    assert got[1].dtype == torch.bfloat16
    prefix = sp.take_prefix(7)
    assert prefix is not None and tuple(prefix.shape) == (4, 4) and prefix.dtype == torch.int32
    tpr, tpe, itr = sp.take_layout(7, 5, 8)
    assert tpr.shape == (4,) and tpe.shape == (8,) and itr.shape == (5, 4)
    assert itr.dtype == torch.bool
    assert sp.take_combine(got, 7, (5, 16)) is got[1]
    assert sp.used == 3
    # Each spare goes once.
    assert sp.take_prefix(7) is None and sp.take_layout(7, 5, 8) is None


def test_other_stream_or_shape_takes_nothing_and_drops_the_spare():
    sp = Spares(DEV, 2)
    got = run_job(sp)
    assert sp.take_prefix(8) is None  # another stream: dropped
    assert sp.take_prefix(7) is None
    assert sp.take_layout(7, 6, 8) is None  # another token count: dropped
    assert sp.take_layout(7, 5, 8) is None
    assert sp.take_combine(got, 8, (5, 16)) is None
    assert sp.take_combine(got, 7, (5, 17)) is None
    assert sp.take_combine(None, 7, (5, 16)) is None
    assert sp.used == 0


def test_steps_cut_short_leave_no_partial_layout():
    sp = Spares(DEV, 2)
    run_job(sp, until=3)  # the count came after three steps: combine, prefix, one layout part
    assert sp.take_prefix(7) is not None
    assert sp.take_layout(7, 5, 8) is None


def test_disabled_makes_no_job():
    sp, other = Spares(DEV, 2), Spares(DEV, 2)
    sp.enabled = False
    assert sp.job(7, 5, 8, 16) is None and sp.finish() is None
    assert other.job(7, 5, 8, 16) is not None  # another Buffer's spares stay on


def test_no_combine_output_past_the_limit():
    sp = Spares(DEV, 2)
    H = Spares.COMBINE_LIMIT // 2 // 4 + 1  # 4 tokens of H bf16 channels: just over the limit
    assert run_job(sp, n=4, H=H) is None
    assert sp.take_prefix(7) is not None  # the small ones are still made


def test_combine_output_skipped_after_one_was_not_taken():
    sp = Spares(DEV, 2)
    first = run_job(sp)
    assert first is not None  # not taken (say, the combine ran on another stream)
    assert run_job(sp) is None  # so the next dispatch makes none
    again = run_job(sp)
    assert again is not None  # and the one after tries again
    assert sp.take_combine(again, 7, (5, 16)) is again[1]
    assert run_job(sp) is not None  # taken: keep making them


def test_a_failed_allocation_ends_the_steps():
    sp = Spares(DEV, 2)
    step = sp.job(7, 5, 8, 16)
    real = torch.empty

    def fail(*a, **k):
        raise torch.cuda.OutOfMemoryError("no memory")

    torch.empty = fail
    try:
        assert step(0) is False  # no exception reaches the C library
    finally:
        torch.empty = real
    assert sp.finish() is None
