"""The README's quick start runs as printed: two processes train the body as two stages."""

from __future__ import annotations

import re
import sys

import pytest
from strategy_utils import REPO, run_command


@pytest.mark.timeout(180)
def test_quick_start_trains_through_two_processes(tmp_path):
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert "PipeStrategy(" in code and "trainer.fit(" in code
    (tmp_path / "quickstart.py").write_text(code)
    result = run_command([sys.executable, "quickstart.py"], cwd=tmp_path, timeout=150, name="quickstart.py")
    assert "`Trainer.fit` stopped: `max_epochs=2` reached." in result.stdout, result.stdout[-3000:]
    # The body was split (stage 1 set up in the other process) and the summary counts both stages' layers (Lightning
    # 2.4 prints the count before its name, 2.6 after).
    assert "PipelinedSequential" in result.stdout and re.search(r"Total params:?\s+74\.5 K|74\.5 K\s+Total params",
                                                                result.stdout), result.stdout[-3000:]
