"""Write docs/benchmarks.md from the result files under benchmarks/results/ (stdlib only).

One section per ``benchmarks/results/*.json`` (rendered by benchmarks/report_sections.py): the headline
figures, the parameters the JSON recorded and the command that wrote it. Hand-written notes come from
docs/benchmarks-notes.md: its text before the first ``## `` heading opens the page, a ``## <file stem>``
section (``## throughput``) follows that file's generated section, and any other ``## `` section goes at
the end as it is. Run from anywhere::

    .venv/bin/python benchmarks/report.py            # rewrite docs/benchmarks.md
    .venv/bin/python benchmarks/report.py --check    # exit 1 if docs/benchmarks.md is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import REPO_ROOT, RESULTS  # noqa: E402
from benchmarks.report_format import generic  # noqa: E402
from benchmarks.report_sections import RENDERERS  # noqa: E402

NOTES = REPO_ROOT / "docs" / "benchmarks-notes.md"
OUTPUT = REPO_ROOT / "docs" / "benchmarks.md"

TITLES = {  # page order; a result file not named here gets a generic section after these
    "throughput": "Throughput",
    "throughput_same_allocator": "Throughput, the peer with our malloc thresholds",
    "throughput_same_allocator_1_worker": "Throughput, the peer with our malloc thresholds, 1 worker a side",
    "step_costs": "Step costs",
    "step_costs_ray": "Step costs in Ray actors",
    "recovery": "Recovery and scale-up",
    "redundancy": "In-memory redundancy (HSDP)",
    "copy_cost": "The buddy copy's cost, same processes",
    "balance": "Uneven workers: batch shares by speed",
    "memory": "Memory",
    "checkpoint": "Checkpoints",
    "communication": "Communication",
    "slow_links": "Slow links: time to a target loss",
    "model_parallel": "Model parallelism: layouts against torchrun",
    "model_parallel_recovery": "Model parallelism: recovery from a lost worker, three ways",
    "rendezvous": "Rendezvous: the store over Ray against TCPStore",
    "control_plane": "The control plane as the group grows (simulated)",
    "control_plane_real": "The control plane as the group grows (real processes)",
}


def command_of(result: dict) -> str:
    """The recorded command in its runnable form: ``python benchmarks/x.py`` became ``python -m benchmarks.x``."""
    recorded = result.get("command") or result.get("machine", {}).get("command", "")
    module = re.sub(r"^\S*python3?\s+(?:-m\s+benchmarks\.(\w+)|benchmarks/(\w+)\.py)",
                    lambda m: f".venv/bin/python -m benchmarks.{m.group(1) or m.group(2)}", recorded)
    return module or "(not recorded)"


def machine_line(result: dict) -> str:
    machine = result.get("machine", {})
    cpus = machine.get("cpu_count", machine.get("cpus"))
    parts = [f"{cpus} CPUs" if cpus else None,
             f"torch {machine['torch']}" if "torch" in machine else None,
             f"Ray {machine['ray']}" if "ray" in machine else None,
             f"Python {machine['python']}" if "python" in machine else None]
    load = (machine.get("loadavg_1_5_15") or machine.get("load_average_at_end")
            or result.get("load_average_1_5_15_min", {}).get("before") or machine.get("load_avg_1min_before"))
    if load is not None:
        load = load[0] if isinstance(load, list) else load
        parts.append(f"load average {load:.1f}")
    date = result.get("date") or machine.get("date")
    git = result.get("code") or machine.get("git")
    if date:
        parts.append(f"run {date[:10]}" + (f" at {git.split()[0]}" if git else ""))
    return ", ".join(p for p in parts if p)


def read_notes() -> tuple[str, dict[str, str]]:
    """The notes file's opening text and its ``## `` sections by heading."""
    if not NOTES.exists():
        return "", {}
    text = NOTES.read_text()
    text = re.sub(r"<!--.*?-->\n?", "", text, flags=re.S)  # the file's comment says what it is for
    opening, *sections = re.split(r"^## ", text, flags=re.M)
    return opening.strip(), {s.split("\n", 1)[0].strip(): s.split("\n", 1)[1].strip() if "\n" in s else ""
                             for s in sections}


def section(stem: str, result: dict, images: list[str], note: str | None) -> list[str]:
    out = [f"## {TITLES.get(stem, stem)}", "", f"*{result.get('benchmark', stem)}*", "",
           "```bash", command_of(result), "```", "",
           f"Writes `benchmarks/results/{stem}.json`; recorded on {machine_line(result)}.", ""]
    try:
        out += RENDERERS.get(stem, generic)(result)
    except (KeyError, TypeError, ValueError) as error:  # a changed JSON layout still gets a section
        print(f"report.py: {stem}.json: {type(error).__name__}: {error}; showing its scalar fields", file=sys.stderr)
        out += generic(result)
    out += [""] + [f"![{image}](../benchmarks/results/{image})" for image in images] + ([""] if images else [])
    if note:
        out += [note, ""]
    return out


def render() -> str:
    opening, notes = read_notes()
    stems = sorted((p.stem for p in RESULTS.glob("*.json")), key=lambda s: (list(TITLES).index(s)
                                                                          if s in TITLES else len(TITLES), s))
    owners = {}  # an image belongs to the longest result stem it starts with: step_costs_ray_x.png to step_costs_ray
    for image in sorted(RESULTS.glob("*.png")):
        stems_of = [s for s in stems if image.stem == s or image.stem.startswith(s + "_")]
        if stems_of:
            owners[image.name] = max(stems_of, key=len)
    lines = ["# Benchmarks", "",
             "<!-- Generated by `.venv/bin/python benchmarks/report.py` from benchmarks/results/*.json and "
             "docs/benchmarks-notes.md: edit those, not this file. -->", ""]
    if opening:
        lines += [opening, ""]
    for stem in stems:
        owned = [image for image, owner in owners.items() if owner == stem]
        lines += section(stem, json.loads((RESULTS / f"{stem}.json").read_text()), owned, notes.pop(stem, None))
    for heading, text in notes.items():  # notes about no single result file: histories, retired scripts
        lines += [f"## {heading}", "", text, ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT.relative_to(REPO_ROOT)} is out of date: run .venv/bin/python benchmarks/report.py",
                  file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(REPO_ROOT)} from {len(list(RESULTS.glob('*.json')))} result files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
