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
