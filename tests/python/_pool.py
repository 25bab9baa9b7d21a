"""A world of R ranks for the tests: R worker processes (_worker.py) in one gloo process group,
started once and reused by every test of that size and device, since starting a process that
imports torch takes seconds. Each test sends a scenario (module.function and keyword arguments)
to every rank and gets every rank's result; a rank that fails, hangs past the deadline or
writes anything to stderr fails the test."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


class WorldError(AssertionError):
    pass


class World:
    def __init__(self, nranks, device, deadline_s=180):
        self.nranks, self.device, self.deadline_s = nranks, device, deadline_s
        self.tmp = tempfile.mkdtemp(prefix=f"epcomm-pytest-r{nranks}-")
        self.procs, self.conns, self.errs = [], [], []
        # glibc fills freed memory: a write into a tensor freed too early shows up.
        env = dict(os.environ, EP_TIMEOUT_S=os.environ.get("EP_TIMEOUT_S", "60"),
                   PYTHONUNBUFFERED="1",
                   GLIBC_TUNABLES=os.environ.get("GLIBC_TUNABLES", "glibc.malloc.perturb=165"))
        from multiprocessing.connection import Connection

        for r in range(nranks):
            mine, theirs = socket.socketpair()
            err = os.path.join(self.tmp, f"rank{r}.err")
            with open(os.path.join(self.tmp, f"rank{r}.out"), "w") as out, open(err, "w") as e:
                p = subprocess.Popen(
                    [sys.executable, os.path.join(HERE, "_worker.py"), str(r), str(nranks),
                     str(theirs.fileno()), os.path.join(self.tmp, "store"), device],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=e, pass_fds=[theirs.fileno()],
                    env=env, cwd=HERE)
            theirs.close()
            self.procs.append(p)
            self.conns.append(Connection(mine.detach()))
            self.errs.append(err)
        self._gather("ready")
        self.err_sizes = [0] * nranks

    def _recv(self, r, deadline):
        conn = self.conns[r]
        while not conn.poll(0.2):
            if self.procs[r].poll() is not None:
                raise WorldError(f"rank {r} exited with status {self.procs[r].returncode}"
                                 f"{self._stderr_tail(r)}")
            if time.monotonic() > deadline:
                raise WorldError(f"rank {r}: no answer within {self.deadline_s} s"
                                 f"{self._stderr_tail(r)}")
        try:
            return conn.recv()
        except EOFError:  # the rank died while answering: say how
            try:
                self.procs[r].wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            raise WorldError(f"rank {r} died (status {self.procs[r].poll()})"
                             f"{self._stderr_tail(r)}") from None

    def _stderr_tail(self, r):
        try:
            with open(self.errs[r]) as f:
                text = f.read()[-3000:]
        except OSError:
            text = ""
        return f"; its stderr:\n{text}" if text else ""

    def _gather(self, what):
        deadline = time.monotonic() + self.deadline_s
        replies = [self._recv(r, deadline) for r in range(self.nranks)]
        bad = [f"--- rank {r} ---\n{v}" for r, (k, v) in enumerate(replies) if k == "fail"]
        if bad:
            raise WorldError(f"{what} failed:\n" + "\n".join(bad))
        return [v for _, v in replies]

    def run(self, scenario, **kwargs):
        """Runs scenario ("module.function") on every rank; returns the list of results."""
        try:
            for c in self.conns:
                c.send((scenario, kwargs))
            results = self._gather(scenario)
        except (WorldError, OSError, EOFError):
            self.close(force=True)
            raise
        self._check_silent(scenario)
        return results

    def _check_silent(self, scenario):
        for r, path in enumerate(self.errs):
            size = os.path.getsize(path)
            if size != self.err_sizes[r]:
                with open(path) as f:
                    f.seek(self.err_sizes[r])
                    text = f.read()
                self.err_sizes[r] = size
                raise WorldError(f"{scenario}: rank {r} wrote to stderr (a correct run is "
                                 f"silent):\n{text}")

    def alive(self):
        return all(p.poll() is None for p in self.procs)

    def close(self, force=False):
        if not force:
            try:
                for c in self.conns:
                    c.send(("quit", None))
                self._gather("shutdown")
            except Exception:
                force = True
        for p in self.procs:
            if force and p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for c in self.conns:
            c.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.procs = []


class Worlds:
    """One world alive at a time (each holds R processes with torch loaded)."""

    def __init__(self):
        self.current = None

    def get(self, nranks, device):
        w = self.current
        if w is not None and (w.nranks, w.device) == (nranks, device) and w.procs and w.alive():
            return w
        self.close()
        self.current = World(nranks, device)
        return self.current

    def close(self):
        if self.current is not None:
            self.current.close()
            self.current = None
