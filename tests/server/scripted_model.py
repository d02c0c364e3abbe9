"""A tiny Qwen3 whose greedy reply is a chosen chain of tokens, for tests of how a reply
is read (a thinking section, tool calls) through the real loader, engine and server.

The tiny qwen3 of `slotserve.testing`, with Qwen3's tags as added (non-special) tokens, as
Qwen3's own tokenizer has them, and weights that make each layer add nothing (``o_proj``
and ``down_proj`` zero): the final hidden state is the current token's embedding. Chain
tokens get orthogonal embeddings of unit RMS, and the output row of each chain token's
successor is its predecessor's embedding scaled, so the successor's logit is `MARGIN` and
every other token's is 0: the model writes the chain, whatever came before, from the
prompt's last token (``\\n``, the end of the generation prompt) to end-of-sequence. Where
a grammar allows other tokens only, it picks among them (deterministically).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken

from slotserve.testing import (
    SPECIAL_TOKENS,
    random_state_dict,
    tiny_config,
    tiny_tokenizer,
    write_tiny_hf_dir,
)

TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
MARGIN = 30.0
CONTEXT = 1024  # a byte-level prompt offering tools is long
END = SPECIAL_TOKENS[2]  # <|im_end|>, the tiny models' end-of-sequence

# A Qwen3-shaped chat template: tools in <tools>, calls in <tool_call>, and enable_thinking
# (false: an empty thinking section closes the generation prompt, as Qwen3's does).
THINKING_TEMPLATE = """\
{%- if tools %}<|im_start|>system
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


def chain_of(*pieces: str) -> list[str]:
    """The chain's tokens: each tag whole, any other text byte by byte."""
    tokens: list[str] = []
    for piece in pieces:
        tokens += [piece] if piece in TAGS or piece == END else list(piece)
    return tokens


def write_scripted_qwen3(path: Path, reply: list[str], template: str = THINKING_TEMPLATE) -> Path:
    """A model directory at ``path`` whose greedy reply is ``reply`` (`chain_of`), then
    end-of-sequence. Each token of the chain may appear in it once."""
    write_tiny_hf_dir(path, "qwen3")
    config = {**tiny_config("qwen3"), "max_position_embeddings": CONTEXT}
    (path / "config.json").write_text(json.dumps(config))  # room for tools, byte by byte
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAGS])
    tokenizer.save(str(path / "tokenizer.json"))
    config_path = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**tokenizer_config, "chat_template": template}))

    def token_id(text: str) -> int:
        found = tokenizer.token_to_id(text)
        if found is None:  # a byte: its byte-level symbol
            (found,) = tokenizer.encode(text, add_special_tokens=False).ids
        return int(found)

    chain = [token_id(t) for t in ["\n", *reply, END]]
    assert len(set(chain[:-1])) == len(chain) - 1, "each chain token leads to one successor"
    state = random_state_dict(config)
    dim = config["hidden_size"]
    assert len(chain) <= dim, "chain tokens need orthogonal embeddings"
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name].zero_()
        if "norm" in name:
            state[name].fill_(1.0)
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(1)))
    embed, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    head.zero_()
    for place, (token, successor) in enumerate(itertools.pairwise(chain)):
        embed[token] = basis[:, place] * dim**0.5  # unit RMS: the final norm keeps it
        head[successor] = basis[:, place] * (MARGIN / dim**0.5)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path
