"""Every tensor the package makes names its device and dtype. DeepEP's own tests run under
torch.set_default_device("cuda") and torch.set_default_dtype(torch.bfloat16), which move a
factory call without ``device=`` to the GPU and give one without ``dtype=`` bf16: a page-locked
count buffer made without a device broke every CUDA dispatch (seventeenth session). The GPU suite
runs a layer step under ``torch.device(dev)`` (scen_normal.spares_steps); this check reads the
package's source, so CI without a GPU catches the same mistake."""

import ast
import pathlib

import epcomm

# torch's factory functions that torch.utils._device redirects to the default device, and that
# the package could call.
FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "asarray", "rand",
             "randn", "randint", "randperm", "eye", "linspace", "empty_strided", "range"}


def calls_without_device(path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
            continue
        for arg in ("device", "dtype"):
            if not any(k.arg == arg for k in node.keywords):
                yield f"{path.name}:{node.lineno}: torch.{f.attr}(...) without {arg}="


def test_every_factory_call_names_its_device_and_dtype():
    pkg = pathlib.Path(epcomm.__file__).parent
    files = sorted(pkg.glob("*.py"))
    assert len(files) > 5, f"the package's sources were not found in {pkg}"
    bad = [line for p in files for line in calls_without_device(p)]
    assert not bad, "\n".join(bad)


def test_the_check_finds_a_call_without_device(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nt = torch.empty((4,), dtype=torch.int32, pin_memory=True)\n"
                   "u = torch.zeros(2, device='cpu')\n"
                   "v = torch.ones(2, device='cpu', dtype=torch.int32)\n")
    assert list(calls_without_device(src)) == ["m.py:2: torch.empty(...) without device=",
                                               "m.py:3: torch.zeros(...) without dtype="]
