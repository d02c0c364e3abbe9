"""The off-graph KV cache: storage the runtime owns and the model only reaches through
``update_and_attend(layer, qkv, batch)`` (one fused projection's rows).

`StepBatch` describes one forward step; `KVPool` holds every session's K/V in one of three
layouts (`KVConfig.layout`: flat, ring, cell), allocated once; `attend` is the shared SDPA
attention over gathered keys.
"""

from slotserve.kv.attention import attend
from slotserve.kv.batch import StepBatch
from slotserve.kv.config import KVConfig
from slotserve.kv.pool import KVPool
from slotserve.kv.store import KVStore

__all__ = ["KVConfig", "KVPool", "KVStore", "StepBatch", "attend"]
