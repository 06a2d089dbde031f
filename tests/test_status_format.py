"""``raylastic status RUN``'s report, formatted (cluster/status_command.py ``print_status``): no Ray needed.

    python -m pytest tests/test_status_format.py -q
"""

from __future__ import annotations

import io

from rich.console import Console

from raylastic.actors.status.run import RunStatus
from raylastic.cluster.status_command import StatusReport, print_status


def shown(status: RunStatus) -> str:
    out = io.StringIO()
    print_status("run-a", StatusReport(status=status, last_row=None, nodes={}), Console(file=out, width=200))
    return out.getvalue()


def test_the_status_names_the_model_parallel_layout_and_its_members():
    status = RunStatus(state="running", generation=2, world_size=4, step=17, members=["w0", "w1", "w2", "w3"],
                       failures=1, layout="pp2 x tp2")
    text = shown(status)
    assert "run run-a: running  step 17  generation 2  world size 4  layout pp2 x tp2  failures 1" in text
    assert "3  w3  node unknown (no dashboard)" in text
    assert "layout" not in shown(RunStatus(state="running", generation=0, world_size=2, step=1, members=["w0", "w1"],
                                           failures=0))
