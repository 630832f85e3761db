"""docs/migration.md's snippets: each "after" runs as printed, and where the guide says that only the imports
change, the "before" imports are the "after" ones with their old module names."""

from __future__ import annotations

import re
import sys

import pytest
from dist_utils import free_port
from strategy_utils import REPO, run_command

GUIDE = (REPO / "docs" / "migration.md").read_text()

# Section -> how each import line of its "before" reads after the migration, and what the "after" prints.
IMPORTS = {
    "From torchgpipe": [(r"^import torchgpipe$", "from lightning_pipe.compat import torchgpipe"),
                        (r"^from torchgpipe\b", "from lightning_pipe.compat.torchgpipe")],
    "From fairscale's `Pipe`": [(r"^from fairscale\.nn import Pipe$",
                                 "from lightning_pipe.compat.torchgpipe import GPipe as Pipe")],
    "From torch's `sync.Pipe`": [(r"^from torch\.distributed\.pipeline\.sync\b", "from lightning_pipe.compat.sync")],
}
PRINTS = {
    "From torchgpipe": r"^balance \[\d, \d\] on \['cpu', 'cpu'\]: 12 micro-batches, loss \d+\.\d{4}$",
    "From fairscale's `Pipe`": r"^2 partitions, output \(16, 4\) on cpu$",
    "From torch's `sync.Pipe`": r"^RRef \[2, 1, 1\] \['cpu', 'cpu', 'cpu'\] \(16, 4\)$",
    "From Lightning 1.x's `RPCSequentialPlugin`": r"^trained 4 steps$",
}


def section(title: str) -> tuple[str, str]:
    """The "before" and "after" snippets of section ``title``."""
    text = GUIDE[GUIDE.index(f"## {title}\n"):]
    text = text[:text.find("\n## ", 1)]
    before = re.search(r"\nBefore[^\n]*:\n\n```python\n(.*?)```", text, re.DOTALL).group(1)
    after = re.search(r"\nAfter:\n\n```python\n(.*?)```", text, re.DOTALL).group(1)
    return before, after


def test_every_section_is_tested():
    assert re.findall(r"^## (From .*)$", GUIDE, re.MULTILINE) == list(PRINTS)


@pytest.mark.parametrize("title", list(IMPORTS))
def test_only_the_imports_change(title):
    before, after = section(title)
    lines = before.strip().splitlines()
    assert lines and all(line.startswith(("import ", "from ")) for line in lines)
    for line in lines:
        migrated = line
        for pattern, replacement in IMPORTS[title]:
            migrated = re.sub(pattern, replacement, migrated)
        assert migrated != line and migrated in after.splitlines(), (line, migrated)
        assert line not in after.splitlines()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("title", list(PRINTS))
def test_the_after_snippet_runs_as_printed(title, tmp_path):
    _, after = section(title)
    # The one change: the guide's fixed port, which another job on this machine may hold, becomes a free one.
    (tmp_path / "after.py").write_text(after.replace('"29500"', f'"{free_port()}"'))
    result = run_command([sys.executable, "after.py"], cwd=tmp_path, timeout=150, name=f"{title}: after.py")
    assert re.search(PRINTS[title], result.stdout, re.MULTILINE), result.stdout[-3000:]


def test_what_differs_is_what_the_guide_says():
    """The guide's word on what differs, checked against the code: there is no ``NoChunk`` to import, a
    non-tensor input is a ``TypeError``, and the balancers keep a model's ``.grad`` where torchgpipe raised."""
    import torch
    from torch import nn

    from lightning_pipe.compat.sync import Pipe
    from lightning_pipe.compat.torchgpipe.balance import balance_by_size, balance_by_time

    differs = GUIDE[GUIDE.index("## What differs on purpose"):]
    assert "there is no `NoChunk`\n  (`from lightning_pipe.compat.sync import NoChunk` raises `ImportError`)" in differs
    assert "no: a non-tensor input raises `TypeError`; there is no `NoChunk` (importing it raises `ImportError`)" \
        in GUIDE
    with pytest.raises(ImportError, match="cannot import name 'NoChunk'"):
        exec("from lightning_pipe.compat.sync import NoChunk", {})
    with pytest.raises(TypeError, match="must be a tensor or a tuple of tensors"):
        Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2)(torch.randn(4, 4), 3)

    assert "**The balancers leave an existing `.grad` untouched**" in differs
    assert 'torchgpipe\n  raised `ValueError("some parameter already has gradient")`' in differs
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert balance_by_time(2, model, torch.randn(4, 4), timeout=0.01) == [1, 1]
    assert balance_by_size(2, model, torch.randn(4, 4)) == [1, 1]
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
