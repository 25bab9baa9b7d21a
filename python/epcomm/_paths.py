"""Where the package's compiled parts are (python/CMakeLists.txt lays them out)."""

import os

HERE = os.path.dirname(os.path.abspath(__file__))


def cli():
    """The epcomm executable shipped in the package."""
    return os.path.join(HERE, "bin", "epcomm")


def library():
    """libepcomm.so of the package, for ctypes or a C program built against the wheel."""
    lib = os.path.join(HERE, "lib")
    names = sorted(n for n in os.listdir(lib) if n.startswith("libepcomm.so"))
    return os.path.join(lib, names[0])


def reference_library():
    """The single-process reference of docs/SEMANTICS.md (tools/ref/ref.c), for tests."""
    return os.path.join(HERE, "lib", "libepcomm_ref.so")


def include_dir():
    return os.path.join(HERE, "include")
