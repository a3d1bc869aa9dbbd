"""Users' modules of shapes plandsl's runs meet less often (tests/unit/test_torch_model_refusals.py,
tests/distributed/test_torch_models.py): a parameter held by the root itself, a forward returning a tuple, blocks
ending in a view, a position table before the token embedding, buffers the forward never touches."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, view: bool = False, tagged: bool = False):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.view = view
        if tagged:  # a persistent buffer no forward reads or writes (a format version)
            self.register_buffer("version", torch.tensor(1))

    def forward(self, x):
        y = x + torch.relu(self.lin(x))
        if self.view:  # ends in a view of its output (a stage cut after it returns a view)
            b, t, c = y.shape
            return y.reshape(b * t, c).view(b, t, c)
        return y


class Decoder(nn.Module):
    """Embedding, `layers`, head; `root_scale`: a learned scale the root holds itself; `aux`: return (logits, aux)
    as models with an auxiliary output do; `reverse`: call the blocks in the reverse of their list's order;
    `root_buffer`: a constant gain the root holds as a buffer; `view`: each block ends in a view; `positions`: a
    learned position table of that many rows, registered before the token embedding; `tagged`: the root and each
    block hold a persistent buffer `version` no forward touches."""

    def __init__(self, vocab: int, width: int, depth: int, root_scale: bool, aux: bool, reverse: bool = False,
                 root_buffer: bool = False, view: bool = False, positions: int = 0, tagged: bool = False):
        super().__init__()
        if tagged:
            self.register_buffer("version", torch.tensor(1))
        if positions:
            self.pos = nn.Embedding(positions, width)
        self.tok = nn.Embedding(vocab, width)
        if root_scale:
            self.scale = nn.Parameter(torch.ones(width))
        if root_buffer:
            self.register_buffer("gain", torch.full((width,), 0.5))
        self.layers = nn.ModuleList(Block(width, view, tagged) for _ in range(depth))
        self.out = nn.Linear(width, vocab)
        self.aux, self.reverse = aux, reverse

    def forward(self, tokens):
        x = self.tok(tokens)
        if hasattr(self, "pos"):
            x = x + self.pos(torch.arange(tokens.shape[-1], device=tokens.device))
        if hasattr(self, "scale"):
            x = x * self.scale
        if hasattr(self, "gain"):
            x = x * self.gain
        for block in reversed(self.layers) if self.reverse else self.layers:
            x = block(x)
        return (self.out(x), x.mean()) if self.aux else self.out(x)


def build(vocab: int = 64, width: int = 16, depth: int = 2, root_scale: bool = False, aux: bool = False,
          reverse: bool = False, root_buffer: bool = False, view: bool = False, positions: int = 0,
          tagged: bool = False) -> nn.Module:
    return Decoder(vocab, width, depth, root_scale, aux, reverse, root_buffer, view, positions, tagged)
