"""horovodrun's -p/--ssh-port and -i/--ssh-identity-file on real ssh: an sshd of this test's
own (on a free port of 127.0.0.2 and 127.0.0.3, two loopback "hosts"), reached only with the
test's key. The ssh that mpirun runs is wrapped to skip host-key prompts and to log its
arguments; everything else (the port, the key) must come from the flags."""
import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest

import needed_tools
from launcher_util import wait_until_gone

SSHD = needed_tools.find("sshd") or "/usr/sbin/sshd"
MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])


def _is_mpich():
    out = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True).stdout
    return "HYDRA" in out or "MPICH" in out


_TOOLS = needed_tools.missing("sshd", "ssh", "ssh-keygen")
pytestmark = pytest.mark.skipif(
    _TOOLS is not None or MPIRUN is None or os.geteuid() != 0 or not _is_mpich(),
    reason=_TOOLS or "needs root and the MPICH wheel (the Open MPI form is unit-tested)")

HOSTS = ("127.0.0.2", "127.0.0.3")


def _free_port():
    with socket.socket() as s:
        s.bind((HOSTS[0], 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)],
                       check=True)
    shutil.copy(d / "user.pub", d / "authorized_keys")
    port = _free_port()
    (d / "sshd_config").write_text("\n".join([
        f"Port {port}", *[f"ListenAddress {h}" for h in HOSTS], f"HostKey {d / 'host'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}", f"PidFile {d / 'sshd.pid'}",
        "StrictModes no", "UsePAM no", "PasswordAuthentication no",
        "PermitRootLogin prohibit-password", ""]))
    wrapper = d / "ssh"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {d / "argv.log"}\n'
                       'exec ssh -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null '
                       '-o LogLevel=ERROR -o BatchMode=yes "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    os.makedirs("/run/sshd", exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection((HOSTS[1], port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    yield d, port
    proc.terminate()  # our sshd only, by its pid
    proc.wait(10)


@pytest.mark.parametrize("np_", [2, 4])
def test_ranks_start_over_ssh_on_the_given_port_with_the_given_key(run, sshd, np_):
    d, port = sshd
    (d / "argv.log").unlink(missing_ok=True)
    script = ("import horolite as h, numpy as np; h.init(); "
              "print('sum', h.rank(), h.allreduce(np.full(2, h.rank() + 1.0), op=h.Sum, name='s').tolist())")
    r = run("-np", np_, "-H", ",".join(f"{h}:{np_ // 2}" for h in HOSTS), "-p", port,
            "-i", d / "user", f"--mpi-args=-launcher-exec {d / 'ssh'}",
            sys.executable, "-c", script, timeout=120)
    assert r.returncode == 0, r.stderr
    total = np_ * (np_ + 1) / 2
    for rank in range(np_):
        assert f"[{rank}]<stdout>:sum {rank} [{total}, {total}]" in r.stdout
    calls = (d / "argv.log").read_text().splitlines()
    assert sorted(c.split()[5] for c in calls) == list(HOSTS)  # one ssh per host ...
    assert all(c.startswith(f"-x -p {port} -i {d / 'user'} ") for c in calls)  # ... as asked
    assert not wait_until_gone(f"--launcher-exec {d / 'ssh'}", 5)  # no proxy of this job is left


def test_wrong_port_fails_with_a_clear_message(run, sshd):
    d, port = sshd
    r = run("-np", 2, "-H", ",".join(f"{h}:1" for h in HOSTS), "-p", _free_port(),
            "-i", d / "user", f"--mpi-args=-launcher-exec {d / 'ssh'}", "true", timeout=120)
    assert r.returncode != 0
    assert "Connection refused" in r.stderr and "reachable with ssh" in r.stderr
