"""What a tensor-parallel plan splits of a body, for the planner: each layer's split parameter bytes and modules, and
the shapes of the Linear pair that stands for its split layers when tensor parallel's cost is measured."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from lightning_pipe.engine.planning.measure import BodyProfile

__all__ = ["PROBE_WEIGHT_BYTES", "PROBE_WORK", "split_bytes", "split_modules", "tensor_probes"]

#: The largest weight of a probe's Linear layer (bytes): a wider body's hidden size is cut to it, its width and
#: tokens (what each all-reduce carries) kept.
PROBE_WEIGHT_BYTES = 16 << 20
#: The most multiply-adds of one of a probe's Linear layers (tokens x width x hidden): a larger micro-batch's tokens
#: are cut to it, so that the probe's passes take seconds, not minutes (the LM of ``bench_plan.py``'s half-batch
#: probe is this size: a pass of its halves about 70 ms on one CPU core).
PROBE_WORK = 1 << 30

Plan = Mapping[str, Any] | Callable[..., Any] | None


def _matches(pattern: str, name: str) -> bool:
    """Whether module name ``name`` is what ``pattern`` names, each ``*`` one dotted part."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


def _named(layer: nn.Module, k: int, plan: Mapping[str, Any]) -> list[nn.Module]:
    """The modules of layer ``k`` that ``plan``'s names reach (``*`` one name part; a name of the layer alone:
    itself), but those it keeps whole (``"replicate"``)."""
    found: dict[int, nn.Module] = {}
    for key, style in plan.items():
        head, _, rest = key.partition(".")
        if style == "replicate" or not _matches(head, str(k)):
            continue
        for name, module in layer.named_modules():
            if _matches(rest, name):
                found[id(module)] = module
    return list(found.values())


def split_modules(body: nn.Sequential, plan: Plan) -> list[int]:
    """How many modules of each layer of ``body`` a tensor-parallel ``plan`` splits: those its names reach but
    ``"replicate"`` ones; a function plan, each layer's ``nn.Linear`` modules. A colwise and rowwise pair of them
    costs a collective each action: the rowwise module's output forward, the colwise module's input gradient
    backward."""
    if plan is None:
        return [0] * len(body)
    if callable(plan):
        return [sum(isinstance(m, nn.Linear) for m in layer.modules()) for layer in body]
    return [len(_named(layer, k, plan)) for k, layer in enumerate(body)]


def split_bytes(body: nn.Sequential, plan: Plan) -> Callable[[int, int], float]:
    """Bytes of parameters of layers ``lo .. hi - 1`` that a tensor-parallel ``plan`` splits: those of the layers
    its names reach (by their first part, ``*`` any); a function plan: every layer."""
    if plan is None:
        return lambda lo, hi: 0.0
    heads = [] if callable(plan) else [name.partition(".")[0] for name in plan]
    sizes = [sum(p.numel() * p.element_size() for p in layer.parameters())
             if callable(plan) or any(_matches(head, str(k)) for head in heads) else 0 for k, layer in enumerate(body)]
    return lambda lo, hi: float(sum(sizes[lo:hi]))


def tensor_probes(body: nn.Sequential, plan: Plan, profile: BodyProfile) -> list[tuple[int, int, int]]:
    """The shapes ``(tokens, width, hidden)`` of a colwise Linear(width, hidden) and rowwise Linear(hidden, width)
    pair on ``tokens`` rows, standing for ``body``'s split layers where tensor parallel's cost is measured: the first
    split Linear of the split layer whose forward is longest, on the tokens of a micro-batch of an eighth and of half
    the example's rows (what each all-reduce carries, and the compute each waits behind). A hidden size whose weight
    passes :data:`PROBE_WEIGHT_BYTES` is cut to it, and tokens whose work passes :data:`PROBE_WORK`. Empty without a
    plan or a split Linear."""
    counts = split_modules(body, plan)
    layers = sorted((k for k in range(len(body)) if counts[k]), key=lambda k: -profile.layers[k].forward)
    for k in layers:
        modules = body[k].modules() if callable(plan) else _named(body[k], k, plan)
        linear = next((m for m in modules if isinstance(m, nn.Linear)), None)
        if linear is None:
            continue
        width, hidden = linear.in_features, linear.out_features
        size = linear.weight.element_size()
        tokens_per_row = max(1, round(profile.boundary(k) / (width * size)))
        hidden = max(1, min(hidden, PROBE_WEIGHT_BYTES // (width * size)))
        most = max(1, PROBE_WORK // (width * hidden))
        tokens = sorted({min(most, max(1, profile.rows // r) * tokens_per_row) for r in (8, 2)})
        return [(n, width, hidden) for n in tokens]
    return []
