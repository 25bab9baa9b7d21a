"""epcomm._tensors.carve: several empty outputs from one allocation (CUDA) or one each."""

import pytest
import torch

from epcomm._tensors import carve

I32, I64, F32 = torch.int32, torch.int64, torch.float32
CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [0, 1, 7, 128])
def test_carved_parts_have_their_shapes_and_do_not_overlap(rows):
    parts = [((rows,), I32), ((rows, 3), F32), ((rows, 8), I64), ((rows, 8), F32),
             ((5, 4), torch.bool)]
    got = carve(CPU, parts, one=True)
    assert [(tuple(t.shape), t.dtype) for t in got] == [(s, d) for s, d in parts]
    base = got[0].untyped_storage().data_ptr()
    spans = []
    for t in got:
        assert t.untyped_storage().data_ptr() == base, "one allocation"
        assert t.is_contiguous()
        if t.numel() == 0:  # (an empty tensor's data_ptr() is 0: ptr() gives the C call another)
            continue
        off = t.data_ptr() - base
        assert off % 256 == 0, f"part at offset {off}"
        spans.append((off, off + t.numel() * t.element_size()))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, f"parts overlap: {spans}"
    for i, t in enumerate(got):  # a write to one part leaves the others as they were
        t.fill_(1 if t.dtype == torch.bool else i + 1)
    for i, t in enumerate(got):
        want = 1 if t.dtype == torch.bool else i + 1
        assert bool((t == want).all()), f"part {i} was overwritten"


def test_one_part_or_not_cuda_gives_plain_tensors():
    one = carve(CPU, [((4, 2), I64)], one=True)[0]
    assert one.storage_offset() == 0 and one.untyped_storage().nbytes() == 64
    a, b = carve(CPU, [((3,), I32), ((2, 2), F32)])  # the default on a CPU device
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert (tuple(a.shape), a.dtype, tuple(b.shape), b.dtype) == ((3,), I32, (2, 2), F32)
