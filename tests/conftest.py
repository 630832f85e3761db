"""Shared test setup: every test starts from the same seed, and tests the CPU paths unless it is a CUDA test."""

import compileall
from pathlib import Path

import pytest
import torch


def pytest_sessionstart(session: pytest.Session) -> None:
    """Bytecode for the package, the tests' scripts and the examples, written once before any test starts: the
    suite starts a few hundred Python processes, and where ``PYTHONDONTWRITEBYTECODE`` is set (CI) each of them
    would otherwise compile every module it imports again (about a second each). Python reads the files whatever
    that variable says."""
    if hasattr(session.config, "workerinput"):  # a test worker (pytest -n): the controller wrote them
        return
    root = Path(__file__).resolve().parent.parent
    for part in ("lightning_pipe", "tests", "examples", "benchmarks"):
        compileall.compile_dir(root / part, quiet=1, workers=1)


@pytest.fixture(autouse=True)
def manual_seed_zero() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def cpu_by_default(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``Pipe`` made without ``devices`` takes every GPU there is; outside the CUDA tests (``test_cuda*``)
    it takes the CPU, so the suite checks the same paths on a machine with a GPU as on one without. Tests marked
    ``real_devices`` see the real choice."""
    if not request.node.path.name.startswith("test_cuda") and not request.node.get_closest_marker("real_devices"):
        monkeypatch.setattr("lightning_pipe.engine.pipe._default_devices", lambda n: [torch.device("cpu")] * n)


@pytest.fixture
def full_precision_matmul():
    """Float32 matrix products in full precision (no TF32) on CUDA, whatever the machine's default, for
    comparisons with float32 references; restored afterwards."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.fixture(scope="session")
def jobs(tmp_path_factory: pytest.TempPathFactory, worker_id: str):
    """The shared multi-process jobs (tests/jobs.py): each group of cases trains once per test run, in a
    directory every test worker (``pytest -n``) shares."""
    from jobs import Jobs

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if worker_id != "master" else base) / "jobs"
    root.mkdir(exist_ok=True)
    return Jobs(root)


#: The longest tests (whole example runs): started first, so that the test workers (``pytest -n``) share the rest
#: evenly instead of one of them starting a long one last.
LONGEST_FIRST = ("test_examples.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest first; tests marked ``gpu`` skipped where CUDA is not available (CI; ``.ci/gpu`` runs them:
    ``pytest -m gpu``)."""
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # stable: the order within each part stays
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every pretrained checkpoint entry read (``PretrainedFiles.read_parts``, through which every tensor is read),
    in order, each once per layer reading it."""
    from lightning_pipe.models import PretrainedFiles

    seen: list[str] = []
    original = PretrainedFiles.read_parts

    def read_parts(self, parts):  # noqa: ANN001, ANN202
        seen.extend(dict.fromkeys(name for name, _ in parts.values()))
        return original(self, parts)

    monkeypatch.setattr(PretrainedFiles, "read_parts", read_parts)
    return seen
