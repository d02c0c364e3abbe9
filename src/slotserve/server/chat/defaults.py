"""`SamplingDefaults`: how the server samples when a request leaves a field out.

A request that omits ``temperature`` should still get a good answer from a small local
model, not OpenAI's 1.0 (which makes a 135M model answer with noise). The defaults come from
the model's own ``generation_config.json`` when it has sampling fields there (as vLLM reads
it); otherwise the conventional local-server values (llama.cpp's, Ollama's): temperature
0.8, top_k 40, top_p 0.95, min_p 0.05. Server flags override either; a request's own fields
override everything.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("slotserve")

GENERATION_CONFIG = "generation_config.json"
# generation_config.json field → SamplingDefaults field.
_GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling values a request gets for the fields it does not send. ``source`` says
    where they came from (for the startup log)."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    source: str = "local-server defaults"

    def __post_init__(self) -> None:
        for name, ok, allowed in (
            ("temperature", 0.0 <= self.temperature <= 2.0, "0..2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "(0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0 (0 disables)"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "[0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "(0, 10]"),
        ):
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"default {name}={value!r} is out of range; allowed: {allowed}")

    def overridden(self, **values: float | int | None) -> SamplingDefaults:
        """These defaults with the given fields replaced (``None``: keep); the source
        notes the flags."""
        given = {name: value for name, value in values.items() if value is not None}
        if not given:
            return self
        return dataclasses.replace(self, **given, source=f"{self.source} + flags")  # type: ignore[arg-type]

    def describe(self) -> str:
        return (
            f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k}, "
            f"min_p {self.min_p:g}, repeat penalty {self.repetition_penalty:g} ({self.source})"
        )


def defaults_for(model_spec: str) -> SamplingDefaults:
    """The defaults for the model at ``model_spec``: its directory's generation config's
    sampling fields over the local-server defaults, or those alone (a GGUF file, the
    bundled model, a directory without sampling fields)."""
    path = Path(model_spec) / GENERATION_CONFIG
    if not path.is_file():
        return SamplingDefaults()
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return SamplingDefaults()
    return from_generation_config(config, str(path))


def from_generation_config(config: dict[str, Any], source: str) -> SamplingDefaults:
    """Defaults from a parsed ``generation_config.json``; fields it lacks keep the
    local-server values. A config with no sampling field is as if there were none."""
    found = {
        ours: config[theirs]
        for theirs, ours in _GENERATION_FIELDS.items()
        if isinstance(config.get(theirs), int | float) and not isinstance(config[theirs], bool)
    }
    if not found:
        return SamplingDefaults()
    return dataclasses.replace(SamplingDefaults(), **found, source=source)
