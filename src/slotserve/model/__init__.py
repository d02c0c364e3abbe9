"""A model family as layer halves over an external KV store.

`build_weights` assembles tensors with Hugging Face names (shaped by `slotserve.info.ModelInfo`);
`slotserve.model.halves` is the seam (``embed``, ``qkv``, ``out``, ``head`` and the one loop);
`Model` holds the halves picked at load and exposes ``prefill``/``decode``/``logits``. No
module here holds KV state.
"""

from slotserve.model.halves import LayerHalves, StepContext
from slotserve.model.model import Model
from slotserve.model.weights import LlamaWeights, build_weights

__all__ = ["LayerHalves", "LlamaWeights", "Model", "StepContext", "build_weights"]
