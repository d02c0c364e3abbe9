"""`XnnpackExecutor`: the step with each layer's projections in an ExecuTorch program.

Serve with ``Engine(executor.model, config, executor=executor)``: ``executor.model`` is the
model without its projections, so the fp32 layers are not kept beside the program.

The program (`slotserve.export.export_layer_program`) holds two methods per layer and the
head; this executor runs them in order and does attention in between through the KV pool's
``update_and_attend``, like the eager model. It needs the optional ``executorch`` package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore
from slotserve.model import Model
from slotserve.model.layers import fused_rope_rows


class XnnpackExecutor:
    """Runs ``model``'s steps with the lowered program at ``program_path``."""

    def __init__(self, model: Model, program_path: Path, max_tokens: int) -> None:
        from executorch.runtime import Runtime

        program = Runtime.get().load_program(str(program_path))
        layers = range(model.info.n_layers)
        # The program holds the layers and the head: keep only what the step still needs
        # (embedding, RoPE, tokenizer), so the eager projections can be freed. The engine
        # should be given this `model`.
        self.model = model.without_projections()
        self.program_path = program_path
        self.max_tokens = max_tokens  # the largest step the program was lowered for
        self._qkv = [program.load_method(f"layer{i}_qkv") for i in layers]
        self._out = [program.load_method(f"layer{i}_out") for i in layers]
        self._head: Any = program.load_method("head")

    @property
    def weight_bytes(self) -> int:
        """The program's bytes plus what the step keeps of the eager model (embedding, norms)."""
        return self.program_path.stat().st_size + self.model.weight_bytes

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        if tokens.numel() > self.max_tokens:
            raise ValueError(
                f"a step of {tokens.numel()} tokens exceeds the {self.max_tokens} the program "
                "was lowered for; lower max_batch_tokens or lower the program again"
            )
        info, rope = self.model.info, self.model.rope
        heads, kv_heads, head_dim = info.n_heads, info.n_kv_heads, info.head_dim
        widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        x = self.model.weights.embed[tokens]
        cos, sin = fused_rope_rows(info, rope.cos[batch.positions], rope.sin[batch.positions])
        for layer, (qkv, out) in enumerate(zip(self._qkv, self._out, strict=True)):
            (fused,) = qkv.execute([x, cos, sin])
            q, k, v = torch.split(fused, widths, dim=1)
            attn = kv.update_and_attend(
                layer,
                q.reshape(-1, heads, head_dim),
                k.reshape(-1, kv_heads, head_dim),
                v.reshape(-1, kv_heads, head_dim),
                batch,
            )
            (x,) = out.execute([x, attn.contiguous()])
        (logits,) = self._head.execute([x[batch.last_token_rows()].contiguous()])
        result: torch.Tensor = logits
        return result
