"""The other hosts' /dev/shm files: reached as mpirun reached the host, removed only
when they pass the checks there."""
import os
import subprocess
import sys
import time

from launcher.shm_cleanup import _REMOVE, ShmLeftovers, remote_command


def test_the_remote_command_follows_mpiruns_way_to_the_host():
    hydra = ["env", "HYDRA_LAUNCHER_EXTRA_ARGS=-p 2222 -i key", "mpiexec", "-n", "4",
             "-launcher", "ssh"]
    assert remote_command(hydra, "node2") == ["ssh", "-o", "BatchMode=yes", "-o",
                                              "ConnectTimeout=5", "-p", "2222", "-i", "key",
                                              "node2"]
    ompi = ["mpirun", "--mca", "plm_ssh_args", "-p 2200", "-np", "4"]
    assert remote_command(ompi, "n3")[-3:] == ["-p", "2200", "n3"]
    for slurm in (["mpiexec", "-launcher", "slurm"], ["mpirun", "--prtemca", "plm", "slurm"]):
        assert remote_command(slurm, "n4")[:2] == ["srun", "--overlap"]
        assert "--nodelist=n4" in remote_command(slurm, "n4")


def test_only_this_hosts_reports_are_removed_here_and_others_are_kept_per_host():
    shm = ShmLeftovers()
    shm.reported(["/dev/shm/mpich_shm_a", "/tmp/not-shm"])
    shm.reported(["/dev/shm/mpich_shm_b"], host="node2")
    shm.reported([], host="node3")
    assert shm.seen == {"/dev/shm/mpich_shm_a"}
    assert shm.remote == {"node2": {"/dev/shm/mpich_shm_b"}}


def test_the_remote_program_removes_only_this_users_recent_files_under_dev_shm(tmp_path):
    mine = f"/dev/shm/horolite-test-{os.getpid()}"
    open(mine, "w").close()
    outside = tmp_path / "x"
    outside.write_text("")
    try:
        done = subprocess.run([sys.executable, "-c", _REMOVE, str(time.time() + 3600), mine],
                              capture_output=True, text=True)
        assert done.stdout == "" and os.path.exists(mine)  # made before the job: kept
        done = subprocess.run([sys.executable, "-c", _REMOVE, str(time.time() - 60), mine,
                               str(outside), "/dev/shm/../etc/passwd"],
                              capture_output=True, text=True)
        assert done.stdout.split() == [mine]
        assert not os.path.exists(mine) and outside.exists()
    finally:
        if os.path.exists(mine):
            os.unlink(mine)
