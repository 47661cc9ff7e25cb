"""The --gloo elastic driver's decisions, turn by turn, without processes: fake workers
(a process that has or has not ended, with the code it ended with) and the rendezvous's
store as the ranks write it (blames, ready, entered)."""
import importlib
import signal

from test_launcher_cli import _import_launcher

_import_launcher()  # horolite.launcher from this checkout, installed or not
eg = importlib.import_module("horolite.launcher.elastic_gloo")
policy = importlib.import_module("horolite.launcher.elastic_policy")
elastic_flags = importlib.import_module("horolite.launcher.elastic_flags")
FixedHosts = importlib.import_module("horolite.launcher.host_pool").FixedHosts
gloo = importlib.import_module("horolite.launcher.gloo")
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
        w.slot = slots[len(d.workers)].local_rank if slots else d._free_slot(host)
        d.workers.append(w)
        return w
    d._start = start
    first = [h for h, n in hosts for _ in range(n)]
    slots = gloo.slots_for(first)
    d.members = [d._start(h, False, slots) for h in first]
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


def test_when_every_member_that_held_the_state_is_lost_the_job_fails(capsys):
    d = driver(hosts=(("a", 2),), min_np=1)
    w0, w1 = d.members
    d._evict([(w1, "was killed by signal 9 (SIGKILL)")])
    assert d._state_lost() is None  # w0 holds it
    d._next_generation([], [])
    w2 = d._start("a", True)
    d._next_generation([], [w2])  # w2 joins; it has not synced yet
    d._evict([(w0, "was killed by signal 9 (SIGKILL)")])
    assert d._state_lost() == 1
    assert "no worker left holds the training state" in capsys.readouterr().err
    d.server.put(SCOPE, "synced.w2", b"2")  # (had w2 synced, it would hold it)
    assert d._state_lost() is None


def test_every_member_lost_at_once_ends_the_watch():
    d = driver(hosts=(("a", 2),), min_np=1)
    for w in d.members:
        w.proc.returncode = -9
    assert d._watch() == 1


def test_failures_that_repeat_with_no_commit_between_them_end_the_job(capsys):
    d = driver(hosts=(("a", 2),), min_np=1)
    for k in range(policy.FAILURES_WITHOUT_COMMIT):
        d.server.put(SCOPE, "commit", f"w0 {k}".encode())  # a commit between failures
        d.changed = True
        assert d._next_generation([], []) is None
    for k in range(policy.FAILURES_WITHOUT_COMMIT - 1):  # (the last commit came before failure 1)
        d.changed = True
        assert d._next_generation([], []) is None, k
    d.changed = True
    assert d._next_generation([], []) == 1
    assert f"that is failure {policy.FAILURES_WITHOUT_COMMIT + 1} in a row with no commit" in \
        capsys.readouterr().err
    d = driver(hosts=(("a", 2),), min_np=1, ecfg=d.ecfg.__class__(**{
        **d.ecfg.__dict__, "reset_limit": 1000}))
    for k in range(2 * policy.FAILURES_WITHOUT_COMMIT):  # (an explicit --reset-limit rules)
        d.changed = True
        assert d._next_generation([], []) is None


def _local(plan):
    return {e["worker"]: (e["rank"], e["local_rank"], e["local_size"], e["cross_rank"],
                          e["cross_size"]) for e in plan["ranks"]}


def test_a_worker_keeps_its_slot_and_a_newcomer_takes_the_one_that_freed_up():
    d = driver(hosts=(("h", 2), ("g", 2)), min_np=2)
    w0, w1, w2, w3 = d.members
    assert _local(_plan(d, 0)) == {"w0": (0, 0, 2, 0, 2), "w1": (1, 1, 2, 0, 2),
                                   "w2": (2, 0, 2, 1, 2), "w3": (3, 1, 2, 1, 2)}
    d._evict([(w0, "was killed by signal 9 (SIGKILL)")])
    d._next_generation([], [])
    # w1 keeps local rank 1 (its GPU); rank 0 is the oldest survivor
    assert _local(_plan(d, 1)) == {"w1": (0, 1, 2, 0, 2), "w2": (1, 0, 2, 0, 1),
                                   "w3": (2, 1, 2, 1, 2)}
    w4 = d._start("h", True)
    assert w4.slot == 0  # the slot w0 left
    d._next_generation([], [w4])
    assert _local(_plan(d, 2)) == {"w1": (0, 1, 2, 0, 2), "w2": (1, 0, 2, 0, 2),
                                   "w3": (2, 1, 2, 1, 2), "w4": (3, 0, 2, 1, 2)}
    w5 = d._start("g", True)  # (a slot beyond those held: the next one)
    assert w5.slot == 2


def _plan(d, generation):
    import json
    return json.loads(d.server.items(SCOPE)[f"plan.{generation}"])


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


def test_a_survivor_blamed_again_in_a_later_generation_gets_a_fresh_grace(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(policy, "time", clock)
    d = driver(hosts=(("a", 3),), min_np=2)
    w0, w1, w2 = d.members
    d.server.put(SCOPE, "blame.0.w0", b"1")  # w0 names w1 (falsely)
    assert d._hung(d._blamed(), []) == []  # its grace starts
    clock.now += 0.1
    d.server.put(SCOPE, "blame.0.w1", b"2")  # w1 says whom it lost itself: excused
    assert list(d._blamed()) == [w2]
    d._evict([(w2, "was named by w1 as a rank it lost")])
    d._next_generation([], [])
    for w in (w0, w1):
        d.server.put(SCOPE, f"entered.{w.name}", b"1")
    clock.now += 60
    d.server.put(SCOPE, "blame.1.w0", b"1")  # w1 named again, in generation 1
    assert d._hung(d._blamed(), []) == []  # a fresh grace, not ended at once
    clock.now += policy.BLAME_GRACE_SECONDS
    assert [w for w, _ in d._hung(d._blamed(), [])] == [w1]


def test_ranks_that_do_not_arrive_in_a_world_are_evicted_after_the_gloo_timeout(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(policy, "time", clock)
    d = driver(hosts=(("a", 4),), min_np=2)
    w0, w1, w2, w3 = d.members
    d._evict([(w3, "was killed by signal 9 (SIGKILL)")])
    d._next_generation([], [])
    assert d._late() == []  # nobody arrived yet: no clock
    d.server.put("world.1", "0", b"w0")  # w0 and w1 arrive; w2 hangs (SIGSTOP) on its way
    d.server.put("world.1", "1", b"w1")
    assert d._late() == []
    clock.now += 30.0 + policy.LATE_SLACK_SECONDS
    assert d._late() == [(w2, "did not arrive in generation 1 within --gloo-timeout-seconds 30")]
    for w in (w0, w1, w2):
        d.server.put(SCOPE, f"entered.{w.name}", b"1")
    assert d._late() == []  # (formed)


def test_the_losers_of_a_partition_go_together(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(policy, "time", clock)
    d = driver(hosts=(("a", 2), ("b", 2)), min_np=2)
    w0, w1, w2, w3 = d.members
    d.server.put(SCOPE, "blame.0.w0", b"2,3")  # the first blames of each half
    d.server.put(SCOPE, "blame.0.w2", b"0,1")
    assert d._hung(d._blamed(), []) == []
    clock.now += 0.5
    d.server.put(SCOPE, "blame.0.w1", b"2,3")  # the others come later
    d.server.put(SCOPE, "blame.0.w3", b"0,1")
    assert d._hung(d._blamed(), []) == []
    clock.now += 0.6
    assert sorted(w.name for w, _ in d._hung(d._blamed(), [])) == ["w2", "w3"]
