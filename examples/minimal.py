# Every rank dispatches tokens to the experts they chose, the experts double what they receive,
# and combine brings it back. Run: epcomm launch -n 4 python examples/minimal.py
import torch

import epcomm

group = epcomm.init()  # ranks from epcomm launch, torchrun or mpirun (or pass a torch group)
with epcomm.Buffer(group, device="cpu") as buf:  # DeepEP's Buffer API
    n, hidden, topk, E = 32, 256, 2, 4 * group.nranks
    x = torch.randn((n, hidden)).bfloat16()
    topk_idx = torch.randint(0, E, (n, topk))  # expert ids; -1 leaves a slot unused
    weights = torch.rand((n, topk))
    recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=weights, num_experts=E)
    y = recv_x * 2  # the local experts' work, row by row
    out, out_w, _ = buf.combine(y, handle, topk_weights=recv_w)
    ranks_per_token = buf.get_dispatch_layout(topk_idx, E)[3].sum(1, keepdim=True)
    assert torch.allclose(out.float(), x.float() * 2 * ranks_per_token, rtol=1e-2, atol=1e-2)
    assert torch.equal(out_w, weights)  # each weight comes back from the rank of its expert
print(f"rank {group.rank}: ok")
group.destroy()
