"""Lifecycle: destroy and `with`, objects alive at interpreter exit (one warning, no hang, no
crash, the C library's own exit report not repeated), garbage-collected buffers, no thread or
fd or /dev/shm entry left after destroy, groups from torchrun's environment and from callbacks,
the CLI through `python -m epcomm`."""

import os
import subprocess
import sys
import time

import pytest

import epcomm

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable


def launch(n, *args, timeout=90, env=None):
    return subprocess.run([epcomm.cli_path(), "launch", "-n", str(n), "--timeout",
                           str(timeout), *args], capture_output=True, text=True,
                          timeout=timeout + 30, env=env)


def prog(name):
    return os.path.join(HERE, "progs", name)


@pytest.mark.parametrize("mode", ["clean", "fork"])
def test_clean_exit_is_silent(mode):
    r = launch(2, PY, prog("leaky.py"), mode)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", f"a clean run wrote to stderr:\n{r.stderr}"
    assert r.stdout.count("1 passed") == 2


@pytest.mark.parametrize("mode", ["leak", "peer-gone"])
def test_alive_at_exit_one_warning(mode):
    """One line per rank that exits normally, naming the objects and the fix; exit status 0,
    no wait for a peer that is gone (nothing collective at exit)."""
    t0 = time.monotonic()
    r = launch(2, PY, prog("leaky.py"), mode, timeout=60)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 30, "the exit waited"
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == (2 if mode == "leak" else 1), f"one line per rank:\n{r.stderr}"
    for line in lines:
        assert "epcomm: warn:" in line and " exit: " in line, line
        assert "1 epcomm.Buffer and 1 epcomm.Group" in line, line
        assert "buffer.destroy()" in line and "with" in line, line
    assert "ep_buffer_destroy" not in r.stderr, "the C library's exit report repeated it"


def test_doctor_classifies_the_warning():
    r = subprocess.run([PY, "-m", "epcomm", "doctor", "run", "--", epcomm.cli_path(), "launch",
                        "-n", "2", PY, prog("leaky.py"), "leak"], capture_output=True,
                       text=True, timeout=120)
    # The command's own output passes through on stdout; the doctor reports on stderr.
    assert "epcomm-python-not-destroyed" in r.stderr, r.stdout + r.stderr
    assert "fix:   Call buffer.destroy()" in r.stderr, r.stderr


def test_init_from_torchrun_environment():
    """RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them; no EP_* variable."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("EP_")}
    port = str(20000 + os.getpid() % 20000)
    procs = [subprocess.Popen([PY, prog("init_env.py")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(base, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and err == "", err
        assert out.endswith("of 3: ok\n"), out


def test_init_from_epcomm_launch():
    r = launch(2, PY, prog("init_env.py"))
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_init_without_launcher_says_how():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EP_", "OMPI_", "PMI_", "SLURM_")) and k not in ("RANK",
                                                                               "WORLD_SIZE")}
    r = subprocess.run([PY, "-c", "import epcomm; epcomm.init()"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode != 0
    assert "BootstrapError" in r.stderr and "epcomm launch" in r.stderr, r.stderr


def test_group_from_callbacks_and_errors():
    g = epcomm.Group.from_callbacks(0, 1, lambda data: data)
    assert (g.rank, g.nranks, g.allgather(b"ab")) == (0, 1, [b"ab"])
    with epcomm.Buffer(g, device="cpu") as buf:
        assert buf.rank == 0 and buf.group_size == 1
    g.destroy()
    g.destroy()  # a second destroy does nothing
    with pytest.raises(epcomm.DestroyedError, match="Group.barrier"):
        g.barrier()

    def broken(data):
        raise ConnectionError("the framework's allgather failed")

    with pytest.raises(epcomm.BootstrapError, match="allgather callback") as e:
        epcomm.Group.from_callbacks(0, 1, broken)
    assert isinstance(e.value.__cause__, ConnectionError)
    with pytest.raises(epcomm.BootstrapError) as e:
        epcomm.Group.from_callbacks(0, 2, lambda data: b"short")
    assert isinstance(e.value.__cause__, ValueError)


def test_python_m_epcomm_runs_the_cli():
    r = subprocess.run([PY, "-m", "epcomm", "info"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"epcomm {epcomm.__version__}" in r.stdout, r.stdout + r.stderr
    r = epcomm.doctor("rules", capture_output=True, text=True)
    assert r.returncode == 0 and "epcomm-python-not-destroyed" in r.stdout
    r = launch(2, PY, "-c", "import os; print(os.environ['EP_RANK'])")
    assert sorted(r.stdout.split()) == ["0", "1", "[0]", "[1]"], r.stdout


@pytest.mark.parametrize("R", [2])
def test_destroy_leaves_nothing(worlds, device, R):
    worlds.get(R, device).run("scen_lifecycle.leaves_nothing")


@pytest.mark.parametrize("R", [2])
def test_destroy_and_with(worlds, device, R):
    worlds.get(R, device).run("scen_lifecycle.destroy_and_with")


@pytest.mark.parametrize("R", [3])
def test_garbage_collected(worlds, device, R):
    worlds.get(R, device).run("scen_lifecycle.garbage_collected")


@pytest.mark.parametrize("R", [2])
def test_freed_when_dropped(worlds, device, R):
    worlds.get(R, device).run("scen_lifecycle.freed_when_dropped")
