"""A Slurm cluster on this machine, started for the tests and stopped after them.

munged (its own key and socket), slurmctld and one slurmd per node (in the
foreground, as our child processes) run with a slurm.conf written to a fresh
directory. The nodes (``hl-node[1-N]``) are all this host (NodeHostname) at
127.0.0.1, each slurmd on its own port (``slurmd -N name``), so allocations
span several Slurm nodes with compressed node lists, and srun starts tasks on
each through its slurmd; the ports are free ones picked at start. ``SLURM_CONF`` in ``cluster.env`` points the client commands
(sbatch, srun, squeue, scancel) at it. ``stop()`` cancels every job, stops the
daemons by pid and waits for them; it is safe to call twice.
"""
import os
import signal
import socket
import subprocess
import time

import needed_tools

class SlurmUnavailable(Exception):
    """Why the cluster did not start: the tests skip when absent_reason() says why
    (not root, not installed); any other failure to start fails them."""


def absent_reason():
    """Why no cluster can run on this machine at all (the tests then skip), or None."""
    missing = needed_tools.missing("munged", "slurmctld", "slurmd", "sbatch", "srun", "ps")
    if missing:
        return missing
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs (not root here)"
    return None


def _free_ports(count):
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _own_session_and_parent_death():  # in each daemon, between fork and exec
    os.setsid()
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG: dies with us
    except Exception:
        pass


def _find(name):
    return needed_tools.find(name)


SLURM_CONF = """\
ClusterName=horolite
SlurmctldHost={host}(127.0.0.1)
SlurmUser={user}
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmdDebug=info
SlurmctldDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=30
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
{node_lines}
PartitionName=debug Nodes={nodelist} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
HOSTS_MARK = "# horolite's Slurm test bed"


def _name_nodes(nodes):
    """The node names resolve, as on a cluster (they are this host's loopback here): a job
    started by srun without MPI meets at its first node by name."""
    with open("/etc/hosts", "a") as f:
        f.write(f"127.0.0.1 {' '.join(nodes)} {HOSTS_MARK}\n")


def _unname_nodes():
    try:
        with open("/etc/hosts") as f:
            lines = f.readlines()
        with open("/etc/hosts", "w") as f:
            f.writelines(line for line in lines if HOSTS_MARK not in line)
    except OSError:
        pass


NODE_LINE = "NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN"


class SlurmCluster:
    def __init__(self, root, nodes=2, cpus=2):
        self.root = str(root)
        self.cpus = cpus  # per node
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [f"hl-node{i}" for i in range(1, nodes + 1)]
        self.nodelist = f"hl-node[1-{nodes}]" if nodes > 1 else self.nodes[0]
        self.procs = {}
        self.env = dict(os.environ)
        self.env["SLURM_CONF"] = os.path.join(self.root, "slurm.conf")
        for name in list(self.env):
            if name.startswith(("SLURM_", "SBATCH_", "SALLOC_")) and name != "SLURM_CONF":
                del self.env[name]

    # ---- start ----
    def start(self, timeout=60):
        reason = absent_reason()
        if reason:
            raise SlurmUnavailable(reason)
        try:
            socket.gethostbyname(self.host)
        except OSError:
            raise SlurmUnavailable(f"this host's name {self.host!r} does not resolve") from None
        _name_nodes(self.nodes)
        for sub in ("state", "munge"):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o755)
        self.munge_socket = os.path.join(self.root, "munge", "munge.socket")
        key = os.path.join(self.root, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        ctld_port, slurmd_port, *node_ports = _free_ports(2 + len(self.nodes))
        node_lines = "\n".join(NODE_LINE.format(name=name, host=self.host, port=port, cpus=self.cpus)
                               for name, port in zip(self.nodes, node_ports))
        import pwd
        with open(self.env["SLURM_CONF"], "w") as f:
            f.write(SLURM_CONF.format(user=pwd.getpwuid(os.geteuid()).pw_name, host=self.host,
                                      ctld_port=ctld_port, slurmd_port=slurmd_port,
                                      munge_socket=self.munge_socket, root=self.root,
                                      node_lines=node_lines, nodelist=self.nodelist))
        try:
            self._spawn("munged", [_find("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                                   f"--key-file={key}",
                                   f"--pid-file={self.root}/munge/munged.pid",
                                   f"--log-file={self.root}/munge/munged.log",
                                   f"--seed-file={self.root}/munge/munged.seed"])
            self._wait(lambda: os.path.exists(self.munge_socket), 10, "munged to open its socket")
            self._spawn("slurmctld", [_find("slurmctld"), "-D", "-i", "-f", self.env["SLURM_CONF"]])
            self._wait(self._controller_up, 30, "slurmctld to answer")
            for name in self.nodes:
                self._spawn(f"slurmd-{name}", [_find("slurmd"), "-D", "-N", name,
                                               "-f", self.env["SLURM_CONF"]])
            self._wait(self._nodes_idle, timeout, f"nodes {self.nodelist} to be idle")
        except Exception:
            self.stop()
            raise
        return self

    def _spawn(self, name, argv):
        log = open(os.path.join(self.root, f"{name}.out"), "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env,
                                            preexec_fn=_own_session_and_parent_death)
        log.close()

    def _wait(self, ready, seconds, what):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with code {proc.returncode} while "
                                           f"waiting for {what}: {self.tail(name)}")
            if ready():
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"timed out after {seconds}s waiting for {what}: "
                               f"{self.tail('slurmd-' + self.nodes[0])} {self.tail('slurmctld')}")

    def tail(self, name, lines=8):
        text = ""
        for path in (os.path.join(self.root, f"{name}.out"), os.path.join(self.root, f"{name}.log")):
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text += "".join(f.readlines()[-lines:])
        return text.strip()

    def _controller_up(self):
        return self.cmd("sinfo", "-h", "-o", "%P", check=False).returncode == 0

    def node_states(self):
        r = self.cmd("sinfo", "-h", "-N", "-o", "%T", check=False)
        return r.stdout.split()

    def _nodes_idle(self):
        return self.node_states() == ["idle"] * len(self.nodes)

    # ---- use ----
    def cmd(self, *argv, check=True, timeout=60, **kw):
        r = subprocess.run(list(argv), capture_output=True, text=True, env=kw.pop("env", self.env),
                           timeout=timeout, stdin=subprocess.DEVNULL, **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr}{r.stdout}")
        return r

    def job_state(self, job_id):
        r = self.cmd("scontrol", "show", "job", str(job_id), check=False)
        for field in r.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return ""

    def wait_job(self, job_id, seconds=120):
        """Wait until the job has ended; returns its final state."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
                return state
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} still {self.job_state(job_id)} after {seconds}s")

    # ---- stop ----
    def stop(self):
        _unname_nodes()
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.cmd("scancel", "--full", "-u", str(os.geteuid()), check=False, timeout=20)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.cmd(
                    "squeue", "-h", check=False, timeout=20).stdout.strip():
                time.sleep(0.3)
        for name in [f"slurmd-{n}" for n in self.nodes] + ["slurmctld", "munged"]:
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in self.step_daemons():  # slurmd's job steps outlive it: ours go too
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def step_daemons(self):
        """pids of the slurmstepd processes this cluster's slurmd started (by their SLURM_CONF)."""
        mark = f"SLURM_CONF={self.env['SLURM_CONF']}".encode()
        found = []
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/comm", "rb") as f:
                    if not f.read().startswith(b"slurmstepd"):
                        continue
                with open(f"/proc/{name}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(name))
            except (OSError, ValueError):
                continue
        return found
