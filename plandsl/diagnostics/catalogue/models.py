"""E9xx: what `plandsl inspect` cannot derive from a user's torch module (a factory or a Hugging Face
config built on the meta device).

Each `_entry(...)` is one code: why the rule exists, a failing example and the fix; see
`plandsl.diagnostics.catalogue.entry` for the form. Here the example is the user's Python file
(`my_models.py`) and the command `plandsl inspect my_models:build()` run beside it; E905's is a plan and
`plandsl inspect example.plan`."""
from __future__ import annotations

from plandsl.diagnostics.catalogue.entry import Family

FAMILY = Family("E9")
_entry = FAMILY.add

_COMMAND = ("inspect", "my_models:build()")


def _models(imports: str = "", forward: str = "", build: str = "return Model(vocab, width, depth)",
            blocks: str = "nn.ModuleList(Block(width) for _ in range(depth))",
            loop: str = "for block in self.layers:\n                x = block(x)") -> str:
    return f"""
    import torch
    from torch import nn
    {imports}

    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            return x + self.mlp(self.norm(x))


    class Model(nn.Module):
        def __init__(self, vocab, width, depth):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.layers = {blocks}
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens):{forward}
            x = self.embed(tokens)
            {loop}
            return self.head(x)


    def build(vocab=256, width=64, depth=2):
        {build}
    """


_entry("E901", """
    `plandsl inspect` imports the module a factory names (`pkg.module:function`, the current folder
    searched first) or the Hugging Face class an `hf(...)` source names, and that failed: the module is
    not on the path, it raises while it is imported (here it imports a package that is not installed),
    or it has no such function or class. Nothing of the model can be known without its code.
    `plandsl run` (and `--dry-run`) looks for the module too before any rank starts, from the plan's
    folder and the current one as each rank will: `check` reads the model's table only.
    """, _models(imports="import fused_kernels_not_installed"),
    "Install what the module imports, or remove the import.",
    ("import fused_kernels_not_installed", ""), file="my_models.py", command=_COMMAND)

_entry("E902", """
    The factory ran but did not hand back one `torch.nn.Module` (here a dict holding it), or it raised,
    or a Hugging Face config refused its keys (an unknown key is refused rather than silently kept, as
    transformers would). plandsl reads the module tree, parameters and forward of that one module.
    """, _models(build='return {"model": Model(vocab, width, depth)}'),
    "Return the model itself.",
    ('return {"model": Model(vocab, width, depth)}', "return Model(vocab, width, depth)"),
    file="my_models.py", command=_COMMAND)

_entry("E903", """
    `plandsl inspect` builds the model on the meta device (no memory, no weights) and runs its forward on
    token ids [1, seq] to count FLOPs and the activations kept for backward. Meta tensors have shapes but
    no values, so a forward that reads a value (`.item()`, a Python `if` on a tensor, a shape computed
    from data) cannot run there; here a check of the token ids.
    """, _models(forward="\n            if tokens.max() >= self.embed.num_embeddings:\n"
                         "                raise ValueError('token id out of range')"),
    "Check the data outside the model (in the data pipeline), or only when not tracing.",
    ("\n        if tokens.max() >= self.embed.num_embeddings:\n            raise ValueError('token id out of range')",
     ""), file="my_models.py", command=_COMMAND)

_entry("E904", """
    Pipeline stages fall between the model's blocks, and the cost model costs one block per kind, so
    `plandsl inspect` needs the block list: Hugging Face's `base_model_pp_plan` where the model has one,
    else an `nn.ModuleList` named `layers` (or an `nn.ModuleDict`, as torchtitan holds its blocks, keyed
    "0" .. "N-1"), else the largest such container of modules of one class (a ModuleDict keyed "0" ..
    "N-1"; one keyed by name, a multi-task model's heads, is none), else the blocks of a run of
    `nn.Sequential` stages (torchvision's ResNet: `layer1` .. `layer4`, each a Sequential of
    BasicBlocks). A block held as a plain attribute is none of these.
    """, _models(blocks="Block(width)", loop="x = self.layers(x)"),
    "Hold the blocks in an nn.ModuleList and loop over them in forward.",
    ("Block(width)\n", "nn.ModuleList(Block(width) for _ in range(depth))\n"),
    ("x = self.layers(x)", "for block in self.layers:\n            x = block(x)"),
    file="my_models.py", command=_COMMAND)

_entry("E905", """
    `plandsl inspect FILE.plan` writes the table of every `hf(...)` and `factory(...)` model the file
    writes, each where the plan reads it, and reads each model's source from the file's text without
    checking the plan: an argument that is a `param`, a `let` or an expression has no value there (a
    `--param` given to `check` would change it). `plandsl check` works the values out: its E215 for a
    missing table names the `plandsl inspect 'SOURCE' --seq N -o PATH` command with them filled in.
    A call of another shape is refused with the code `check` gives it (E212, E213, E205).
    """, """
    import "clusters/local"
    param width = 64
    plan p {
      model   = hf("LlamaForCausalLM", hidden_size=width, intermediate_size=176, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
      cluster = localhost
      mesh    = [dp = 2] over devices[0:2]
      train   = { global_batch: 8, micro_batch: 1 }
    }
    """, "Write the value in the call (or run the command check's E215 hint names).",
    ("param width = 64\n", ""), ("hidden_size=width", "hidden_size=64"), command=("inspect",))
