"""Lightning's two packages: one binding source, loaded once for ``pytorch_lightning`` and once for ``lightning``.

Lightning ships the same classes twice, as ``pytorch_lightning`` (with ``lightning_fabric``) and as
``lightning.pytorch`` (with ``lightning.fabric``); each Trainer refuses the other's strategies and callbacks.
Lightning itself keeps one source and generates the standalone copy by rewriting its imports; so does this
module, at import time and in memory::

    lightning_pipe/lightning/**/*.py ──(as written)─────────────────► lightning_pipe.lightning (pytorch_lightning)
                                    ──(pytorch_lightning → lightning.pytorch,
                                       lightning_fabric → lightning.fabric)──► lightning_pipe.lightning_pytorch

The second tree is served by a finder on ``sys.meta_path``, compiled from the same files (tracebacks point at
them); the engine and the transport, which import no Lightning, are shared by both. Neither Lightning package is
imported here: a program that uses the engine alone loads none.

Which tree a program gets:

- ``lightning_pipe.PipeStrategy`` (and ``PipelineReport``) is the class of the Lightning package that the module
  asking for it imported from (``from lightning_pipe import PipeStrategy`` after ``import lightning as L``), else of
  the one the program imported; with both or neither imported, the default (``lightning`` where installed). An
  instance of one tree's ``PipeStrategy`` handed to the other tree's Trainer becomes that tree's (:func:`adopt`),
  so the order of imports does not matter. A subclass cannot change tree: subclass the tree's own class
  (``lightning_pipe.lightning.PipeStrategy`` or ``lightning_pipe.lightning_pytorch.PipeStrategy``).
- ``strategy="pipe"``: each package's ``StrategyRegistry`` gets the name as the package is imported (or at once,
  if it already is), without importing the binding until a Trainer asks for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["FABRICS", "MIRROR", "SOURCE", "TREES", "accept", "adopt", "binding", "fabric_binding", "fabric_of",
           "install", "rewrite", "tree_of", "tree_of_namespace", "tree_of_program"]

#: The binding's source package (written against ``pytorch_lightning``) and its mirror for ``lightning.pytorch``.
SOURCE = "lightning_pipe.lightning"
MIRROR = "lightning_pipe.lightning_pytorch"

#: Each tree: its trainer package and the binding loaded for it.
TREES = {"pytorch_lightning": SOURCE, "lightning.pytorch": MIRROR}

_SOURCE_DIR = Path(__file__).parent / "lightning"
_RENAMES = [
    (re.compile(r"(?<![\w.])pytorch_lightning\b"), "lightning.pytorch"),
    (re.compile(r"(?<![\w.])lightning_fabric\b"), "lightning.fabric"),
    (re.compile(r"(?<![\w.])lightning_pipe\.lightning\b"), MIRROR),
]


def rewrite(source: str) -> str:
    """``source``, written against ``pytorch_lightning``, rewritten against ``lightning.pytorch``: the imports and
    every dotted name of the standalone packages (and of the binding itself) renamed, nothing else."""
    for pattern, replacement in _RENAMES:
        source = pattern.sub(replacement, source)
    return source


class _MirrorLoader(importlib.abc.Loader):
    """Runs a module of the binding's source rewritten for ``lightning.pytorch`` (never cached as bytecode: the
    source's own cache holds the other tree)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        code = compile(rewrite(self.path.read_text(encoding="utf-8")), str(self.path), "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 - our own source, renamed


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the mirror's modules, and registers ``strategy="pipe"`` in each Lightning package as it loads."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == MIRROR or fullname.startswith(MIRROR + "."):
            return _mirror_spec(fullname)
        tree = _REGISTRIES.get(fullname) or _FABRIC_REGISTRIES.get(fullname)
        if tree is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Registering(spec.loader, tree)
        return spec


def _mirror_spec(fullname: str) -> importlib.machinery.ModuleSpec | None:
    parts = fullname[len(MIRROR):].lstrip(".").split(".") if fullname != MIRROR else []
    base = _SOURCE_DIR.joinpath(*parts)
    if (base / "__init__.py").is_file():
        spec = importlib.machinery.ModuleSpec(fullname, _MirrorLoader(base / "__init__.py"), is_package=True,
                                              origin=str(base / "__init__.py"))
        spec.submodule_search_locations = []  # submodules come from this finder alone, never from a path
    elif base.with_suffix(".py").is_file():
        spec = importlib.machinery.ModuleSpec(fullname, _MirrorLoader(base.with_suffix(".py")),
                                              origin=str(base.with_suffix(".py")))
    else:
        return None
    spec.has_location = True
    return spec


class _Registering(importlib.abc.Loader):
    """A Lightning package's ``strategies`` module, loaded as usual, then given ``strategy="pipe"``."""

    def __init__(self, loader: importlib.abc.Loader, tree: str) -> None:
        self.loader, self.tree = loader, tree

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _register(module, self.tree)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... as the real loader answers them
        return getattr(self.loader, name)


#: Each package's module holding its ``StrategyRegistry``, and the tree it belongs to.
_REGISTRIES = {f"{tree}.strategies": tree for tree in TREES}


#: Fabric's package of each tree, and the module holding its ``_StrategyRegistry``.
FABRICS = {"pytorch_lightning": "lightning_fabric", "lightning.pytorch": "lightning.fabric"}
_FABRIC_REGISTRIES = {f"{fabric}.strategies": tree for tree, fabric in FABRICS.items()}


def _register(strategies: ModuleType, tree: str) -> None:
    """Name ``"pipe"`` in ``strategies.StrategyRegistry`` (the Trainer's) or ``STRATEGY_REGISTRY`` (Fabric's): a
    factory that imports the tree's binding only when a Trainer or a Fabric asks for the name."""
    fabric = strategies.__name__ in _FABRIC_REGISTRIES

    def pipe(**kwargs: Any) -> Any:
        return (fabric_binding(tree) if fabric else binding(tree)).PipeStrategy(**kwargs)

    pipe.__doc__ = f"PipeStrategy for {tree}'s {'Fabric' if fabric else 'Trainer'} (lightning_pipe)."
    registry = strategies.STRATEGY_REGISTRY if fabric else strategies.StrategyRegistry
    registry.register("pipe", pipe, description="Pipeline parallelism over torch.distributed.rpc", override=True)
    accept()


def accept() -> None:
    """Each loaded package's Trainer accepts the other package's ``PipeStrategy`` as a strategy, and each Fabric
    either package's (a virtual subclass of its ``Strategy``), so that the strategy can :func:`adopt` the package
    and loop it is given to."""
    for name, tree in {**_REGISTRIES, **_FABRIC_REGISTRIES}.items():
        base = getattr(sys.modules.get(name), "Strategy", None)
        for other, binding_name in TREES.items():
            module = sys.modules.get(f"{binding_name}.trainer.strategy")
            if base is None or module is None or not hasattr(module, "PipeStrategy"):
                continue
            if other != tree or name in _FABRIC_REGISTRIES:
                base.register(module.PipeStrategy)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once) and register ``"pipe"`` in the packages already loaded."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name, tree in _REGISTRIES.items():
        if name in sys.modules and hasattr(sys.modules[name], "StrategyRegistry"):
            _register(sys.modules[name], tree)
    for name, tree in _FABRIC_REGISTRIES.items():
        if name in sys.modules and hasattr(sys.modules[name], "STRATEGY_REGISTRY"):
            _register(sys.modules[name], tree)


def _installed(tree: str) -> bool:
    try:
        return importlib.util.find_spec(tree) is not None
    except ModuleNotFoundError:  # "lightning.pytorch" without "lightning"
        return False


def tree_of_namespace(namespace: dict[str, Any]) -> str | None:
    """The one Lightning package whose modules or names ``namespace`` (a module's globals) holds, or None."""
    found = set()
    for value in list(namespace.values()):
        try:
            name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
        except Exception:  # noqa: BLE001 - a value that will not say: not a Lightning name
            continue
        if not isinstance(name, str) or name.startswith("lightning_pipe"):
            continue
        if name.split(".")[0] in ("pytorch_lightning", "lightning_fabric"):
            found.add("pytorch_lightning")
        elif name == "lightning" or name.startswith("lightning."):
            found.add("lightning.pytorch")
    return found.pop() if len(found) == 1 else None


def tree_of_program(namespace: dict[str, Any] | None = None) -> str:
    """The Lightning package this program uses: the one the asking module (``namespace``, its globals) imported
    from; else the one imported; with both or neither, ``lightning.pytorch`` where installed (Lightning's
    documented import), else ``pytorch_lightning``."""
    asked = tree_of_namespace(namespace) if namespace is not None else None
    if asked is not None:
        return asked
    loaded = [tree for tree in TREES if sys.modules.get(tree) is not None]
    if len(loaded) == 1:
        return loaded[0]
    if _installed("lightning.pytorch"):
        return "lightning.pytorch"
    if _installed("pytorch_lightning"):
        return "pytorch_lightning"
    raise ModuleNotFoundError(
        "PipeStrategy needs PyTorch Lightning, and neither of its packages is installed: pip install lightning "
        "(or pytorch-lightning)")


def binding(tree: str | None = None, namespace: dict[str, Any] | None = None) -> ModuleType:
    """The binding loaded for ``tree`` (``"pytorch_lightning"`` or ``"lightning.pytorch"``; default: the one of the
    module whose globals are ``namespace``, or this program's, :func:`tree_of_program`)."""
    return importlib.import_module(TREES[tree or tree_of_program(namespace)])


def fabric_binding(tree: str | None = None, namespace: dict[str, Any] | None = None) -> ModuleType:
    """The Fabric binding loaded for ``tree`` (as :func:`binding`): ``PipeStrategy`` for that package's Fabric."""
    return importlib.import_module(TREES[tree or tree_of_program(namespace)] + ".fabric")


def fabric_of(value: Any) -> str | None:
    """The tree whose Fabric package ``value``'s class comes from (an accelerator Fabric made), or None."""
    module = type(value).__module__
    return next((tree for tree, fabric in FABRICS.items() if module.startswith(fabric + ".")), None)


def tree_of(value: Any) -> str | None:
    """The Lightning package ``value``'s class comes from, or None if from neither."""
    module = type(value).__module__
    for tree in TREES:
        if module == tree or module.startswith(tree + "."):
            return tree
    if module.startswith("lightning_fabric."):
        return "pytorch_lightning"
    if module.startswith("lightning.fabric."):
        return "lightning.pytorch"
    return None


def adopt(strategy: Any, accelerator: Any, arguments: dict[str, Any]) -> None:
    """Make ``strategy`` (a ``PipeStrategy`` of one tree) the other tree's if ``accelerator``, which the Trainer is
    giving it, comes from that tree: its class becomes that tree's ``PipeStrategy`` and its constructor runs again
    with the ``arguments`` it was given. A subclass is refused, with the class to derive from instead."""
    here = next(t for t, name in TREES.items() for base in type(strategy).__mro__
                if base.__name__ == "PipeStrategy" and base.__module__ == f"{name}.trainer.strategy")
    fabric = fabric_of(accelerator)
    if fabric is not None:  # given to a Fabric: that package's Fabric strategy, with the same arguments
        if type(strategy).__name__ != "PipeStrategy" or type(strategy).__module__ != f"{TREES[here]}.trainer.strategy":
            raise TypeError(
                f"{type(strategy).__qualname__} derives from {TREES[here]}.PipeStrategy, the Trainer's binding, and "
                f"was given to a Fabric: derive it from {TREES[fabric]}.fabric.PipeStrategy instead")
        target = fabric_binding(fabric).PipeStrategy
        given = dict(arguments)
        given["precision"] = given.pop("precision_plugin", None)
        strategy.__dict__.clear()
        strategy.__class__ = target
        target.__init__(strategy, **given)
        return
    tree = tree_of(accelerator)
    if tree is None or tree == here:
        return
    target = binding(tree).PipeStrategy
    if type(strategy).__name__ != "PipeStrategy" or type(strategy).__module__ != f"{TREES[here]}.trainer.strategy":
        raise TypeError(
            f"{type(strategy).__qualname__} derives from {TREES[here]}.PipeStrategy, the binding for {here}, and "
            f"was given to {tree}'s Trainer: derive it from {TREES[tree]}.PipeStrategy instead (lightning_pipe."
            f"PipeStrategy is the class of the Lightning package the program imported, when only one is)")
    strategy.__dict__.clear()
    strategy.__class__ = target
    target.__init__(strategy, **arguments)
