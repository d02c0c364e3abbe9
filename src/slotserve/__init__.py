"""slotserve: an on-device LLM serving runtime.

Loads a model (GGUF, Hugging Face safetensors, its own exported bundles) and runs it as
pure prefill/decode methods over a KV cache the runtime owns. See the README for the
commands and the Python API.
"""

from slotserve.artifact import load
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
from slotserve.engine.presets import preset_config
from slotserve.engine.probe import teacher_forced_logits
from slotserve.errors import (
    AdmissionRefused,
    ArtifactError,
    ContextOverflow,
    PlanError,
    SchemaVersionError,
    SlotserveError,
)
from slotserve.info import ModelInfo
from slotserve.model import Model
from slotserve.runner import GenerationConfig, GenerationResult, Stats, TextLLMRunner
from slotserve.sampling import SamplingParams
from slotserve.tokenizer import Tokenizer

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
    "SchemaVersionError",
    "SlotserveError",
    "Stats",
    "TextLLMRunner",
    "TokenEvent",
    "Tokenizer",
    "Usage",
    "load",
    "preset_config",
    "teacher_forced_logits",
]
