"""Exporting a model to an ExecuTorch program for the XNNPACK executor.

`export_layer_program` lowers each layer's projections and the head of a Q4_0/Q4_1 GGUF
model to one multi-method `.pte`: the 4-bit blocks are kept exactly (int4 weights with the
block scale and a block-sum correction for the offset), activations are quantised to int8
per token by the kernels. Attention stays with the runtime's KV pool. Needs the optional
``executorch`` and ``torchao`` packages.
"""

from slotserve.export.xnnpack import LayerProgramSpec, export_layer_program

__all__ = ["LayerProgramSpec", "export_layer_program"]
