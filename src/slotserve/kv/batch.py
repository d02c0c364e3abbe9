"""`StepBatch`: which sequences a forward step advances, and by how many tokens.

Built once per step by the caller (runner or engine), read by the model (positions) and by
the KV store (where to write, what each query may attend to). It never holds K/V itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepBatch:
    """A ragged batch: sequence ``b`` lives in ``slots[b]``, already holds ``starts[b]``
    positions and appends ``lengths[b]`` new tokens in this step.

    The flattened token axis of the step is the concatenation of each sequence's new tokens.
    """

    slots: list[int]
    starts: list[int]
    lengths: list[int]
    positions: torch.Tensor = field(init=False)
    token_slots: torch.Tensor = field(init=False)
    _pad_index: tuple[torch.Tensor, torch.Tensor] | None = field(init=False, default=None)
    _masks: dict[tuple[int | None, int], torch.Tensor | None] = field(
        init=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if not (len(self.slots) == len(self.starts) == len(self.lengths)) or not self.slots:
            raise ValueError("StepBatch needs equal, non-empty slots, starts and lengths")
        if min(self.lengths) < 1 or min(self.starts) < 0:
            raise ValueError(f"bad StepBatch: starts={self.starts} lengths={self.lengths}")
        self.positions = torch.cat(
            [torch.arange(s, s + n) for s, n in zip(self.starts, self.lengths, strict=True)]
        )
        self.token_slots = torch.repeat_interleave(
            torch.tensor(self.slots), torch.tensor(self.lengths)
        )

    @classmethod
    def single(cls, start: int, length: int, slot: int = 0) -> StepBatch:
        return cls([slot], [start], [length])

    @property
    def size(self) -> int:
        return len(self.slots)

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
        """(sequence index, index within the sequence) of every flattened token."""
        if self._pad_index is None:
            seq = torch.repeat_interleave(torch.arange(self.size), torch.tensor(self.lengths))
            within = torch.cat([torch.arange(n) for n in self.lengths])
            self._pad_index = (seq, within)
        return self._pad_index

    def mask(self, window: int | None, key_len: int) -> torch.Tensor | None:
        """Boolean attention mask ``[B, 1, max_len, key_len]`` (True = may attend).

        Causal, and limited to the last ``window`` positions when a window is given.
        Returns ``None`` when plain full attention over every key is already correct
        (a single decode token per sequence, all sequences of length ``key_len``).
        """
        key = (window, key_len)
        if key not in self._masks:
            self._masks[key] = self._build_mask(window, key_len)
        return self._masks[key]

    def _build_mask(self, window: int | None, key_len: int) -> torch.Tensor | None:
        no_window = window is None or window >= key_len
        if self.max_len == 1 and no_window and all(e == key_len for e in self.ends):
            return None
        starts = torch.tensor(self.starts).view(-1, 1, 1)
        q_pos = starts + torch.arange(self.max_len).view(1, -1, 1)
        k_pos = torch.arange(key_len).view(1, 1, -1)
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= q_pos - k_pos < window
        return allowed.unsqueeze(1)
