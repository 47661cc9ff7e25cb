"""Rank source: the Slurm allocation ``horolite-run`` runs in (``sbatch``, ``salloc``).

Inside an allocation ``SLURM_JOB_NODELIST`` names the nodes, often compressed
(``node[01-04,07]``), and ``SLURM_TASKS_PER_NODE`` their task counts
(``2(x3),1``). The ranks are started by the MPI's own Slurm support (srun
starts its daemons), so no ssh is involved.
"""
from __future__ import annotations

import itertools
import re
from typing import List, Mapping, Optional, Tuple

from .rank_source import SLURM, Ranks

__all__ = ["expand_nodelist", "parse_tasks_per_node", "discover", "HELP"]

HELP = ("Check the allocation's nodes with `scontrol show job $SLURM_JOB_ID` and `sinfo -N`; "
        "the ranks are started with srun, so each node needs the same Python path")


def _split_outside_brackets(text: str) -> List[str]:
    items, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"bad Slurm node list {text!r}: unmatched ']'")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise ValueError(f"bad Slurm node list {text!r}: unmatched '['")
    items.append(current)
    return items


def _expand_range(body: str, whole: str) -> List[str]:
    """``01-03,7`` -> ["01", "02", "03", "7"]; the width of the start keeps zero padding."""
    out = []
    for part in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not match:
            raise ValueError(f"bad Slurm node list {whole!r}: range {part!r} is not N or N-M")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"bad Slurm node list {whole!r}: range {part!r} runs backwards")
        out.extend(str(n).zfill(len(first)) for n in range(int(first), int(last) + 1))
    return out


def expand_nodelist(text: str) -> List[str]:
    """``node[01-02,07],gpu1`` -> ["node01", "node02", "node07", "gpu1"] (Slurm's hostlist form)."""
    names: List[str] = []
    for item in _split_outside_brackets(text.strip()):
        if not item:
            raise ValueError(f"bad Slurm node list {text!r}: empty entry")
        pieces = re.split(r"(\[[^\]]*\])", item)  # literal, [ranges], literal, ...
        choices = [_expand_range(p[1:-1], text) if p.startswith("[") else [p]
                   for p in pieces if p]
        names.extend("".join(combo) for combo in itertools.product(*choices))
    return names


def parse_tasks_per_node(text: str) -> List[int]:
    """``2(x3),1`` -> [2, 2, 2, 1] (SLURM_TASKS_PER_NODE, SLURM_JOB_CPUS_PER_NODE)."""
    counts: List[int] = []
    for item in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ValueError(f"bad SLURM_TASKS_PER_NODE {text!r}: {item!r} is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _allocation(environ: Mapping[str, str], per_node_var: str) -> Tuple[Tuple[str, int], ...]:
    nodelist = environ["SLURM_JOB_NODELIST"]
    nodes = expand_nodelist(nodelist)
    per_node_text = environ.get(per_node_var) or environ.get("SLURM_JOB_CPUS_PER_NODE")
    per_node = parse_tasks_per_node(per_node_text) if per_node_text else [1] * len(nodes)
    if len(per_node) != len(nodes):
        raise ValueError(f"the Slurm allocation does not add up: SLURM_JOB_NODELIST={nodelist} "
                         f"names {len(nodes)} nodes, {per_node_var}={per_node_text} "
                         f"gives {len(per_node)} task counts")
    hosts = [(n, c) for n, c in zip(nodes, per_node) if c > 0]
    ntasks = environ.get("SLURM_NTASKS", "") if per_node_var == "SLURM_TASKS_PER_NODE" else ""
    if ntasks.isdigit():  # never more than the job's task count
        left, trimmed = int(ntasks), []
        for name, count in hosts:
            if left > 0:
                trimmed.append((name, min(count, left)))
                left -= min(count, left)
        hosts = trimmed
    return tuple(hosts)


def discover(args, environ: Mapping[str, str]) -> Optional[Ranks]:
    """The allocation's hosts and task counts when run inside one; else None.

    Run by ``srun`` (inside a job step), the step's variables describe that step:
    one task (``srun --pty bash``) gets the job's CPUs as slots, and mpirun's own
    srun may overlap the step (SLURM_OVERLAP=1); several tasks would each start
    a whole job, which is refused.
    """
    if not environ.get("SLURM_JOB_ID") or not environ.get("SLURM_JOB_NODELIST"):
        return None
    job = environ["SLURM_JOB_ID"]
    if environ.get("SLURM_STEP_ID") not in (None, "", "batch"):
        tasks = environ.get("SLURM_STEP_NUM_TASKS", "1")
        if tasks.isdigit() and int(tasks) > 1:
            raise ValueError(
                f"horolite-run was started by srun as one of {tasks} tasks (job {job}, "
                f"SLURM_STEP_NUM_TASKS={tasks}): each would start a job of its own. Run "
                f"horolite-run once, in the batch script or the salloc shell, or start the ranks "
                f"with srun alone: srun --mpi=pmi2 python train.py")
        hosts = _allocation(environ, "SLURM_JOB_CPUS_PER_NODE")
        origin = (f"the Slurm allocation (job {job} from inside step {environ['SLURM_STEP_ID']}: "
                  f"SLURM_JOB_NODELIST={environ['SLURM_JOB_NODELIST']}, "
                  f"SLURM_JOB_CPUS_PER_NODE={environ.get('SLURM_JOB_CPUS_PER_NODE', '?')})")
        return Ranks(hosts, origin, start=SLURM, help=HELP, mpirun_env=(("SLURM_OVERLAP", "1"),))
    hosts = _allocation(environ, "SLURM_TASKS_PER_NODE")
    origin = (f"the Slurm allocation (job {job}: "
              f"SLURM_JOB_NODELIST={environ['SLURM_JOB_NODELIST']}, "
              f"SLURM_TASKS_PER_NODE={environ.get('SLURM_TASKS_PER_NODE', '?')}"
              + (f", SLURM_NTASKS={environ['SLURM_NTASKS']}" if environ.get("SLURM_NTASKS") else "")
              + ")")
    return Ranks(hosts, origin, start=SLURM, help=HELP)
