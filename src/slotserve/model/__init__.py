"""The Llama-family model as pure methods over an external KV store.

`build_weights` assembles tensors with Hugging Face names (shaped by `slotserve.info.ModelInfo`);
`Model` exposes ``prefill``/``decode``/``logits``. No module here holds KV state.
"""

from slotserve.model.model import Model
from slotserve.model.weights import LlamaWeights, build_weights

__all__ = ["LlamaWeights", "Model", "build_weights"]
