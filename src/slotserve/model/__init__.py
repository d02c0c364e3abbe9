"""The Llama-family model as pure methods over an external KV store.

`ModelInfo` describes the shape; `build_weights` assembles tensors with Hugging Face names;
`Model` exposes ``prefill``/``decode``/``logits``. No module here holds KV state.
"""

from slotserve.model.info import ModelInfo, RopeConfig
from slotserve.model.model import Model
from slotserve.model.weights import LlamaWeights, build_weights

__all__ = ["LlamaWeights", "Model", "ModelInfo", "RopeConfig", "build_weights"]
