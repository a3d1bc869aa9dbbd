"""A user's own model laid out as torchtitan lays out its decoders: the blocks in an nn.ModuleDict `layers` keyed "0"
.. "N-1" (so a pipeline stage can delete some and keep the others' names), iterated by `.values()` (`build`); and
torchtitan's own Llama 3 (`llama3`, torchtitan 0.3.0) at a tiny size, built on the CPU."""
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        q, k, v = self.wqkv(self.attention_norm(x)).chunk(3, dim=-1)
        x = x + self.wo(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.w2(nn.functional.silu(self.w1(self.ffn_norm(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, n_layers: int, container: str, as_dict: bool):
        super().__init__()
        self.container = container
        self.tok_embeddings = nn.Embedding(vocab, dim)
        blocks = [Block(dim, hidden) for _ in range(n_layers)]
        setattr(self, container, nn.ModuleDict({str(index): block for index, block in enumerate(blocks)})
                if as_dict else nn.ModuleList(blocks))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        blocks = getattr(self, self.container)
        for layer in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
            h = layer(h)
        return self.output(self.norm(h))


def build(vocab: int = 128, dim: int = 32, hidden: int = 64, n_layers: int = 4, container: str = "layers",
          as_dict: bool = True) -> nn.Module:
    return Decoder(vocab, dim, hidden, n_layers, container, as_dict)


def llama3(vocab: int = 128, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2, n_layers: int = 4,
           max_position_embeddings: int = 16, fuse_qkv: bool = True) -> nn.Module:
    """torchtitan's `Llama3Model` as its `llama3` configs build it, with the attention and rotary embedding that run on
    a CPU: SDPA (its language models take flex or varlen attention, which need CUDA or per-document masks) and
    cos/sin rotary tables (its complex ones are complex tensors). `max_position_embeddings`: its rotary table's
    positions, named as a Hugging Face config names them, so a plan trains (and inspects) it at that length;
    `fuse_qkv`: one `wqkv` projection (torchtitan's default) or three."""
    from torchtitan.models import llama3 as titan  # lazy: only this model needs torchtitan
    from torchtitan.models.common import Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import CosSinRoPE
    rope = CosSinRoPE.Config(dim=dim // n_heads, max_seq_len=max_position_embeddings, theta=10000.0)
    layers = titan._build_llama3_layers(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32), rope=rope,
                                        attn_backend="flex", fuse_qkv=fuse_qkv)
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = titan.Llama3Model.Config(
        dim=dim, vocab_size=vocab, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=titan._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=titan._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=titan._output_linear_init(dim)))
    model = config.build()
    model.init_states()  # torchtitan builds, then fills the parameters and the rotary tables
    return model
