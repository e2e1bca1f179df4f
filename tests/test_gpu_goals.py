"""``scripts/gpu_goals.py`` (the GPU speed-goals table of ``make gpu-check``) keeps working:
its smoke mode runs every measurement at tiny shapes on whatever device is here."""

import importlib.util
import os

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_goals.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is make gpu-check's")
def test_gpu_goals_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_goals", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "goals.json"
    assert mod.main(["--smoke", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| attention B |" in text and "auto_k / plain" in text
    assert out.exists()
