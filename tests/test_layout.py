"""The package's plan, checked on its source: layers import one way, no cycles, rooms of a readable size.

``engine`` (the pipeline in one process) knows neither RPC nor Lightning; ``transport`` (stages in other
processes) knows no Lightning; ``lightning`` (``PipeStrategy``) may use both. ``models`` (Hugging Face models as
bodies) is an optional layer above the engine: the only one that imports ``transformers``, imported by none.
Read from each module's own import statements, those inside functions included, so that a late import cannot
hide a wrong arrow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "lightning_pipe"
LAYERS = ["engine", "transport", "lightning"]  # each may import only those before it
OPTIONAL = {"models": ["engine"]}  # optional layers: what each may import; no other layer imports them
FORBIDDEN = {
    "engine": ("torch.distributed.rpc", "pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics"),
    "transport": ("pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics"),
    "models": ("torch.distributed.rpc", "pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics"),
}
EXTRAS = ("transformers",)  # what only the optional layers may import


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """What the module at ``path`` imports: external names as written, package modules resolved (``from
    lightning_pipe.engine import pipe`` is the module ``lightning_pipe.engine.pipe``)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            found.update(submodules)
            if len(submodules) < len(node.names):  # names defined in ``base`` itself
                found.add(base)
    return found


def layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and (parts[1] in LAYERS or parts[1] in OPTIONAL) else None


def may_import(mine: str | None, theirs: str) -> bool:
    """Whether a module of layer ``mine`` (None: a public face) may import one of layer ``theirs``."""
    if mine in OPTIONAL:
        return theirs == mine or theirs in OPTIONAL[mine]
    if theirs in OPTIONAL or mine is None:
        return theirs not in OPTIONAL
    return LAYERS.index(theirs) <= LAYERS.index(mine)


def test_every_module_is_in_a_layer_or_is_a_public_face():
    faces = {"lightning_pipe", "lightning_pipe.__main__", "lightning_pipe.skip", "lightning_pipe.balance",
             "lightning_pipe.packages"}
    loose = sorted(n for n in modules() if layer(n) is None and n not in faces and n.split(".")[1] != "compat")
    assert loose == [], f"modules outside engine/, transport/, lightning/: {loose}"


def test_layers_import_one_way_and_the_engine_knows_neither_rpc_nor_lightning():
    known = set(modules())
    wrong = []
    for name, path in modules().items():
        mine = layer(name)
        forbidden = FORBIDDEN.get(mine, ()) if mine is not None else ()
        if mine not in OPTIONAL:
            forbidden += EXTRAS
        for target in imports(path, name, known):
            theirs = layer(target) if target.startswith("lightning_pipe.") else None
            if theirs is not None and not may_import(mine, theirs):
                wrong.append(f"{name} -> {target}")
            if any(target == f or target.startswith(f + ".") for f in forbidden):
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_the_layout_check_sees_a_wrong_arrow():
    """The rules above, on arrows that break them: none may import the optional ``models``, which may import
    the engine alone."""
    assert may_import("models", "engine") and may_import("lightning", "transport") and may_import(None, "lightning")
    assert not any(may_import(mine, "models") for mine in (None, *LAYERS))
    assert not may_import("models", "transport") and not may_import("engine", "transport")


#: The rooms inside a layer, and the rooms of the same layer each may import: a data plane knows no stage, a
#: parallelism knows neither the data plane nor the stages, the shared core of the binding knows neither loop, and
#: the two loops know each other not at all. A layer's own top-level modules are the room "" (for the transport:
#: topology and placing; for the binding: the core both loops share).
ROOMS = {
    "transport": {"": {""}, "wire": {"", "wire"}, "parallel": {"", "parallel"},
                  "stages": {"", "wire", "parallel", "stages"}},
    "lightning": {"": {""}, "trainer": {"", "trainer"}, "fabric": {"", "fabric"}},
}


def room(name: str) -> tuple[str, str] | None:
    """(layer, room) of a module in a layer with rooms; a package's ``__init__`` (a face, which may re-export
    any of its rooms) is None."""
    parts = name.split(".")
    if len(parts) < 3 or parts[1] not in ROOMS:
        return None
    inner = parts[2] if len(parts) > 3 or parts[2] in ROOMS[parts[1]] else ""
    return (parts[1], inner) if inner in ROOMS[parts[1]] else None


def test_rooms_import_one_way():
    """Each loop's binding (``lightning/trainer``, ``lightning/fabric``) above the core both share; the transport's
    stages above its data plane (``wire``) and its parallelisms (``parallel``), which know nothing of each other."""
    known = set(modules())
    wrong = []
    for name, path in modules().items():
        mine = room(name)
        if mine is None or (path.name == "__init__.py" and mine[1] == ""):
            continue
        for target in imports(path, name, known):
            theirs = room(target) if target in known else None
            if theirs is not None and theirs[0] == mine[0] and theirs[1] not in ROOMS[mine[0]][mine[1]]:
                wrong.append(f"{name} -> {target}")
    assert wrong == []
    assert {r for n in known if (r := room(n))} == {(layer, r) for layer, rooms in ROOMS.items() for r in rooms}


def test_each_loop_and_each_parallelism_is_a_room_found_by_name():
    """The tree says where each thing is: a reader looking for Fabric's or the Trainer's binding, DDP, FSDP or the
    data plane finds a folder or a module of that name."""
    for where in ("lightning/trainer/strategy.py", "lightning/fabric/strategy.py", "transport/parallel/ddp.py",
                  "transport/parallel/fsdp.py", "transport/wire/dataplane.py", "engine/pipeline.py"):
        assert (PACKAGE / where).is_file(), where


def test_no_import_cycle():
    known = set(modules())
    graph = {name: {t for t in imports(path, name, known) if t in known and t != name}
             for name, path in modules().items()}
    # A package's __init__ that re-exports its modules imports them; they never import it back (checked here).
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle.extend(stack[stack.index(nxt):] + [node, nxt] if nxt in stack else [node, nxt])
                return True
            if state.get(nxt) is None and visit(nxt, stack + [node]):
                return True
        state[node] = 2
        return False

    assert not any(visit(n, []) for n in sorted(graph) if state.get(n) is None), f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("limit", [400])
def test_no_module_over_the_limit(limit):
    long = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {n: lines for n, lines in long.items() if lines > limit} == {}


@pytest.mark.parametrize("limit", [300])
def test_no_class_over_the_limit(limit):
    big = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit:
                big[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert big == {}


def private_imports(tree: ast.AST, name: str) -> list[str]:
    """The underscore names ``tree`` (module ``name``) imports from another module of the package
    (``module.name``, a dunder aside)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_pipe") and \
                node.module != name:
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_module_imports_another_ones_private_names():
    """What a module shares with another is public, named and documented: an underscore name stays in its module
    (the runner, the driver and the step messages once shared 43 of them)."""
    found = {name: private_imports(ast.parse(path.read_text()), name) for name, path in modules().items()}
    assert {name: names for name, names in found.items() if names} == {}
    assert private_imports(ast.parse("from lightning_pipe.engine.stage import _move, Stage"), "x") == \
        ["lightning_pipe.engine.stage._move"]  # the check sees one


def test_every_module_opens_with_a_docstring_and_public_names_have_one():
    missing = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        if not ast.get_docstring(tree):
            missing.append(name)
        for node in tree.body:
            public = isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
            if public and not ast.get_docstring(node):
                missing.append(f"{name}.{node.name}")
    assert missing == []


def test_the_engine_the_transport_and_compat_start_without_lightning():
    """Run, not only read: importing the package, its engine, transport and compat names loads no Lightning
    (the binding's names come on first use), so a program using ``Pipe`` or ``pipeline_over_rpc`` starts in the
    time torch takes."""
    code = ("import sys, lightning_pipe, lightning_pipe.compat.torchgpipe, lightning_pipe.compat.sync\n"
            "from lightning_pipe import Pipe, pipeline_over_rpc, run_pipeline\n"
            "from lightning_pipe.skip import skippable\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('pytorch_lightning', 'lightning', 'lightning_fabric', 'torchmetrics', 'transformers')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_lightning_names_come_on_first_use():
    """Asked for from a module that imported ``pytorch_lightning``: that package's binding's names (the other
    package's in tests/test_packages.py)."""
    import pytorch_lightning

    import lightning_pipe
    from lightning_pipe.lightning import PipelineReport, PipeStrategy, consolidate_checkpoint, grad_norm

    namespace = {"pl": pytorch_lightning}
    exec("import lightning_pipe\nnames = (lightning_pipe.PipeStrategy, lightning_pipe.PipelineReport, "  # noqa: S102
         "lightning_pipe.consolidate_checkpoint, lightning_pipe.grad_norm)", namespace)
    assert namespace["names"] == (PipeStrategy, PipelineReport, consolidate_checkpoint, grad_norm)
    assert set(lightning_pipe.__all__) <= set(dir(lightning_pipe))
    with pytest.raises(AttributeError, match="has no attribute 'PipeStrategyy'"):
        lightning_pipe.PipeStrategyy  # noqa: B018
