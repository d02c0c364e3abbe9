"""Exporting a model as a bundle: an ExecuTorch program, its weights as a separate file, the
tokenizer and a manifest (`slotserve.artifact.bundle`).

`export_bundle` lowers the model cut at attention (`slotserve.export.program`): per-layer
methods with a dynamic token count, the embedding and the head, plus ExecuTorch's constant
methods. ``8da4w`` keeps a Q4_0/Q4_1 GGUF's 4-bit blocks exactly, as the loaded model holds
them (`slotserve.export.blocks`; int4 weights with the block scale and a block-sum correction
for the offset); activations are quantised to int8 per token by the kernels. Needs the
optional ``executorch`` and ``torchao`` packages.
"""

from slotserve.export.bundle import ExportOptions, export_bundle, load_for_export

__all__ = ["ExportOptions", "export_bundle", "load_for_export"]
