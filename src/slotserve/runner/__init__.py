"""`TextLLMRunner`: ExecuTorch's single-caller LLM runner API on the engine, with its
`GenerationConfig`, `Stats` and `GenerationResult`."""

from slotserve.runner.config import GenerationConfig
from slotserve.runner.result import GenerationResult, Stats
from slotserve.runner.runner import TextLLMRunner, common_prefix

__all__ = ["GenerationConfig", "GenerationResult", "Stats", "TextLLMRunner", "common_prefix"]
