"""`StepBatch`: which sequences a forward step advances, and by how many tokens.

Built once per step by the caller (runner or engine), read by the model (positions) and by
the KV store (where to write, what each query may attend to). The pool's `begin_step`
gives it the step's `slotserve.kv.plan.StepPlan` (``plan``): the cells and masks every
layer reads, built once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from slotserve.kv.plan import StepPlan


@dataclass
class StepBatch:
    """A ragged batch: sequence ``b`` is KV session ``sessions[b]``, already holds
    ``starts[b]`` positions and appends ``lengths[b]`` new tokens in this step.

    The flattened token axis of the step is the concatenation of each sequence's new tokens.
    """

    sessions: list[int]
    starts: list[int]
    lengths: list[int]
    positions: torch.Tensor = field(init=False)
    # Set by the pool's `begin_step` (None before): what every layer of the step reads.
    plan: StepPlan | None = field(init=False, default=None, repr=False, compare=False)
    _pad_index: tuple[torch.Tensor, torch.Tensor] | None = field(
        init=False, default=None, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not (len(self.sessions) == len(self.starts) == len(self.lengths)) or not self.sessions:
            raise ValueError("StepBatch needs equal, non-empty sessions, starts and lengths")
        if min(self.lengths) < 1 or min(self.starts) < 0:
            raise ValueError(f"bad StepBatch: starts={self.starts} lengths={self.lengths}")
        if len(set(self.sessions)) != len(self.sessions):
            raise ValueError(f"a session appears twice in one step: {self.sessions}")
        self.positions = torch.cat(
            [torch.arange(s, s + n) for s, n in zip(self.starts, self.lengths, strict=True)]
        )

    @classmethod
    def single(cls, start: int, length: int, session: int = 0) -> StepBatch:
        return cls([session], [start], [length])

    @property
    def size(self) -> int:
        return len(self.sessions)

    @property
    def n_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def ends(self) -> list[int]:
        """Length of each sequence after this step."""
        return [s + n for s, n in zip(self.starts, self.lengths, strict=True)]

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def uniform(self) -> bool:
        """True when every sequence appends the same number of tokens (no padding)."""
        return min(self.lengths) == self.max_len

    def last_token_rows(self) -> torch.Tensor:
        """Indices, on the flattened token axis, of each sequence's last new token."""
        return torch.tensor(self.lengths).cumsum(0) - 1

    def pad_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence index, index within the sequence) of every flattened token; made at
        the first call, shared by the step's layers."""
        if self._pad_index is None:
            seq = torch.repeat_interleave(torch.arange(self.size), torch.tensor(self.lengths))
            within = torch.cat([torch.arange(n) for n in self.lengths])
            self._pad_index = seq, within
        return self._pad_index

    def query_positions(self) -> torch.Tensor:
        """``[B, max_len]`` position of each (padded) query row."""
        starts = torch.tensor(self.starts).view(-1, 1)
        return starts + torch.arange(self.max_len).view(1, -1)
