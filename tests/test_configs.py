"""Every shipped LightningCLI config parses against its example (GPU ones too, which CI cannot run)."""

from __future__ import annotations

import contextlib
import importlib
import io
import sys

import pytest
import yaml
from strategy_utils import REPO

sys.path.insert(0, str(REPO / "examples"))
CONFIGS = sorted(p.relative_to(REPO) for p in (REPO / "configs").glob("*/*.yaml"))


def test_every_example_has_its_three_configs():
    examples = {p.stem for p in (REPO / "examples").glob("*.py")} - {"bert"}  # bert.py is a library
    assert {p.parent.name for p in CONFIGS} == examples
    for example in examples:
        assert {p.name for p in CONFIGS if p.parent.name == example} == {"cpu.yaml", "gpu.yaml", "gpu_dp.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_config_parses(config, monkeypatch):
    """``examples/<name>.py fit --config <config> --print_config``, in this process: parsed, not run."""
    example = importlib.import_module(config.parent.name)
    monkeypatch.setattr(sys, "argv", [f"{config.parent.name}.py", "fit", "--config", str(REPO / config),
                                      "--print_config"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit:
        example.main()
    assert exit.value.code in (0, None), out.getvalue()
    parsed = yaml.safe_load(out.getvalue())
    assert parsed["trainer"]["strategy"]["class_path"] == "lightning_pipe.PipeStrategy"
    assert [c["class_path"] for c in parsed["trainer"]["callbacks"]] == ["lightning_pipe.PipelineReport"]
