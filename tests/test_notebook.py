"""examples/sweep.ipynb runs top to bottom headless (nbclient, the venv's python3 kernel), small.

The notebook reads RAYLASTIC_SWEEP_QUICK=1 and sweeps 2 short trials; it starts and stops its
own local Ray inside the kernel, and writes under the temporary directory it runs in.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.processes

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = REPO_ROOT / "examples" / "sweep.ipynb"


def test_committed_notebook_has_no_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


def test_sweep_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLASTIC_SWEEP_QUICK", "1")
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert html.count('<img src="data:image/png;base64,') == 4 and "best accuracy" in html  # lr, batch, bucket, history
    assert len(list((tmp_path / "runs" / "sweeps" / "digits-notebook" / "plots").glob("*.png"))) == 4
    assert (tmp_path / "runs" / "digits-notebook-best" / "model.pt").exists()
