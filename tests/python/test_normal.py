"""Normal mode at 2, 3 and 4 ranks (scen_normal.py runs on every rank)."""

import pytest

RANKS = [2, 3, 4]
H, E, TOPK = 256, 24, 4


def sizes(R, base=40):
    return [base + 7 * r for r in range(R)]


@pytest.mark.parametrize("R", RANKS)
def test_layout(worlds, device, R):
    worlds.get(R, device).run("scen_normal.layout", seed=1, n=50, E=E, topk=TOPK)


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_dispatch_combine(worlds, device, R, fp8):
    worlds.get(R, device).run("scen_normal.dispatch_combine", seed=2, sizes=sizes(R), H=H, E=E,
                              topk=TOPK, fp8=fp8, alignment=4)


@pytest.mark.parametrize("R", RANKS)
def test_dispatch_without_topk(worlds, device, R):
    """DeepEP's `with_topk=False`: routing from is_token_in_rank, counts from
    num_tokens_per_expert."""
    worlds.get(R, device).run("scen_normal.dispatch_combine", seed=3, sizes=sizes(R), H=H, E=E,
                              topk=TOPK, with_topk=False, bias=0, alignment=3)


@pytest.mark.parametrize("R", RANKS)
def test_no_weights_one_bias(worlds, device, R):
    worlds.get(R, device).run("scen_normal.dispatch_combine", seed=4, sizes=sizes(R, 9), H=H,
                              E=E, topk=TOPK, weights=False, bias=1)


@pytest.mark.parametrize("R", RANKS)
def test_worst_case_combine(worlds, device, R):
    worlds.get(R, device).run("scen_normal.dispatch_combine", seed=5, sizes=sizes(R), H=H, E=E,
                              topk=TOPK, bias=0)


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("flags", ["async", "previous", "async+previous+comm_alloc"])
def test_stream_flags(worlds, device, R, flags):
    """async_finish, previous_event, allocate_on_comm_stream: same results, events that wait."""
    worlds.get(R, device).run("scen_normal.dispatch_combine", seed=6, sizes=sizes(R, 16), H=H,
                              E=E, topk=TOPK, async_finish="async" in flags,
                              previous="previous" in flags, comm_alloc="comm_alloc" in flags)


@pytest.mark.parametrize("R", RANKS)
def test_odd_sizes(worlds, device, R):
    """A rank without tokens, hidden 72 (not a multiple of 128), fp8 rows of 80 bytes."""
    worlds.get(R, device).run("scen_normal.dispatch_odd_sizes", seed=7, H=72, E=4 * R, topk=3)
    worlds.get(R, device).run("scen_normal.dispatch_combine", seed=8, sizes=sizes(R, 3), H=80,
                              E=2 * R, topk=2, fp8=True)


@pytest.mark.parametrize("R", RANKS)
def test_cached_dispatch_in_another_format(worlds, device, R):
    worlds.get(R, device).run("scen_normal.cached_other_format", seed=9, sizes=sizes(R, 20),
                              H=H, E=E, topk=TOPK)


@pytest.mark.parametrize("R", RANKS)
def test_registered_combine(worlds, device, R):
    worlds.get(R, device).run("scen_normal.registered_combine", seed=10, sizes=sizes(R), H=H, E=E,
                              topk=TOPK)


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_out_pool_dispatch(worlds, device, R, fp8):
    worlds.get(R, device).run("scen_normal.out_pool_dispatch", seed=13, sizes=sizes(R), H=H,
                              E=E, topk=TOPK, fp8=fp8)


@pytest.mark.parametrize("R", RANKS)
def test_mem_pool_combine(worlds, device, R):
    worlds.get(R, device).run("scen_normal.mem_pool_combine", seed=12, sizes=sizes(R), H=H, E=E,
                              topk=TOPK)


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("fp8", [False, True])
def test_combine_buffer(worlds, device, R, fp8):
    worlds.get(R, device).run("scen_normal.combine_buffer", seed=11, sizes=sizes(R), H=H, E=E,
                              topk=TOPK, fp8=fp8)


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("default_device", [False, True], ids=["plain", "default_device"])
def test_spares(worlds, device, R, default_device):
    """The outputs made while a dispatch waits for its count (CUDA) go to the calls they were
    made for, with the reference's bits; also with the device as torch's default device."""
    worlds.get(R, device).run("scen_normal.spares_steps", seed=14, sizes=sizes(R), H=H, E=E,
                              topk=TOPK, default_device=default_device)
