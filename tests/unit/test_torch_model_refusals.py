"""What `plandsl run` refuses of a model from torch (`hf(...)`, `factory(...)`), before any process starts
(E704, `runtime.support.refusals`), and what it accepts. The runs themselves: tests/distributed/test_torch_models.py."""
from __future__ import annotations

import os
import textwrap

import pytest

from plandsl import api
from plandsl.ir.inspected import write_cache
from plandsl.lower.inspected import written_sources
from plandsl.runtime.support import refusals

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = 'factory("inspect_models.tiny:build", depth=4, tied=false)'
LLAMA_SOURCE = ('hf("LlamaForCausalLM", hidden_size=64, intermediate_size=96, num_hidden_layers=2, '
                'num_attention_heads=4, vocab_size=128, max_position_embeddings=16)')


@pytest.fixture(scope="module")
def table():
    from plandsl.lower.inspected import DEFAULT_SEQ  # a factory's table is read at this seq
    return api.inspect_model("inspect_models.tiny:build(depth=4, tied=False)", seq=DEFAULT_SEQ, search_path=(HERE,))


def _plan(tmp_path, table, mesh: str, lines: str, train: str = "{ global_batch: 8, micro_batch: 1, seed: 0 }",
          checked: tuple[str, ...] = (), written: str = SOURCE, **model):
    """The plan over tiny's table; `checked`: the codes `check` itself reports first (E412: tiny's tied head
    across stages, E413: tensor parallelism with no plan; tests/unit/test_torch_names.py)."""
    body = textwrap.indent(textwrap.dedent(lines).strip(), "  ")
    path = tmp_path / "p.plan"
    path.write_text(f'import "clusters/local"\nplan p {{\n  model = {written}\n  cluster = localhost\n'
                    f"  mesh = {mesh} over devices[0:4]\n  train = {train}\n{body}\n}}\n", encoding="utf-8")
    [(_, _, cache)] = written_sources(api.parse_file(path))
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    write_cache(table, cache)
    analysis = api.check(path)
    assert [d.code for d in analysis.diagnostics] == list(checked), [d.message for d in analysis.diagnostics]
    plan = analysis.document.plans[0]
    return plan.model_copy(update={"model": plan.model.model_copy(update=model)}) if model else plan


def test_data_parallelism_and_fsdp_of_a_factory_module_run(tmp_path, table):
    plan = _plan(tmp_path, table, "[dp = 4]", "data = zero3 over dp",
                 train="{ global_batch: 8, micro_batch: 1, seed: 0, recompute: full }")
    assert plan.model.source == "inspect_models.tiny:build(depth=4, tied=False)" and plan.model.block_list == "layers"
    assert refusals(plan) == []


def test_a_module_is_split_into_stages_by_its_convention_or_a_trace(tmp_path, table):
    assert table.traceable  # inspect cut it at its second block with torch's pipeline frontend, on the meta device
    plan = _plan(tmp_path, table, "[dp = 2, pp = 2]", "stages = evenly over pp\nschedule = 1f1b")
    assert plan.model.stages_by == "trace" and refusals(plan) == []
    [refused] = refusals(plan.model_copy(update={"model": plan.model.model_copy(update={"stages_by": None})}))
    assert refused.code == "E704" and "cannot be split into pipeline stages: torch's pipeline frontend" in refused.message
    assert "a weight export lifts to an input of a stage" in refused.message  # torchtitan's Llama 3, its fused wqkv
    assert refused.span.line == 7  # the stages
    hf = plan.model.model_copy(update={"source": 'hf("GPT2LMHeadModel")', "stages_by": None})
    assert "declares no `base_model_pp_plan`" in refusals(plan.model_copy(update={"model": hf}))[0].message
    hf = hf.model_copy(update={"source": 'hf("LlamaForCausalLM")', "stages_by": "base_model_pp_plan"})
    assert refusals(plan.model_copy(update={"model": hf})) == []


def test_a_traced_module_is_cut_at_a_block_s_end_where_its_beginning_is_taken(tmp_path, table):
    """Torch's pipeline frontend cuts at a block's beginning or end, one point per block: a stage of the head alone
    cuts at the end of the last block, so a stage of that block alone starts at the end of the block before it
    (ZBV's 4 stages over tiny's 4 blocks: the cut was lost and the trace made 3 stages, on every rank); a stage of the
    embedding alone, one per block and one of the head alone need more points than there are, refused (E704)."""
    from plandsl.runtime.cuts import stage_split_points
    order = ["layers.0", "layers.1", "layers.2", "layers.3"]
    stages = [{"embed", "layers.0"}, {"layers.1", "layers.2"}, {"layers.3"}, {"head"}]
    assert stage_split_points(order, stages) == {"layers.1": "beginning", "layers.2": "end", "layers.3": "end"}
    assert stage_split_points(order, [{"embed"}, {"layers.0", "layers.1"}, {"layers.2", "layers.3", "head"}]) == \
        {"layers.0": "beginning", "layers.2": "beginning"}
    assert stage_split_points(order, [{"embed"}, *({name} for name in order), {"head"}]) is None
    two = "{ global_batch: 8, micro_batch: 2, seed: 0 }"
    plan = _plan(tmp_path, table, "[dp = 2, pp = 2]", "stages = evenly over pp with virtual = 2, map = vshape\n"
                 "schedule = zbv", train=two)
    assert refusals(plan) == []  # the split above (tests/distributed/test_torch_models.py runs it)
    plan = _plan(tmp_path, table, "[dp = 2, pp = 2]", "stages {\n  0: embed\n  1: layers[0:2]\n  2: layers[2:4]\n  "
                 "3: head\n  virtual = 2\n}\nschedule = looped_bfs", train=two)
    assert refusals(plan) == []
    plan = _plan(tmp_path, table, "[dp = 2, pp = 2]", "stages {\n  0: embed\n  1: layers.0\n  2: layers.1\n  "
                 "3: layers.2\n  4: layers.3\n  5: head\n  virtual = 3\n}\nschedule = looped_bfs", train=two)
    [refused] = refusals(plan)
    assert refused.code == "E704" and "cannot be cut into these 6 pipeline stages" in refused.message


@pytest.mark.parametrize("config, problem", [
    # Gemma 2's forward caps the head's logits (tanh(x / 30) * 30) after `lm_head`: on a stage before the head, its
    # pass-through's hidden states; the pipelines trained other values than one process (7e-3 apart after 2 steps)
    ("Gemma2ForCausalLM, head_dim=16, final_logit_softcapping=30.0", "changes them"),
    ("LlamaForCausalLM", None),
    # GPT-NeoX's `emb_dropout` reads the stream (`inputs_embeds`): a pass-through on a later stage, not a zero
    # (a 0-d stream reached the first block's layer norm on every later stage's rank)
    ("GPTNeoXForCausalLM, hidden_dropout=0.0", None),
])
def test_a_hugging_face_model_whose_forward_computes_beside_its_stages_modules_is_not_split(tmp_path, config, problem):
    """`plandsl inspect` runs a stage holding no layer (every module of the model's `base_model_pp_plan` a stand-in)
    on random hidden states; one that changes them records why (`stage_problem`), and `run` refuses its stages."""
    cls, _, extra = config.partition(", ")
    source = (f'hf("{cls}", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, '
              f'vocab_size=128, max_position_embeddings=16, tie_word_embeddings=false{", " + extra if extra else ""})')
    table = api.inspect_model(source, seq=16)
    assert table.block_list_from == "base_model_pp_plan"
    assert (problem is None and table.stage_problem is None) or problem in table.stage_problem
    plan = _plan(tmp_path, table, "[dp = 2, pp = 2]", "stages = evenly over pp\nschedule = 1f1b", written=source,
                 train="{ global_batch: 8, micro_batch: 2, seq: 16, seed: 0 }")
    found = refusals(plan)
    assert [d.code for d in found] == ([] if problem is None else ["E704"])
    assert problem is None or "computes beside the modules a stage replaces" in found[0].message
    # the recorded reason, quoted (the E704 read "declares no base_model_pp_plan, or ..." for a model that has one)
    assert problem is None or (table.stage_problem in found[0].message and "declares no" not in found[0].message)


def test_run_refuses_a_factory_its_ranks_cannot_import_before_they_start(tmp_path, table, monkeypatch):
    """`check` reads a factory's table only; `plandsl run` over a plan whose package is off the path launched every
    rank, and each failed building the job with a traceback (`--dry-run`: E108, "a bug in plandsl"). Now E901 before
    launch (`runtime.support.model_import_problems`, asked by `api.load_runnable`); the plan's folder is searched."""
    import shutil
    import sys

    from plandsl.runtime.support import model_import_problems
    plan = _plan(tmp_path, table, "[dp = 4]", "data = zero3 over dp")
    for name in [name for name in sys.modules if name.split(".")[0] == "inspect_models"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != HERE])
    [refused] = model_import_problems(plan)
    assert refused.code == "E901" and "cannot import 'inspect_models.tiny'" in refused.message
    with pytest.raises(api.PlanError, match="E901"):
        api.load_runnable(tmp_path / "p.plan")
    assert refusals(plan) == []  # generate asks these, importing no user code
    shutil.copytree(os.path.join(HERE, "inspect_models"), tmp_path / "inspect_models")  # beside the plan
    assert model_import_problems(plan) == []


@pytest.mark.parametrize("seq, codes", [(16, ()), (32, ("E224",))])
def test_a_model_from_torch_trains_on_at_most_its_learned_positions(tmp_path, seq, codes):
    """GPT-2's `wpe` holds n_positions rows: at train seq 32 over 16 positions check accepted the plan and every rank
    failed at its first step (IndexError in the embedding). `plandsl inspect` records the positions; check holds the
    train seq to them (E224), as for a gpt model."""
    source = 'hf("GPT2LMHeadModel", n_embd=64, n_layer=2, n_head=4, n_positions=16, vocab_size=128)'
    table = api.inspect_model(source, seq=16)
    assert table.positions == 16
    plan = _plan(tmp_path, table, "[dp = 4]", "data = zero3 over dp", written=source, checked=codes,
                 train=f"{{ global_batch: 8, micro_batch: 2, seq: {seq}, seed: 0 }}")
    assert plan.model.positions == 16
    assert api.inspect_model(LLAMA_SOURCE, seq=16).positions is None  # rotary positions: no table


def test_e224_says_where_an_unwritten_seq_came_from(tmp_path):
    """GPT-2 without n_positions holds transformers' default 1,024; a plan writing no seq trains at its table's
    (`model_seq`: 2048 without a config's positions), and E224 named a seq the user never wrote (the review)."""
    from plandsl.lower.inspected import DEFAULT_SEQ
    source = 'hf("GPT2LMHeadModel", n_embd=64, n_layer=2, n_head=4, vocab_size=128)'
    table = api.inspect_model(source, seq=DEFAULT_SEQ)
    path = tmp_path / "p.plan"
    _plan(tmp_path, table, "[dp = 4]", "data = zero3 over dp", written=source, checked=("E224",))
    found = [d for d in api.check(path).errors if d.code == "E224"]
    assert "train seq (2048, the sequence its table was made at: train writes none)" in found[0].message


def test_a_parameter_held_by_the_model_s_root_is_refused(tmp_path):
    """A factory's module holding a parameter itself (a learned scale at the root) checked ok, and every rank failed
    building the job ("the model's root holds 'scale' itself"): plandsl runs the root's children behind its own
    wrapper. Now E704 before launch, from the table's parameter names."""
    source = 'factory("inspect_models.odd:build", root_scale=true)'
    from plandsl.lower.inspected import DEFAULT_SEQ  # a factory's table is read at this seq
    table = api.inspect_model("inspect_models.odd:build(root_scale=True)", seq=DEFAULT_SEQ, search_path=(HERE,))
    plan = _plan(tmp_path, table, "[dp = 4]", "data = zero3 over dp", written=source,
                 train="{ global_batch: 8, micro_batch: 1, seq: 16, seed: 0 }")
    [refused] = refusals(plan)
    assert refused.code == "E704" and "holds 'scale' at its root" in refused.message


def test_a_module_calling_its_blocks_out_of_their_list_s_order_is_not_split(tmp_path):
    """The stages' cuts are placed by the block list's order (`runtime.cuts`): a forward calling the blocks in reverse
    traced at inspect's one cut, then ran its 1F1B stages holding other blocks than the plan's and failed on every rank
    under ZBV (the trace made 3 stages of 4). Now inspect records it untraceable, and run refuses stages (E704)."""
    from plandsl.lower.inspected import DEFAULT_SEQ
    table = api.inspect_model("inspect_models.odd:build(depth=4, reverse=True)", seq=DEFAULT_SEQ, search_path=(HERE,))
    assert not table.traceable
    assert api.inspect_model("inspect_models.odd:build(depth=4)", seq=DEFAULT_SEQ, search_path=(HERE,)).traceable
    plan = _plan(tmp_path, table, "[dp = 2, pp = 2]", "stages = evenly over pp\nschedule = 1f1b",
                 written='factory("inspect_models.odd:build", depth=4, reverse=true)',
                 train="{ global_batch: 8, micro_batch: 2, seq: 16, seed: 0 }")
    [refused] = refusals(plan)
    assert refused.code == "E704" and "blocks called other than once each in their list's order" in refused.message


def test_a_token_file_is_checked_against_a_model_from_torch_before_launch(tmp_path, table):
    """`--data` was held to `plan.model.vocab`, which a model from torch has not: ids past its embedding reached every
    rank (IndexError in its first forward), and a model taking images trained on random images beside the file. Now
    the vocabulary is the source's `vocab_size` or the first embedding's rows, and an image model refuses the file."""
    import numpy as np

    from plandsl.runtime.tokens import model_vocab, token_file_problem
    plan = _plan(tmp_path, table, "[dp = 4]", "data = zero3 over dp")
    assert model_vocab(plan.model) == 100  # tiny's `tok`, [100, 32]
    path = tmp_path / "tokens.bin"
    np.array([1, 2, 150] * 800, dtype=np.uint16).tofile(path)
    assert "token id 150 is outside the model's vocab (100)" in token_file_problem(path, plan)
    np.array([1, 2, 99] * 800, dtype=np.uint16).tofile(path)
    assert token_file_problem(path, plan) is None
    given = plan.model.model_copy(update={"source": 'hf("LlamaForCausalLM", vocab_size=128)'})
    assert model_vocab(given) == 128
    images = plan.model_copy(update={"model": plan.model.model_copy(update={"image": (3, 8, 8)})})
    assert "takes images" in token_file_problem(path, images)
    # a position table registered before the token embedding: the most rows of any embedding, not the first's
    # (ids up to 99 of a vocabulary of 100 were refused against the 16 positions; the plan ran before)
    from plandsl.lower.inspected import DEFAULT_SEQ
    odd = api.inspect_model("inspect_models.odd:build(vocab=100, positions=16)", seq=DEFAULT_SEQ, search_path=(HERE,))
    positions = _plan(tmp_path, odd, "[dp = 4]", "data = zero3 over dp",
                      written='factory("inspect_models.odd:build", vocab=100, positions=16)')
    assert model_vocab(positions.model) == 100 and token_file_problem(path, positions) is None


@pytest.mark.parametrize("data, train", [
    ("data = zero3 over dp with gather = bf16", "{ global_batch: 8, micro_batch: 2, precision: bf16, seed: 0 }"),
    ("data = zero2 over dp", "{ global_batch: 8, micro_batch: 2, precision: bf16, param_dtype: bf16, seed: 0 }"),
    ("data = zero2 over dp", "{ global_batch: 8, micro_batch: 2, precision: bf16, master_dtype: bf16, seed: 0 }"),
])
def test_batchnorm_under_16_bit_weights_is_refused(tmp_path, table, data, train):
    """A ResNet (BatchNorm: the table's `norm_values`) with bf16 weights, gathered so (`gather = bf16`) or kept so
    (`param_dtype`, `master_dtype`): its running statistics stay fp32 and every rank failed in batch_norm ('expected
    scalar type BFloat16 but found Float'). E704 before launch; under autocast alone (fp32 weights) it runs."""
    plan = _plan(tmp_path, table, "[dp = 4]", data, train=train, norm_values=2)
    [refused] = refusals(plan)
    assert refused.code == "E704" and "holds BatchNorm layers" in refused.message
    plain = _plan(tmp_path, table, "[dp = 4]", "data = zero3 over dp",
                  train="{ global_batch: 8, micro_batch: 2, precision: bf16, seed: 0 }", norm_values=2)
    assert refusals(plain) == []


def test_one_pipeline_stage_is_refused_as_any_split_the_model_cannot_make(tmp_path, table):
    """`run` builds torch's pipeline stages for any `stages`, a one-rank pipeline axis too: GPT-2 (no
    `base_model_pp_plan`) over `[pp = 1, dp = 2]` checked ok and every rank stopped building the job (ModelError:
    "declares no `base_model_pp_plan`"); the refusal held at pp > 1 only."""
    plan = _plan(tmp_path, table, "[pp = 1, dp = 4]", "stages = evenly over pp\nschedule = 1f1b")
    hf = plan.model.model_copy(update={"source": 'hf("GPT2LMHeadModel")', "stages_by": None})
    [refused] = refusals(plan.model_copy(update={"model": hf}))
    assert refused.code == "E704" and "declares no `base_model_pp_plan`" in refused.message


def test_tensor_parallelism_runs_the_models_own_plan_only(tmp_path, table):
    plan = _plan(tmp_path, table, "[dp = 2, tp = 2]", "tensor = megatron over tp", checked=("E413",))
    [refused] = refusals(plan)
    assert refused.code == "E704" and "needs the model's own tensor-parallel plan" in refused.message
    hf = plan.model.model_copy(update={"source": 'hf("LlamaForCausalLM")'})
    own = (("model.layers.*.self_attn.q_proj", "colwise"), ("model.layers.*.self_attn.o_proj", "rowwise"),
           ("lm_head", "colwise_gather_output"))
    assert refusals(plan.model_copy(update={"model": hf.model_copy(update={"tp_plan": own})})) == []
    odd = own + (("model.layers.*.mlp.gate_up_proj", "packed_colwise"),)
    [refused] = refusals(plan.model_copy(update={"model": hf.model_copy(update={"tp_plan": odd})}))
    assert "packed_colwise" in refused.message and "replicated_with_grad_allreduce" in refused.hint
    sequence = _plan(tmp_path, table, "[dp = 2, tp = 2]", "tensor = megatron over tp with sequence_parallel",
                     checked=("E413",), source='hf("LlamaForCausalLM")', tp_plan=own)
    [refused] = refusals(sequence)  # tiny's blocks hold up and down, which this plan does not name
    assert "'layers.0.up.weight' [64, 32] sits in a block outside the model's tensor-parallel plan" in refused.message
    assert "drop `with sequence_parallel`" in refused.hint
    mlp = own + (("layers.*.up", "colwise"), ("layers.*.down", "rowwise"))
    # tiny's block holds up and down itself, so the input gathered for `up` is the one its residual adds to `down`'s
    # sequence shard (a factory of that shape ran: every rank failed, 'size of tensor a (16) must match ... (8)')
    [refused] = refusals(sequence.model_copy(update={"model": sequence.model.model_copy(update={"tp_plan": mlp})}))
    assert "the block 'layers.*' holds its colwise projection 'layers.*.up' itself" in refused.message
    odd_seq = sequence.model_copy(update={"train": sequence.train.model_copy(update={"seq": 7})})
    assert "does not split evenly over 2 ranks" in refusals(odd_seq)[0].message


def test_a_factory_s_own_tensor_parallel_plan_runs_only_as_pairs_and_not_on_traced_stages(tmp_path, table):
    """A factory's `tp_plan` (torch's styles by FQN pattern): a colwise projection with no rowwise one beside it (or the
    head `colwise` rather than `colwise_gather_output`) leaves its output split over the axis, which the model's own
    code then reads (every rank failed: 'mat1 and mat2 shapes cannot be multiplied', 'Target 49 is out of bounds');
    and torch's pipeline frontend rebuilds traced stages' linear layers as other modules, which ColwiseParallel
    refuses ('only support nn.Linear and nn.Embedding!' on every rank). Both E704 before launch."""
    pair = (("layers.*.up", "colwise"), ("layers.*.down", "rowwise"))
    plan = _plan(tmp_path, table, "[dp = 2, tp = 2]", "tensor = megatron over tp", checked=("E413",), tp_plan=pair)
    assert refusals(plan) == []
    assert refusals(plan.model_copy(update={"model": plan.model.model_copy(
        update={"tp_plan": pair + (("out", "colwise_gather_output"),)})})) == []
    for odd, alone in [(pair[:1], "layers.*.up"), (pair[1:], "layers.*.down"), (pair + (("out", "colwise"),), "out")]:
        [refused] = refusals(plan.model_copy(update={"model": plan.model.model_copy(update={"tp_plan": odd})}))
        assert refused.code == "E704" and f"gives '{alone}' the style" in refused.message
    staged = _plan(tmp_path, table, "[pp = 2, tp = 2]", "tensor = megatron over tp\nstages = evenly over pp\n"
                   "schedule = 1f1b", checked=("E413",), tp_plan=pair)
    [refused] = refusals(staged)
    assert refused.code == "E704" and "on pipeline stages cannot run" in refused.message


def test_selective_recomputation_is_refused(tmp_path, table):
    plan = _plan(tmp_path, table, "[dp = 4]", "data = zero3 over dp",
                 train="{ global_batch: 8, micro_batch: 1, seed: 0, recompute: selective }")
    [refused] = refusals(plan)
    assert refused.code == "E704" and "are recomputed whole" in refused.message and refused.hint == "use `recompute: full`"
