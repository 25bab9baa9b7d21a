# One MoE layer step as PyTorch code runs it: route, dispatch, run the local experts, combine.
# On CUDA the experts' output is made under Buffer.mem_pool, so the combine reads it where it
# lies (no staging pass; Buffer.in_place_counts says so); on CPU the same code runs unchanged.
# Run: epcomm launch -n 4 python examples/moe_layer.py
import contextlib

import torch

import epcomm

group = epcomm.init()
cuda = torch.cuda.is_available() and epcomm.backend_available("cuda")[0]
dev = "cuda" if cuda else "cpu"
n, hidden, topk, L = 64, 256, 2, 2  # tokens, hidden size, experts per token, experts per rank
E = L * group.nranks


def expert(g):  # expert g's weights, the same on every rank (for the check at the end)
    torch.manual_seed(1000 + g)
    return torch.nn.Linear(hidden, hidden, bias=False).to(dev, torch.bfloat16)


experts = [expert(group.rank * L + e) for e in range(L)]  # this rank's experts
torch.manual_seed(group.rank)
with epcomm.Buffer(group, device=dev) as buf, torch.no_grad():
    pool = buf.mem_pool(64 << 20) if cuda else None  # collective, once
    x = torch.randn((n, hidden), device=dev).bfloat16()
    weights, topk_idx = torch.randn((n, E), device=dev).softmax(1).topk(topk)
    recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=weights, num_experts=E)
    with torch.cuda.use_mem_pool(pool.pool) if pool else contextlib.nullcontext():
        y = torch.zeros_like(recv_x)  # the experts' output: registered memory on CUDA
    for e in range(L):  # recv_idx holds this rank's expert of each slot, -1 for the others
        for k in range(topk):
            rows = recv_idx[:, k] == e
            y[rows] += (experts[e](recv_x[rows]).float() * recv_w[rows, k:k + 1]).bfloat16()
    out, _, _ = buf.combine(y, handle)  # each token: the sum of its experts' weighted outputs
    in_place = buf.in_place_counts()[0]
    assert in_place == (1 if cuda and len(y) else 0)  # the combine read y in place (CUDA)
    want = torch.zeros((n, hidden), device=dev)  # the same layer on this rank alone
    for g in range(E):
        w_g = (weights * (topk_idx == g)).sum(1, keepdim=True)
        want += expert(g)(x).float() * w_g
    assert torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2)
print(f"rank {group.rank}: ok on {dev}, {sum(per_expert)} token-expert pairs here")
group.destroy()
