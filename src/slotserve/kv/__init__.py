"""The off-graph KV cache: storage the runtime owns and the model only reaches through
``update_and_attend(layer, q, k, v, batch)``.

`StepBatch` describes one forward step; `attend` is the shared SDPA attention over
gathered keys; `ContiguousKV` is the per-slot contiguous store.
"""

from slotserve.kv.attention import attend
from slotserve.kv.batch import StepBatch
from slotserve.kv.contiguous import ContiguousKV
from slotserve.kv.store import KVStore

__all__ = ["ContiguousKV", "KVStore", "StepBatch", "attend"]
