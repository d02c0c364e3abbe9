"""A BERT-family text encoder (sentence-transformers' embedding models): bidirectional
attention over each text with a padding mask, no KV pool, pooled and optionally
L2-normalised final hidden states.

The model is pure: `EncoderModel.embed` maps a batch of token-id lists (texts of different
lengths) to one vector each and keeps no state between calls. The texts' rows are packed
(no padding) through every projection, which goes through the `Linear` seam (dense fp32, or
Q8_0 blocks on the compiled block kernel of `slotserve.model.gguf_linear`); attention runs
on each text's own rows, ``[heads, length, length]``, never on a grid padded to the batch's
longest text (whose length changes the order of the score reductions). A text's embedding
is therefore the same, bit for bit, whatever it is batched with: an engine may split a
batch into several steps without changing a result (tests hold every split equal).

The forward may also be split by layer (`EncoderPass`: `start`, `advance`, `finish`; `embed`
is the three in one call): the packed rows between two layers are all a later layer reads,
so an engine may hold them across device turns and run a text's layers a few at a time,
with the same bits as the unsplit forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

import gguf
import tokenizers
import torch
import torch.nn.functional as F

from slotserve.memory import MemoryLedger
from slotserve.model.gguf_linear import BlockLinear
from slotserve.model.layers import DenseLinear, Linear
from slotserve.native.threads import torch_on_cores

EncoderPooling = Literal["mean", "cls"]
ENCODER_POOLINGS: tuple[EncoderPooling, ...] = get_args(EncoderPooling)
# The row count of every projection's matrix product (`project`).
ROW_BLOCK = 64
EncoderWeightFormat = Literal["fp32", "q8_0"]
ENCODER_WEIGHT_FORMATS: tuple[EncoderWeightFormat, ...] = get_args(EncoderWeightFormat)


@dataclass(frozen=True)
class EncoderInfo:
    """The shape of an encoder and how its outputs become an embedding: ``pooling`` of the
    final hidden states, ``normalize`` (L2) after it, ``max_seq_len`` tokens a text keeps
    (special tokens included; longer texts are truncated, as sentence-transformers does)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    max_positions: int
    norm_eps: float
    pooling: EncoderPooling
    normalize: bool
    max_seq_len: int
    lowercase: bool = False  # sentence-transformers' do_lower_case, before the tokenizer

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not a multiple of n_heads={self.n_heads}")
        if self.pooling not in ENCODER_POOLINGS:
            raise ValueError(f"pooling={self.pooling!r} is not one of {ENCODER_POOLINGS}")
        if not 2 <= self.max_seq_len <= self.max_positions:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} must be in 2..{self.max_positions} (max_positions)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class LayerNorm:
    weight: torch.Tensor
    bias: torch.Tensor

    def __call__(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, eps)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.bias.nbytes


@dataclass(frozen=True)
class EncoderLayer:
    """One post-norm transformer layer: fused Q/K/V, output, its norm; up (GELU), down,
    its norm."""

    qkv: Linear
    o: Linear
    attn_norm: LayerNorm
    up: Linear
    down: Linear
    mlp_norm: LayerNorm

    @property
    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o, self.up, self.down

    @property
    def nbytes(self) -> int:
        norms = self.attn_norm.nbytes + self.mlp_norm.nbytes
        return norms + sum(linear.nbytes for linear in self.linears)


@dataclass(frozen=True)
class EncoderWeights:
    """Token, position and (segment 0's) token-type embeddings, their norm, the layers."""

    words: torch.Tensor
    positions: torch.Tensor
    token_type: torch.Tensor  # [dim]: every text is one segment
    embed_norm: LayerNorm
    layers: tuple[EncoderLayer, ...]

    @property
    def nbytes(self) -> int:
        embeds = self.words.nbytes + self.positions.nbytes + self.token_type.nbytes
        return embeds + self.embed_norm.nbytes + sum(layer.nbytes for layer in self.layers)


def _q8_0(linear: Linear) -> Linear:
    """``linear``'s weights as llama.cpp's Q8_0 blocks (32 weights with one fp16 scale) for
    the block kernel; the bias stays fp32."""
    assert isinstance(linear, DenseLinear), "only dense weights can be quantised"
    rows = gguf.quants.quantize(linear.weight.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    blocks = BlockLinear.from_gguf(torch.from_numpy(rows), "Q8_0")
    return replace(blocks, bias=linear.bias)


def with_encoder_weights(weights: EncoderWeights, fmt: EncoderWeightFormat) -> EncoderWeights:
    """``weights`` held as ``fmt``: ``"fp32"`` as read, ``"q8_0"`` with every layer's
    projections in Q8_0 blocks on the compiled block kernel (`BlockLinear`: activations
    quantised per block of 32, integer dot products, as llama.cpp multiplies)."""
    if fmt not in ENCODER_WEIGHT_FORMATS:
        raise ValueError(f"weights={fmt!r} is not one of {ENCODER_WEIGHT_FORMATS}")
    if fmt == "fp32":
        return weights
    layers = tuple(
        replace(
            layer,
            qkv=_q8_0(layer.qkv),
            o=_q8_0(layer.o),
            up=_q8_0(layer.up),
            down=_q8_0(layer.down),
        )
        for layer in weights.layers
    )
    return replace(weights, layers=layers)


def aligned_rows(n: int) -> int:
    """The rows ``n`` packed rows take through `project`: whole `ROW_BLOCK` blocks, at
    least two."""
    return max(2, -(-n // ROW_BLOCK)) * ROW_BLOCK


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """Packed rows ``x[N, width]`` zero-padded to `aligned_rows` ``(N)``."""
    n = x.shape[0]
    return torch.cat([x, x.new_zeros(aligned_rows(n) - n, x.shape[1])])


def project(
    linear: Linear,
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear(x) + residual`` for padded rows ``x[N, in]`` (`pad_rows`), on blocks of
    exactly `ROW_BLOCK` rows, so that a row's result depends on the row alone; written into
    ``out`` (at least ``N`` rows) where given.

    A matrix product's kernel, blocking and threading follow its row count, so one product
    over a step's rows gives a text different roundings in steps of different sizes. Dense
    weights run as one batched product of at least two blocks (each block one product of
    the same shape; a batch of one would run as a plain, differently threaded product),
    accumulated onto the bias plus the residual; other weights (the Q8_0 block kernel)
    block by block, the residual added after."""
    n = x.shape[0]
    if n != aligned_rows(n):
        raise ValueError(f"{n} rows: project takes rows padded to aligned_rows ({aligned_rows(n)})")
    blocks = n // ROW_BLOCK
    if out is not None:
        out = out[:n]
    if isinstance(linear, DenseLinear):
        weight = linear.weight.t().expand(blocks, *linear.weight.t().shape)
        stacked = x.view(blocks, ROW_BLOCK, x.shape[1])
        base = linear.bias
        if residual is not None:
            base = residual if base is None else residual + base
            base = base.view(blocks, ROW_BLOCK, -1)
        into = None if out is None else out.view(blocks, ROW_BLOCK, -1)
        if base is None:
            y = torch.bmm(stacked, weight, out=into)
        else:
            y = torch.baddbmm(base, stacked, weight, out=into)
        return y.view(n, -1)
    parts = [linear(block) for block in torch.split(x, ROW_BLOCK)]
    y = torch.cat(parts) if out is None else torch.cat(parts, out=out)
    return y if residual is None else y.add_(residual)


class EncoderScratch:
    """The buffers a layer writes its two widest products into (the fused Q/K/V rows and
    the MLP's up rows): the layers of a forward reuse them, and an engine keeps one across
    its steps, so that neither is allocated, nor its pages first touched, once a layer.
    One forward at a time writes into a scratch."""

    def __init__(self) -> None:
        self._qkv: torch.Tensor | None = None
        self._up: torch.Tensor | None = None

    def buffers(self, rows: int, info: EncoderInfo) -> tuple[torch.Tensor, torch.Tensor]:
        """``[rows, 3·dim]`` and ``[rows, ffn_dim]`` fp32 buffers, grown if they hold
        fewer rows."""
        if self._qkv is None or self._up is None or self._qkv.shape[0] < rows:
            self.clear()
            self._qkv = torch.empty(rows, 3 * info.dim)
            self._up = torch.empty(rows, info.ffn_dim)
        return self._qkv, self._up

    def clear(self) -> None:
        """Let the buffers go (an idle engine holds none)."""
        self._qkv = self._up = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self._qkv, self._up) if t is not None)


@dataclass(frozen=True)
class TextBatch:
    """A step's texts as packed rows: ``tokens[N]`` and ``positions[N]`` of every text in
    turn, ``text_of_row[N]`` (which text a row belongs to), ``lengths[B]`` and the
    ``longest`` text's length."""

    tokens: torch.Tensor
    positions: torch.Tensor
    text_of_row: torch.Tensor
    lengths: torch.Tensor
    longest: int

    @classmethod
    def of(cls, texts: Sequence[Sequence[int]]) -> TextBatch:
        if not texts or any(len(text) == 0 for text in texts):
            raise ValueError("a batch needs at least one text, each of at least one token")
        lengths = torch.tensor([len(text) for text in texts])
        longest = int(lengths.max())
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
        text_of_row = torch.repeat_interleave(torch.arange(len(texts)), lengths)
        return cls(
            tokens=torch.tensor([t for text in texts for t in text], dtype=torch.long),
            positions=positions,
            text_of_row=text_of_row,
            lengths=lengths,
            longest=longest,
        )

    @property
    def n_texts(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def nbytes(self) -> int:
        """The bytes its tensors' storage holds."""
        tensors = (self.tokens, self.positions, self.text_of_row, self.lengths)
        return sum(t.untyped_storage().nbytes() for t in tensors)


@dataclass(frozen=True)
class EncoderPass:
    """A forward split by layer (`EncoderModel.start`): its texts (``batch``), their packed
    rows ``hidden[N, dim]`` after the first ``layers_done`` layers. Holding one between
    device turns holds `nbytes`; nothing else of the forward outlives a call."""

    batch: TextBatch
    hidden: torch.Tensor
    layers_done: int

    @property
    def tokens(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def nbytes(self) -> int:
        """The bytes its tensors' storage holds."""
        return self.hidden.untyped_storage().nbytes() + self.batch.nbytes

    @staticmethod
    def bytes_for(n_texts: int, rows: int, dim: int) -> int:
        """`nbytes` of a pass of ``n_texts`` texts and ``rows`` rows in all: fp32 hidden
        rows, and the batch's three int64 row indices and one length a text."""
        return 4 * rows * dim + 8 * (3 * rows + n_texts)


class EncoderModel:
    """A loaded encoder: ``info``, ``weights``, the ``tokenizer`` (Hugging Face
    ``tokenizers``, truncating at ``info.max_seq_len``, never padding), and where it came
    from. `tokenize` then `embed` is sentence-transformers' ``encode``."""

    def __init__(
        self,
        info: EncoderInfo,
        weights: EncoderWeights,
        tokenizer: tokenizers.Tokenizer,
        source: str,
        weight_format: EncoderWeightFormat = "fp32",
    ) -> None:
        self.info, self.weights, self.source = info, weights, source
        self.weight_format = weight_format
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=info.max_seq_len)
        self.tokenizer = tokenizer
        self.ledger: MemoryLedger | None = None  # the ledger its load filled, if any

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids, special tokens included, at most ``info.max_seq_len``."""
        prepared = [text.lower() for text in texts] if self.info.lowercase else list(texts)
        return [encoding.ids for encoding in self.tokenizer.encode_batch(prepared)]

    # Every computing method runs torch on the process's cores (`torch_on_cores`), whatever
    # the caller's torch thread count: a product's rounding can follow its thread count,
    # and a text's embedding must be the same from every caller (the engine's steps, a
    # split forward, `embed`).

    def embed(self, texts: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[len(texts), dim]`` embeddings of token-id lists (`tokenize`'s)."""
        return torch_on_cores(
            lambda: self.finish(self.advance(self.start(texts), self.info.n_layers))
        )

    def start(self, texts: Sequence[Sequence[int]]) -> EncoderPass:
        """A forward of ``texts`` split by layer: their embedded rows, before any layer."""
        return torch_on_cores(lambda: self._start(texts))

    def advance(
        self, forward: EncoderPass, n_layers: int, scratch: EncoderScratch | None = None
    ) -> EncoderPass:
        """``forward`` through its next ``n_layers`` layers (at most those left), its
        widest products in ``scratch`` (default: buffers of this call's own)."""
        return torch_on_cores(lambda: self._advance(forward, n_layers, scratch))

    def finish(self, forward: EncoderPass) -> torch.Tensor:
        """The ``[n_texts, dim]`` embeddings of a pass through every layer."""
        return torch_on_cores(lambda: self._finish(forward))

    def _start(self, texts: Sequence[Sequence[int]]) -> EncoderPass:
        batch = TextBatch.of(texts)
        longest = batch.longest
        if longest > self.info.max_positions:
            raise ValueError(
                f"a text of {longest} tokens exceeds max_positions={self.info.max_positions}"
            )
        with torch.inference_mode():
            return EncoderPass(batch, self._embed_rows(batch), 0)

    def _advance(
        self, forward: EncoderPass, n_layers: int, scratch: EncoderScratch | None
    ) -> EncoderPass:
        if n_layers < 1:
            raise ValueError(f"n_layers={n_layers} must be >= 1")
        end = min(forward.layers_done + n_layers, self.info.n_layers)
        batch, rows = forward.batch, forward.tokens
        with torch.inference_mode():
            # Padded once for every layer of the call; the padding rows go through the
            # row-wise operations and no text's attention reads them.
            x = pad_rows(forward.hidden)
            buffers = (scratch or EncoderScratch()).buffers(x.shape[0], self.info)
            for layer in self.weights.layers[forward.layers_done : end]:
                x = self._layer(layer, x, batch, *buffers)
            hidden = x[:rows].clone()  # a held forward holds its own rows, not the padding
        return EncoderPass(batch, hidden, end)

    def _finish(self, forward: EncoderPass) -> torch.Tensor:
        if forward.layers_done != self.info.n_layers:
            raise ValueError(
                f"the pass has run {forward.layers_done} of {self.info.n_layers} layers: "
                "advance it through the rest before finish"
            )
        with torch.inference_mode():
            return self._pool(forward.hidden, forward.batch)

    def _embed_rows(self, batch: TextBatch) -> torch.Tensor:
        w = self.weights
        x = w.words[batch.tokens] + w.positions[batch.positions] + w.token_type
        return w.embed_norm(x, self.info.norm_eps)

    def _layer(
        self,
        layer: EncoderLayer,
        x: torch.Tensor,
        batch: TextBatch,
        qkv_rows: torch.Tensor,
        up_rows: torch.Tensor,
    ) -> torch.Tensor:
        """One layer over padded rows ``x``; its Q/K/V and up products written into the
        scratch's ``qkv_rows`` and ``up_rows``."""
        eps = self.info.norm_eps
        attended = self._attend(project(layer.qkv, x, out=qkv_rows), batch)
        x = layer.attn_norm(project(layer.o, attended, residual=x), eps)
        up = torch.ops.aten.gelu_(project(layer.up, x, out=up_rows))
        return layer.mlp_norm(project(layer.down, up, residual=x), eps)

    def _attend(self, qkv: torch.Tensor, batch: TextBatch) -> torch.Tensor:
        """Padded ``qkv[P, 3·dim]`` → padded attention output ``[P, dim]`` (zero padding
        rows): each text's queries attend to all of its own keys (bidirectional), one text
        at a time, so that no text's scores depend on the others' lengths."""
        info = self.info
        outs = []
        rows_in_texts = int(batch.lengths.sum())
        for rows in torch.split(qkv[:rows_in_texts], batch.lengths.tolist()):
            n = rows.shape[0]
            # [3, 1, heads, n, head_dim]: a batch of one text, four dimensions as torch's
            # fused CPU attention takes them (three fall back to unfused products).
            heads = rows.view(1, n, 3, info.n_heads, info.head_dim).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(heads[0], heads[1], heads[2])
            outs.append(out[0].transpose(0, 1).reshape(n, info.dim))
        outs.append(qkv.new_zeros(qkv.shape[0] - rows_in_texts, info.dim))
        return torch.cat(outs)

    def _pool(self, x: torch.Tensor, batch: TextBatch) -> torch.Tensor:
        if self.info.pooling == "cls":
            starts = torch.cumsum(batch.lengths, 0) - batch.lengths
            pooled = x[starts]
        else:
            sums = x.new_zeros(batch.n_texts, x.shape[1]).index_add_(0, batch.text_of_row, x)
            pooled = sums / batch.lengths.unsqueeze(1).to(x.dtype)
        return F.normalize(pooled, p=2.0, dim=1) if self.info.normalize else pooled

    def held_bytes(self, n_texts: int, longest: int) -> int:
        """The most bytes a split pass of ``n_texts`` texts of at most ``longest`` tokens
        holds between two layers (`EncoderPass.nbytes`)."""
        return EncoderPass.bytes_for(n_texts, n_texts * longest, self.info.dim)

    def step_bytes(self, n_texts: int, longest: int) -> int:
        """A lower bound on a step's transient bytes (fp32): the padded rows
        (`aligned_rows`) of the scratch's Q/K/V and up products and of two ``dim``-wide
        products, the per-text Q/K/V views and attention outputs, and one text's attention
        scores."""
        info = self.info
        rows = aligned_rows(n_texts * longest)
        packed = rows * (3 * info.dim + info.ffn_dim + 2 * info.dim)
        grid = 2 * rows * 3 * info.dim
        scores = info.n_heads * longest * longest
        return 4 * (packed + grid + scores)
