"""A small decoder-only transformer language model trained by Wavelet, on text every machine has
offline: the source of Python's standard library, read as bytes (a vocabulary of 256).

The step is next-token cross-entropy and the evaluation reports perplexity (the headline, lower
is better; a model that knows nothing scores 256) and bits per byte. From the repository's root:

    wavelet launch --dataset examples.tiny_lm:dataset --model examples.tiny_lm:model \\
        --step examples.tiny_lm:next_token_step --evaluate examples.tiny_lm:perplexity \\
        --target-metric perplexity --target-mode min --optimizer adamw --lr 0.002 \\
        --batch-size 16 --epochs 0 --max-seconds 60
    wavelet compare --modes ticktock,single,allreduce ...the same flags... --target-acc 12
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from wavelet.common.datasets import Dataset


def stdlib_text(max_bytes: int) -> bytes:
    """The standard library's top-level .py files in name order, up to ``max_bytes``."""
    out = bytearray()
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


def dataset(seed: int = 0, block: int = 64, max_bytes: int = 600_000, test_fraction: float = 0.1):
    """Blocks of ``block`` bytes and the same blocks shifted by one (the next byte of each);
    the last ``test_fraction`` of the text is the test set."""
    data = torch.frombuffer(bytearray(stdlib_text(max_bytes)), dtype=torch.uint8).long()
    split = int(len(data) * (1 - test_fraction))

    def blocks(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = (len(tokens) - 1) // block
        x = tokens[: n * block].view(n, block)
        y = tokens[1 : n * block + 1].view(n, block)
        return x, y

    train_x, train_y = blocks(data[:split])
    test_x, test_y = blocks(data[split:])
    return Dataset(train_x, train_y, test_x, test_y, num_classes=256)


class TinyLM(torch.nn.Module):
    def __init__(self, block: int, vocab: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Parameter(torch.zeros(block, dim))
        layer = torch.nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(block)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.position[:t]
        h = self.blocks(h, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def model(input_shape, num_classes, dim: int = 96, layers: int = 2, heads: int = 4):
    return TinyLM(input_shape[0], num_classes, dim, layers, heads)


def next_token_step(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def perplexity(model, batches) -> dict[str, float]:
    total, count = 0.0, 0
    for x, y in batches:
        logits = model(x)
        total += float(
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        )
        count += y.numel()
    loss = total / max(count, 1)
    return {"perplexity": math.exp(loss), "bits_per_byte": loss / math.log(2)}
