"""Where stashed tensors wait for their pop: the tracker installed on the current thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from torch import Tensor

from lightning_pipe.engine.skip.namespace import SkipKey

__all__: list[str] = []


class SkipTracker:
    """Holds stashed tensors until they are popped, within one forward of one partition or module.

    ``imports`` are tensors stashed by an earlier partition and delivered to this one; stashes whose key
    is in ``exports`` are handed out to a later partition instead of being kept here.
    """

    def __init__(self, imports: Mapping[SkipKey, Tensor | None] | None = None,
                 exports: frozenset[SkipKey] = frozenset()) -> None:
        self.imports: dict[SkipKey, Tensor | None] = dict(imports or {})  # None: stashed as None
        self.export_keys = exports
        self.exported: dict[SkipKey, Tensor | None] = {}
        self.local: dict[SkipKey, Tensor | None] = {}

    def save(self, key: SkipKey, tensor: Tensor | None) -> None:
        """Stash ``tensor`` under ``key``."""
        if key in self.export_keys:
            self.exported[key] = tensor
        else:
            self.local[key] = tensor

    def load(self, key: SkipKey) -> Tensor | None:
        """Pop the tensor stashed under ``key``."""
        if key in self.imports:
            return self.imports.pop(key)
        try:
            return self.local.pop(key)
        except KeyError:
            ns, name = key
            raise RuntimeError(
                f"pop('{name}') found nothing stashed under that name (namespace: {ns!r}); a layer before it "
                "in the sequence must 'yield stash(...)' it in the same forward"
            ) from None


_local = threading.local()


def current_skip_tracker() -> SkipTracker:
    """The tracker of this thread; outside a pipeline, one per thread for plain ``nn.Sequential`` use."""
    tracker = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.default = getattr(_local, "default", None) or SkipTracker()
    return tracker


@contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Iterator[None]:
    """Install ``tracker`` on this thread for the enclosed code."""
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield
    finally:
        _local.tracker = previous
