"""A user's own model for tests/unit/test_inspect.py: a torchtitan-style decoder (`layers` ModuleList) with
tied embeddings, and a factory returning it."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, ffn)
        self.down = nn.Linear(ffn, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, vocab: int, width: int, ffn: int, depth: int, tied: bool = True):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, ffn) for _ in range(depth))
        self.out = nn.Linear(width, vocab, bias=False)
        if tied:
            self.out.weight = self.tok.weight

    def forward(self, tokens):
        x = self.tok(tokens)
        for block in self.layers:
            x = block(x)
        return self.out(x)


def build(vocab: int = 100, width: int = 32, ffn: int = 64, depth: int = 3, tied: bool = True) -> nn.Module:
    return Tiny(vocab, width, ffn, depth, tied)
