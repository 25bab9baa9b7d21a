"""Low-latency mode at 2, 3 and 4 ranks (scen_ll.py runs on every rank)."""

import pytest

import epcomm

RANKS = [2, 3, 4]
T, H, TOPK = 12, 512, 4


def experts(R):
    return 4 * R


def run(world, scenario, **kwargs):
    results = world.run(scenario, **kwargs)
    if isinstance(results[0], str) and results[0].startswith("unsupported"):
        pytest.skip(f"skipped: {results[0]}")


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_round", "ue8m0"])
@pytest.mark.parametrize("hook", [False, True], ids=["event", "hook"])
def test_dispatch_combine(worlds, device, R, fmt, hook):
    sizes = [T - r for r in range(R)]
    run(worlds.get(R, device), "scen_ll.dispatch_combine", seed=10, sizes=sizes, T=T, H=H,
                              E=experts(R), topk=TOPK, fmt=fmt, hook=hook)


@pytest.mark.parametrize("R", RANKS)
def test_hidden_not_multiple_of_512(worlds, device, R):
    """UE8M0 exponent bytes stay uint8 [..][H/128] when they cannot pack into int32."""
    run(worlds.get(R, device), "scen_ll.dispatch_combine", seed=11, sizes=[5] * R, T=8, H=384,
                              E=experts(R), topk=3, fmt="ue8m0", rounds=1)


@pytest.mark.parametrize("R", RANKS)
def test_a_rank_without_tokens(worlds, device, R):
    sizes = [0 if r == R - 1 else T for r in range(R)]
    run(worlds.get(R, device), "scen_ll.dispatch_combine", seed=12, sizes=sizes, T=T, H=256,
                              E=experts(R), topk=TOPK, fmt="bf16", rounds=1)


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("hook", [False, True], ids=["event", "hook"])
def test_zero_copy(worlds, device, R, hook):
    run(worlds.get(R, device), "scen_ll.zero_copy", seed=13, sizes=[T] * R, T=T, H=256,
                              E=experts(R), topk=TOPK, hook=hook)


@pytest.mark.parametrize("R", RANKS)
def test_third_result_refused(worlds, device, R):
    run(worlds.get(R, device), "scen_ll.busy", T=4, H=128, E=experts(R), topk=2)


@pytest.mark.parametrize("R", [2])
def test_sizes_change(worlds, device, R):
    run(worlds.get(R, device), "scen_ll.sizes_change", H=128, E=experts(R), topk=2)
