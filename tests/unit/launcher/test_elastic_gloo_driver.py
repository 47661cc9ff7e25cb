"""The --gloo elastic driver's decisions, turn by turn, without processes: fake workers
(a process that has or has not ended, with the code it ended with) and the rendezvous's
store as the ranks write it (blames, ready, entered)."""
import importlib
import signal

from test_launcher_cli import _import_launcher

_import_launcher()  # horolite.launcher from this checkout, installed or not
eg = importlib.import_module("horolite.launcher.elastic_gloo")
elastic_flags = importlib.import_module("horolite.launcher.elastic_flags")
FixedHosts = importlib.import_module("horolite.launcher.host_pool").FixedHosts
SCOPE = "elastic"


class Proc:
    def __init__(self):
        self.returncode = None

    def poll(self):
        return self.returncode


class FakeWorker:
    def __init__(self, name, host, joining=False):
        self.name, self.host, self.rank, self.joining = name, host, 0, joining
        self.evicted, self.proc, self.signals = None, Proc(), []

    def stop(self, signum=signal.SIGTERM):
        self.signals.append(signum)

    def failed(self):
        return self.proc.returncode not in (None, 0)

    def how(self):
        return f"exited with code {self.proc.returncode}"


class Store:
    def __init__(self):
        self.kv = {}

    def put(self, scope, key, value):
        self.kv.setdefault(scope, {})[key] = bytes(value)

    def items(self, scope):
        return dict(self.kv.get(scope, {}))


def driver(hosts=(("a", 3),), min_np=2, reset_limit=None, **kw):
    ecfg = elastic_flags.ElasticConfig(num_proc=sum(n for _, n in hosts), min_np=min_np,
                                       max_np=None, timeout=600.0, reset_limit=reset_limit,
                                       cooldown=None, script=None, slots_per_host=None)
    d = eg._Driver(None, ecfg, discovery=FixedHosts(list(hosts), "the hosts"))
    d.pool.refresh(first=True)
    d.server = Store()

    def start(host, joining, slots=None):
        w = FakeWorker(f"w{len(d.workers)}", host, joining)
        d.workers.append(w)
        return w
    d._start = start
    d.members = [d._start(h, False) for h, n in hosts for _ in range(n)]
    d._publish_plan(d.members)
    for k, v in kw.items():
        setattr(d, k, v)
    return d


def test_the_error_of_a_worker_already_evicted_is_not_the_training_codes():
    d = driver()
    w0 = d.members[0]
    d._evict([(w0, "was named by w1 as a rank it lost")])
    d._on_marker(w0, "elastic", {"event": "user-error", "text": "rank 0 raised LinkLost: x"})
    assert d._training_code_error({}) is None and d.user_errors == []
    w1 = d.members[0]
    d._on_marker(w1, "elastic", {"event": "user-error", "text": "rank 0 raised ValueError: y"})
    assert d._training_code_error({w1: "blamed"}) is None  # (evicted after its grace)
    assert d._training_code_error({}) == "w1 (host a): rank 0 raised ValueError: y"


def test_a_hung_rank_is_bounded_by_default_in_elastic_jobs():
    env = {}
    eg.stall_shutdown_default(env, {})
    assert env == {"HOROLITE_STALL_SHUTDOWN_TIME_SECONDS": "60"}
    for given in ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"},
                  {"HOROLITE_STALL_SHUTDOWN_TIME_SECONDS": "5"}):
        env = dict(given)  # (from horolite-run's flags)
        eg.stall_shutdown_default(env, {})
        assert env == given
        env = {}  # (from the job's environment)
        eg.stall_shutdown_default(env, given)
        assert env == {}
