"""Rewrite the measured part of docs/benchmarks.md from bench/results/*.json.

The targets table and the "Latest results" tables come from the JSON and
Markdown each benchmark writes; the prose before "## Targets" and from
"## Where the time goes" on is kept as written.

    python bench/update_docs.py
"""
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
START, END = "## Targets, as measured", "## Where the time goes"
RUNS = [("Allreduce bandwidth", "allreduce_bandwidth"), ("Small tensors", "small_tensors"),
        ("Training throughput", "training_throughput"),
        ("Steady-state memory", "steady_state_memory"), ("Autotune recovery", "autotune_recovery"),
        ("One training step", "step_allreduce")]


def load(name):
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
        return json.load(f)


def results_table(name):
    """The script's own Markdown, without its command line and targets table."""
    with open(os.path.join(RESULTS, f"{name}.md")) as f:
        lines = [line.rstrip("\n") for line in f if not line.startswith("`")]
    if any(line.startswith("| target |") for line in lines):
        lines = lines[:next(i for i, line in enumerate(lines) if line.startswith("| target |"))]
    return "\n".join(lines).strip() + "\n"


def target_rows():
    rows = ["| target | measured | bound | met | what limits it | run |", "|---|---|---|---|---|---|"]
    for _, name in RUNS:
        for t in load(name)["targets"]:
            value = "n/a" if t["value"] is None else f"{t['value']:.4g} {t['unit']}".strip()
            bound = f"{t['comparison']} {t['bound']:g} {t['unit']}".strip()
            met = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
            rows.append(f"| {t['name']} | {value} | {bound} | {met} | {t['limited_by']} | `{name}` |")
    return "\n".join(rows)


def section(title, name):
    d = load(name)
    text = (f"### {title}\n\n`{d['command']}` — {d['date']}, commit {d['git_commit']}; other "
            f"processes kept {round(100 * d['other_processes_busy_fraction'])}% of the cores busy.\n\n"
            f"{results_table(name)}\n")
    if d.get("plot"):
        text += f"![{name}](images/{name}.png)\n"
    return text


def main():
    with open(DOC) as f:
        doc = f.read()
    head, tail = doc[:doc.index(START)], doc[doc.index(END):]
    with open(os.path.join(RESULTS, "autotune_notes.md")) as f:
        autotune_notes = f.read()
    body = "\n".join([
        START, "",
        "2 ranks on this 2-core VM, medians of one run of each script (the runs named in \"Latest\n"
        "results\").", "",
        target_rows(), "",
        "## Latest results", "",
        "Each table is the latest run of its script (date and commit in its heading line); the PNG\n"
        "next to it is written by the same run.", "",
        *[section(title, name) + (autotune_notes if name == "autotune_recovery" else "")
          for title, name in RUNS],
    ])
    with open(DOC, "w") as f:
        f.write(head + body + "\n" + tail)


if __name__ == "__main__":
    main()
