"""Automatic balancing, by its public name: ``from lightning_pipe.balance import balance_by_time``.

The implementation is the engine's (:mod:`lightning_pipe.engine.balance`); this module names what users import.
"""

from lightning_pipe.engine.balance import balance_by_size, balance_by_time

__all__ = ["balance_by_time", "balance_by_size"]
