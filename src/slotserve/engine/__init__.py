"""The batched engine: admission against max_seqs and the memory plan, priority classes,
chunked prefill interleaved with decode, streaming events, bounded cancellation.

`Engine` owns the step loop (one thread); `Scheduler` composes steps; `RequestHandle`
streams a request's `TokenEvent`s and its `Finished`.
Readers get typed, frozen views: `EngineStats`, `SlotView`, `PoolView`.
"""

from slotserve.engine.config import EngineConfig
from slotserve.engine.engine import Engine
from slotserve.engine.events import CancelAck, Finished, TokenEvent, Usage
from slotserve.engine.handle import RequestHandle
from slotserve.engine.pressure import PressureSource
from slotserve.engine.timings import RequestTimings
from slotserve.engine.views import EngineStats, PoolView, PrefixStats, SlotView

__all__ = [
    "CancelAck",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Finished",
    "PoolView",
    "PrefixStats",
    "PressureSource",
    "RequestHandle",
    "RequestTimings",
    "SlotView",
    "TokenEvent",
    "Usage",
]
