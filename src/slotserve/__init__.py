"""slotserve: an on-device LLM serving runtime.

Loads a model (GGUF, Hugging Face safetensors) and runs it as pure prefill/decode methods
over a KV cache the runtime owns. See the README for the commands and the Python API.
"""

from slotserve.artifact import Tokenizer, load
from slotserve.engine import (
    CancelAck,
    Engine,
    EngineConfig,
    EngineStats,
    Finished,
    PressureSource,
    RequestHandle,
    TokenEvent,
    Usage,
)
from slotserve.errors import (
    AdmissionRefused,
    ArtifactError,
    ContextOverflow,
    PlanError,
    SlotserveError,
)
from slotserve.model import Model, ModelInfo
from slotserve.runner import TextLLMRunner
from slotserve.runner_types import GenerationConfig, GenerationResult, Stats
from slotserve.sampling import SamplingParams

__all__ = [
    "AdmissionRefused",
    "ArtifactError",
    "CancelAck",
    "ContextOverflow",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Finished",
    "GenerationConfig",
    "GenerationResult",
    "Model",
    "ModelInfo",
    "PlanError",
    "PressureSource",
    "RequestHandle",
    "SamplingParams",
    "SlotserveError",
    "Stats",
    "TextLLMRunner",
    "TokenEvent",
    "Tokenizer",
    "Usage",
    "load",
]
