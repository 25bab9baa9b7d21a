"""epcomm.init() from the environment of a launcher (torchrun's, in the test), then a round."""

import torch

import epcomm

with epcomm.init(timeout_s=30) as group:
    with epcomm.Buffer(group, device="cpu") as buf:
        R, me = group.nranks, group.rank
        idx = torch.tensor([[me, (me + 1) % R]], dtype=torch.int64)
        recv_x, _, _, _, handle, _ = buf.dispatch(torch.full((1, 64), me + 1.0).bfloat16(),
                                                  topk_idx=idx, num_experts=R)
        out, _, _ = buf.combine(recv_x, handle)
        assert out[0, 0].item() == 2 * (me + 1), out[0, 0].item()
    print(f"rank {me} of {R}: ok")
