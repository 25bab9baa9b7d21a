"""Misuse raises clear errors naming the argument (scen_misuse.py)."""

import pytest


@pytest.mark.parametrize("R", [2])
def test_bad_tensors_and_unsupported_arguments(worlds, device, R):
    worlds.get(R, device).run("scen_misuse.local_checks")


@pytest.mark.parametrize("R", [2])
def test_low_latency_misuse(worlds, device, R):
    r = worlds.get(R, device).run("scen_misuse.ll_checks")
    if isinstance(r[0], str):
        pytest.skip(f"skipped: {r[0]}")


@pytest.mark.parametrize("R", [2, 3])
def test_library_errors_become_exceptions(worlds, device, R):
    worlds.get(R, device).run("scen_misuse.library_errors")
