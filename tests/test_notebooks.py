"""The notebooks run top to bottom on the CPU at their default (small) sizes, and git holds
them without outputs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_kernel_variants.ipynb", "02_io_backends.ipynb",
                                           "03_prefix_reuse.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} cell {i} holds outputs: run python3 scripts/strip_notebooks.py")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("ipykernel")
    if path.stem.startswith("03"):
        pytest.importorskip("vllm")
    # The kernel inherits this environment: import this checkout's tutti, keep scratch files here.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.setenv("TUTTI_NB_DIR", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no plot"
    # what a reader sees: no raw terminal colour codes, no stray value echoed by a cell's last line
    texts = [(i, o.get("text", "") if o.output_type == "stream" else str(o.get("data", {}).get("text/plain", "")))
             for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.outputs]
    coloured = [i for i, t in texts if "\x1b[" in t]
    assert not coloured, f"{path.name}: cells {coloured} print terminal colour codes"
    stray = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
             for o in c.outputs if o.output_type == "execute_result"]
    assert not stray, f"{path.name}: cells {stray} echo a value (end them with a print or a ';')"
    if path.stem.startswith("02"):
        from tutti.io.queue import open_queue

        usable = re.search(r"usable here: (\[.*?\])", "".join(t for _, t in texts))
        assert usable, "notebook 02 no longer says which backends are usable here"
        try:
            open_queue("nvme").close()
            nvme_here = True
        except Exception:
            nvme_here = False
        assert ("'nvme'" in usable.group(1)) == nvme_here, usable.group(0)
