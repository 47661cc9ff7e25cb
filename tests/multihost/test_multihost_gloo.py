"""horolite-run --gloo across simulated hosts: no mpirun, remote ranks start over real ssh,
and the job's key reaches them on ssh's stdin, never on a command line of either host."""
import json
import os

from jobs import ROOT, launch

GLOO_PROBE = os.path.join(ROOT, "tests", "launcher_rank", "gloo_probe.py")


def test_gloo_over_ssh_2_hosts_x_2_ranks(bed, no_leftovers, tmp_path):
    out = tmp_path / "marks"
    out.mkdir()
    r = launch(bed, "hl-a:2,hl-b:2", ["python", GLOO_PROBE, str(out)], timeout=120,
               env={"PROBE_PASSED": "from -x", "HOROLITE_MPIRUN": "/nonexistent/mpirun"},
               extra=["--gloo", "-x", "PROBE_PASSED", "--gloo-timeout-seconds", "20"])
    assert r.returncode == 0, r.stdout + r.stderr
    found = {int(name[5:]): json.loads((out / name).read_text()) for name in os.listdir(out)}
    assert sorted(found) == [0, 1, 2, 3]
    hosts = ["hl-a", "hl-a", "hl-b", "hl-b"]
    for rank, mark in found.items():
        env = mark["env"]
        assert mark["host"] == env["HOROLITE_HOSTNAME"] == hosts[rank]
        assert mark["peers"] == {str(q): hosts[q] for q in range(4)}
        assert (env["HOROLITE_RANK"], env["HOROLITE_SIZE"]) == (str(rank), "4")
        assert (env["HOROLITE_LOCAL_RANK"], env["HOROLITE_LOCAL_SIZE"]) == (str(rank % 2), "2")
        assert (env["HOROLITE_CROSS_RANK"], env["HOROLITE_CROSS_SIZE"]) == (str(rank // 2), "2")
        # hl-a's own address on its route to hl-b, for every rank (not 127.0.0.1)
        assert env["HOROLITE_RENDEZVOUS_ADDR"] == env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == \
            bed.host("hl-a").address
        assert mark["passed"]["PROBE_PASSED"] == "from -x"
        assert mark["cwd"] == os.getcwd()  # the launcher's directory, on hl-b too
        # Each rank looked at every command line on its own host (hl-a: horolite-run, the
        # ssh clients; hl-b: sshd's sessions and the wrappers) while the job ran.
        assert mark["key_on_cmdline"] == [], f"rank {rank}: the job key is on a command line"
        assert f"[{rank}]<stdout>:rank {rank} of 4 met 4\n" in r.stdout
