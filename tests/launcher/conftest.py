"""End-to-end launcher tests: they run the real horolite-run (and mpirun) in subprocesses.

The launcher under test is, in order: $HOROLITE_TEST_LAUNCHER (a command, e.g.
"horolite-run" to test an installed wheel); ``python -m horolite.launcher`` if
that imports from this checkout (editable install); else this checkout through
a small shim package on PYTHONPATH. They work with whichever MPI wheel is
installed (MPICH or Open MPI).
"""
import os
import shlex
import subprocess
import sys
import time

import pytest

from launcher_util import REPO

_SHIM = '''import os as _os
_REPO = {repo!r}
__path__ = [_os.path.join(_REPO, "horolite"), _REPO]
_init = _os.path.join(_REPO, "horolite", "__init__.py")
exec(compile(open(_init).read(), _init, "exec"))
'''


@pytest.fixture(scope="session")
def launcher(tmp_path_factory):
    """(argv prefix, env, cwd) that run horolite-run from this checkout.

    The cwd is outside the checkout: ``python -m`` puts the cwd first on sys.path,
    and the checkout's horolite/ has no launcher subpackage (it is mapped in).
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cwd = str(tmp_path_factory.mktemp("cwd"))
    if os.environ.get("HOROLITE_TEST_LAUNCHER"):
        return shlex.split(os.environ["HOROLITE_TEST_LAUNCHER"]), env, cwd
    probe = subprocess.run(
        [sys.executable, "-c", "import horolite.launcher as l; print(l.__file__)"],
        capture_output=True, text=True, cwd="/")
    if probe.returncode == 0 and probe.stdout.strip().startswith(os.path.join(REPO, "launcher")):
        return [sys.executable, "-m", "horolite.launcher"], env, cwd
    shim = tmp_path_factory.mktemp("shim")
    (shim / "horolite").mkdir()
    (shim / "horolite" / "__init__.py").write_text(_SHIM.format(repo=REPO))
    env["PYTHONPATH"] = os.pathsep.join([str(shim)] + [p for p in [env.get("PYTHONPATH")] if p])
    return [sys.executable, "-m", "horolite.launcher"], env, cwd


class Run:
    def __init__(self, proc, out, err, seconds):
        self.returncode, self.stdout, self.stderr, self.seconds = proc.returncode, out, err, seconds


@pytest.fixture
def run(launcher):
    def run(*args, timeout=60, env=None):
        argv, base, cwd = launcher
        full = dict(base, **(env or {}))
        start = time.monotonic()
        proc = subprocess.run(argv + [str(a) for a in args], capture_output=True, text=True,
                              env=full, timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd)
        return Run(proc, proc.stdout, proc.stderr, time.monotonic() - start)
    return run


@pytest.fixture
def start(launcher):
    """Start the launcher without waiting (for signal tests)."""
    procs = []

    def start(*args, env=None):
        argv, base, cwd = launcher
        proc = subprocess.Popen(argv + [str(a) for a in args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=dict(base, **(env or {})),
                                stdin=subprocess.DEVNULL, cwd=cwd)
        procs.append(proc)
        return proc
    yield start
    for proc in procs:  # only ours, by pid
        if proc.poll() is None:
            proc.kill()
            proc.wait()
