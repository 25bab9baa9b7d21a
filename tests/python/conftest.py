"""The Python suite of epcomm (README.md, "Python"): DeepEP's intranode and low-latency test
programs' semantics, written afresh, on CPU tensors with gloo at 2, 3 and 4 ranks, every result
compared bit for bit with the reference (tools/ref/ref.c); misuse; lifecycle and silence at exit.
Each test runs in a world of R worker processes (_pool.py). The "cuda" variants run the same
scenarios with CUDA tensors, several ranks on one GPU (under MPS), and are skipped without one.
"""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _pool import Worlds  # noqa: E402

DEVICES = ["cpu", "cuda"]


def _gpu():
    import epcomm

    ok, why = epcomm.backend_available("cuda")
    return ok, why


@pytest.fixture(scope="session")
def worlds():
    w = Worlds()
    yield w
    w.close()


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda":
        ok, why = _gpu()
        if not ok:
            pytest.skip(f"skipped: no GPU ({why})")
    return request.param


def _order(item):
    """Tests of one world size and device run together: a world starts once per (R, device)."""
    cs = getattr(item, "callspec", None)
    params = cs.params if cs else {}
    return (params.get("device", ""), params.get("R", 0))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_order)
