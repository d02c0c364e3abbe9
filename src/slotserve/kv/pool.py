"""`KVPool`: the one KV cache of an engine, allocated once and never grown.

Its three jobs live in three modules, each the base of the next:

- `slotserve.kv.pool_sessions` (`SessionPool`): the storage, the session table, the slot
  rows and the block allocator; binding (`reserve`, `extend`, `clone`, `rewind`,
  `release`), the step (`begin_step`, then `update_and_attend` on the step's `StepPlan`)
  and speculative steps (`hold_tentative`, `roll_back`).
- `slotserve.kv.pool_snapshots` (`SnapshotPool`): read-only snapshots (`publish`,
  `release_into`, `reserve_from`, `drop_snapshot`), copy-on-write blocks, ring row copies
  and parked slots.
- `slotserve.kv.pool_payload` (`PayloadPool`): a snapshot's payload for the prefix
  cache's disk tier (`payload_parts`, `payload_of`, `read_payload`, `load_payload`).

Every operation either completes or raises a typed error having changed nothing;
`check_integrity` asserts every invariant of all three.
"""

from __future__ import annotations

from slotserve.kv.pool_payload import PayloadPart, PayloadPool, SnapshotPayload
from slotserve.kv.pool_sessions import PoolUsage, TentativeRows

__all__ = ["KVPool", "PayloadPart", "PoolUsage", "SnapshotPayload", "TentativeRows"]


class KVPool(PayloadPool):
    """K/V storage for up to ``max_seqs`` sessions of up to ``max_context`` positions, with
    snapshots and their payloads (see the module doc for which module does what)."""
