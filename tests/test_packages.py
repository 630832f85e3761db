"""Both of Lightning's packages, installed together: ``lightning.pytorch`` and ``pytorch_lightning`` each train
through ``PipeStrategy`` to the plain model's weights, take ``strategy="pipe"`` and ``class_path`` in LightningCLI,
and resume from each other's checkpoints.

The Lightning-level jobs run ``scripts/train.py`` itself against ``lightning.pytorch`` (groups "..., lightning.pytorch"
in tests/jobs.py); the user's programs run in fresh processes that import nothing before ``lightning_pipe``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from jobs import config as case_config
from strategy_utils import SCRIPTS, assert_same_weights, run_script
from test_strategy import load, plain_weights

MIRROR = "lightning_pipe.lightning_pytorch.trainer.strategy"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["L-2stages-sgd", "L-1f1b-adamw-onecycle", "L-2replicas-accumulate",
                                  "L-sharded-resume-full"])
def test_lightning_pytorch_trains_the_plain_models_weights(name, jobs, tmp_path):
    """GPipe, 1F1B with the loss on the last stage, 2 replicas accumulating, sharded checkpoints: under
    ``lightning.pytorch``'s Trainer, with ``PipeStrategy`` bound to that package."""
    result = jobs.result(name)
    assert result["trainer"].startswith("lightning.pytorch.") and result["strategy"] == MIRROR
    assert_same_weights(load(jobs.directory(name) / "final.ckpt"), plain_weights(case_config(name), tmp_path / "p"))
    if name == "L-sharded-resume-full":  # a sharded checkpoint of lightning.pytorch consolidates into the plain model
        epoch0 = load(jobs.directory(name) / "ckpts" / "epoch=0.ckpt")
        assert epoch0.keys() == load(jobs.directory(name) / "final.ckpt").keys()


@pytest.mark.timeout(900)
def test_checkpoints_resume_across_the_packages_both_ways(jobs):
    """Epoch 0 under ``pytorch_lightning``, epoch 1 resumed from it under ``lightning.pytorch``, epoch 2 resumed from
    that under ``pytorch_lightning`` again: the weights of the uninterrupted run (optimizer and scheduler state
    carried across)."""
    full = load(jobs.directory("resume-full") / "final.ckpt")
    for name in ("L-resume-from-pytorch-lightning", "resume-from-lightning-pytorch"):
        assert jobs.result(name)["global_step"] == 24
        assert_same_weights(load(jobs.directory(name) / "final.ckpt"), full, rtol=1e-6, atol=1e-7)
    assert jobs.result("resume-from-lightning-pytorch")["strategy"] == "lightning_pipe.lightning.trainer.strategy"
    assert jobs.result("L-resume-from-pytorch-lightning")["strategy"] == MIRROR


def user(package: str, how: str, out: Path) -> tuple[dict, dict]:
    run_script("user.py", package, how, str(out), timeout=240)
    return json.loads((out / "result.json").read_text()), torch.load(out / "final.pt")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return user("lightning", "plain", tmp_path_factory.mktemp("plain"))[1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("package", "how"), [("lightning", "string"), ("pytorch_lightning", "string"),
                                              ("pytorch_lightning", "early"), ("lightning", "early")])
def test_a_program_that_imports_lightning_pipe_first(package, how, plain, tmp_path):
    """``import lightning_pipe`` then the package: ``strategy="pipe"`` is that package's name; a ``PipeStrategy``
    made before the package was imported (for the default package) is taken by the package's Trainer. Both train
    to the plain model's weights."""
    result, weights = user(package, how, tmp_path)
    binding = MIRROR if package == "lightning" else "lightning_pipe.lightning.trainer.strategy"
    assert result["trainer"].startswith("lightning.pytorch." if package == "lightning" else "pytorch_lightning.")
    assert result["strategy"] == binding and result["steps"] == 4
    assert result["balance"] == ([2, 3] if how == "string" else [3, 2])  # inferred from example_input_array
    assert_same_weights(weights, plain)


@pytest.mark.timeout(600)
def test_a_program_of_the_standalone_package_resumes_from_its_checkpoint_as_if_uninterrupted(tmp_path):
    """``pytorch_lightning``'s ``fit(ckpt_path=...)`` (``Strategy.load_checkpoint`` with ``weights_only``, which
    Lightning before 2.6 lacked: .ci/floor runs this on the oldest Lightning pyproject.toml accepts) takes the
    second epoch from the first's checkpoint to the weights of both epochs trained uninterrupted."""
    run_script("user.py", "pytorch_lightning", "resume", str(tmp_path), timeout=300)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["trainer"].startswith("pytorch_lightning.")
    assert result["strategy"] == "lightning_pipe.lightning.trainer.strategy"
    assert result["steps"] == {"uninterrupted": 8, "first": 4, "final": 8}, result
    assert_same_weights(torch.load(tmp_path / "final.pt"), torch.load(tmp_path / "uninterrupted.pt"),
                        rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(600)
def test_lightning_pytorch_cli_takes_the_class_path_and_the_name(tmp_path):
    """``lightning.pytorch.cli.LightningCLI``: ``class_path: lightning_pipe.PipeStrategy`` with its arguments, and
    ``strategy: pipe``, train to the weights of the same CLI on one device."""
    trainer = {"accelerator": "cpu", "devices": 2, "max_steps": 4, "logger": False, "enable_checkpointing": False,
               "enable_progress_bar": False, "enable_model_summary": False}
    strategies = {"class_path": {"class_path": "lightning_pipe.PipeStrategy",
                                 "init_args": {"balance": [3, 2], "microbatches": 2}},
                  "name": "pipe", "plain": "auto"}
    weights = {}
    for how, strategy in strategies.items():
        config = {"seed_everything": 3, "trainer": {**trainer, "strategy": strategy,
                                                    **({"devices": 1} if how == "plain" else {})}}
        path = tmp_path / f"{how}.yaml"
        path.write_text(yaml.safe_dump(config))
        run_script("cli_lightning.py", "--config", str(path), "--out", str(tmp_path / how), timeout=240)
        result = json.loads((tmp_path / how / "result.json").read_text())
        assert (result["strategy"] == MIRROR) == (how != "plain"), result
        weights[how] = torch.load(tmp_path / how / "final.pt")
    assert_same_weights(weights["class_path"], weights["plain"])
    assert_same_weights(weights["name"], weights["plain"])


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_pipe_offers_the_names_of_the_package_the_program_imported(package):
    """``lightning_pipe.PipeStrategy`` and ``PipelineReport`` are those of the imported package, whichever was
    imported first; the registry of each package holds ``"pipe"`` before any binding is imported."""
    trainer = "lightning.pytorch" if package == "lightning" else "pytorch_lightning"
    # One process: the registry and the bindings loaded are read first, before the names are asked for (which
    # loads the binding).
    code = (f"import sys, lightning_pipe, {trainer}.strategies as s\n"
            "print('pipe' in s.StrategyRegistry, sorted(m for m in sys.modules if m.startswith('lightning_pipe.l')))\n"
            "from lightning_pipe import PipeStrategy, PipelineReport\n"
            "print(PipeStrategy.__module__, PipelineReport.__module__, issubclass(PipeStrategy, s.Strategy))\n")
    done = subprocess.run([sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120, cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr
    registered, names = done.stdout.splitlines()
    assert registered == "True []"  # named, and no binding loaded for it yet
    binding = "lightning_pipe.lightning_pytorch" if package == "lightning" else "lightning_pipe.lightning"
    assert names.split() == [f"{binding}.trainer.strategy", f"{binding}.trainer.report", "True"]


def test_the_names_are_those_of_the_package_the_asking_module_imported():
    """Both packages loaded in one process: ``lightning_pipe.PipeStrategy`` asked for in a module that imported
    ``lightning`` is ``lightning.pytorch``'s, in one that imported ``pytorch_lightning`` that package's; a strategy
    made for one is taken over by the other's Trainer (``packages.adopt``)."""
    code = ("import lightning, pytorch_lightning\n"
            "a, b = {'L': lightning}, {'pl': pytorch_lightning}\n"
            "for ns in (a, b): exec('from lightning_pipe import PipeStrategy, PipelineReport', ns)\n"
            "print(a['PipeStrategy'].__module__, a['PipelineReport'].__module__)\n"
            "print(b['PipeStrategy'].__module__, b['PipelineReport'].__module__)\n"
            "s = a['PipeStrategy'](balance=[1, 1])\n"
            "t = pytorch_lightning.Trainer(accelerator='cpu', devices=2, strategy=s, logger=False)\n"
            "print(type(t.strategy).__module__, t.strategy.balance, t.strategy is s)\n"
            "class Mine(b['PipeStrategy']): pass\n"  # a subclass, given to its own package's Trainer
            "t = pytorch_lightning.Trainer(accelerator='cpu', devices=2, strategy=Mine(balance=[1, 1]), logger=False)\n"
            "print(type(t.strategy).__name__)\n"
            "class Other(a['PipeStrategy']): pass\n"  # ... and to the other package's: refused, naming what to do
            "try:\n"
            "    pytorch_lightning.Trainer(accelerator='cpu', devices=2, strategy=Other(balance=[1, 1]))\n"
            "except TypeError as e:\n"
            "    print('refused:', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "lightning_pipe.lightning_pytorch.trainer.strategy lightning_pipe.lightning_pytorch.trainer.report",
        "lightning_pipe.lightning.trainer.strategy lightning_pipe.lightning.trainer.report",
        "lightning_pipe.lightning.trainer.strategy [1, 1] True", "Mine",
        "refused: Other derives from lightning_pipe.lightning_pytorch.PipeStrategy, the binding for lightning.pytorch, "
        "and was given to pytorch_lightning's Trainer: derive it from lightning_pipe.lightning.PipeStrategy instead "
        "(lightning_pipe.PipeStrategy is the class of the Lightning package the program imported, when only one "
        "is)"]


def test_the_mirror_is_the_source_with_its_imports_renamed():
    """One source: the binding for ``lightning.pytorch`` differs from the source only in the names of the
    packages, and in nothing that is not an import or a dotted name of them."""
    from lightning_pipe.packages import rewrite

    source = (Path(__file__).parent.parent / "lightning_pipe" / "lightning" / "trainer" / "strategy.py").read_text()
    mirrored = rewrite(source)
    assert "pytorch_lightning" not in mirrored and "lightning_fabric" not in mirrored
    assert "from lightning.pytorch.strategies import StrategyRegistry" in mirrored
    assert "import lightning.pytorch as pl" in mirrored
    assert rewrite("my_pytorch_lightning_helper, lightning_pipe.lightning_pytorch, x.pytorch_lightning") == (
        "my_pytorch_lightning_helper, lightning_pipe.lightning_pytorch, x.pytorch_lightning")
