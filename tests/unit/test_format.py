"""Unit tests of plandsl.syntax.format: golden layouts, comments, parentheses, schedules, line breaking."""
from __future__ import annotations

import textwrap

import pytest

from plandsl.syntax.format import format_module, format_source
from plandsl.syntax.parser import parse_source
from plandsl.diagnostics.source import SourceFile


def _fmt(text: str) -> str:
    return format_source(SourceFile("t.plan", textwrap.dedent(text)))


def _check_invariants(text: str) -> str:
    """Format `text`, assert the three formatter invariants, return the formatted text."""
    original = parse_source(SourceFile("t.plan", text))
    formatted = format_module(original)
    reparsed = parse_source(SourceFile("t.plan", formatted))
    assert reparsed.items == original.items, formatted
    assert [c.text for c in reparsed.comments] == [c.text.rstrip() for c in original.comments]
    assert format_module(reparsed) == formatted
    return formatted


def _assert_formats(messy: str, expected: str) -> None:
    messy, expected = textwrap.dedent(messy).lstrip("\n"), textwrap.dedent(expected).lstrip("\n")
    assert _check_invariants(messy) == expected
    assert _check_invariants(expected) == expected


SAMPLE = """\
# a cluster
import "clusters/dgx_a100"
param nodes = 128
device a100_80g {
     memory=80GiB
  bandwidth   = 2039 GB/s
  peak = { fp32: 19.5 TFLOP/s, bf16: 312 TFLOP/s,
                fp16: 312 TFLOP/s }
}
node dgx_a100 {
  devices = 8 x a100_80g
  link    = { bandwidth: 300 GB/s, latency: 2 us }    # per GPU
}
cluster mixed = [dgx_a100 x 4, dgx_a100 x 2]
model g = gpt( layers = 96, hidden=12288 , heads=96 )
model custom {
  layer blocks[0:12] { params = 12*768*768; flops = 24 * 768 }
}
plan gpt3 {
  model = g
  cluster = dgx_a100 x nodes
  mesh = [dp=nodes*8/(8*16), pp=16, tp=8]
  data = zero1 over dp
  tensor = megatron over tp with sequence_parallel
  stages = evenly over pp with virtual=2
  schedule = 1f1b
  shard layers[0:8].mlp.* = { weight: (Shard(0)) @ tp }
  stages {
    0: embed,layers[0:10]
    1..7 : layers[10:82]
  }
}
"""

SAMPLE_FORMATTED = """\
# a cluster
import "clusters/dgx_a100"

param nodes = 128

device a100_80g {
  memory    = 80 GiB
  bandwidth = 2039 GB/s
  peak      = { fp32: 19.5 TFLOP/s, bf16: 312 TFLOP/s, fp16: 312 TFLOP/s }
}

node dgx_a100 {
  devices = 8 x a100_80g
  link    = { bandwidth: 300 GB/s, latency: 2 us }  # per GPU
}

cluster mixed = [dgx_a100 x 4, dgx_a100 x 2]

model g = gpt(layers=96, hidden=12288, heads=96)

model custom {
  layer blocks[0:12] {
    params = 12 * 768 * 768
    flops  = 24 * 768
  }
}

plan gpt3 {
  model    = g
  cluster  = dgx_a100 x nodes
  mesh     = [dp = nodes * 8 / (8 * 16), pp = 16, tp = 8]
  data     = zero1 over dp
  tensor   = megatron over tp with sequence_parallel
  stages   = evenly over pp with virtual = 2
  schedule = 1f1b
  shard layers[0:8].mlp.* = { weight: Shard(0) @ tp }
  stages {
    0:    embed, layers[0:10]
    1..7: layers[10:82]
  }
}
"""


def test_golden_sample():
    assert _check_invariants(SAMPLE) == SAMPLE_FORMATTED
    assert _check_invariants(SAMPLE_FORMATTED) == SAMPLE_FORMATTED


def test_empty_module_and_empty_bodies():
    assert format_source(SourceFile("t.plan", "")) == ""
    assert format_source(SourceFile("t.plan", "\n\n")) == ""
    _assert_formats("plan p {\n\n}\nmodel m { }\n", "plan p {}\n\nmodel m {}\n")


def test_blank_lines_are_kept_once_and_break_alignment():
    _assert_formats("""
        plan p {

          a = 1
          bb = 2



          ccc = 3
          stages { 0: a }
          d = 4

        }
        """, """
        plan p {
          a  = 1
          bb = 2

          ccc = 3
          stages {
            0: a
          }
          d = 4
        }
        """)


def test_top_level_grouping():
    _assert_formats("""
        import "a"
        import "b"
        param x = 1
        param y = 2

        param z = 3
        let w = x
        plan p { a = 1 }
        plan q { a = 1 }
        """, """
        import "a"
        import "b"

        param x = 1
        param y = 2

        param z = 3

        let w = x

        plan p {
          a = 1
        }

        plan q {
          a = 1
        }
        """)


def test_comments_in_every_position():
    _assert_formats("""
        # file header

        import "a"   # after import
        plan p {   # after brace
          # before a
          a = 1 # after a
          b = {
            k: 1,  # inside a dict
            j: 2
          }
          stages {
            0: x
              # end of block
          }
          # end of plan
        }
        schedule s(p: ranks, # inside the parameters
                   m: microbatches) {
        }
        # end of file
        """, """
        # file header

        import "a"  # after import

        plan p {  # after brace
          # before a
          a = 1  # after a
          b = {
            k: 1,  # inside a dict
            j: 2,
          }
          stages {
            0: x
            # end of block
          }
          # end of plan
        }

        # inside the parameters
        schedule s(p: ranks, m: microbatches) {}
        # end of file
        """)


def test_comments_in_if_else():
    _assert_formats("""
        schedule s(p: ranks) {
          if p == 1 {   # then
            F(0, 0)
            # end of then
          } else {   # else
            # before B
            B(0, 0)
          }
        }
        """, """
        schedule s(p: ranks) {
          if p == 1 {  # then
            F(0, 0)
            # end of then
          } else {  # else
            # before B
            B(0, 0)
          }
        }
        """)


@pytest.mark.parametrize("messy, expected", [
    ("(a - b) - c", "a - b - c"),
    ("a - (b - c)", "a - (b - c)"),
    ("(a * b) + c", "a * b + c"),
    ("a * (b + c)", "a * (b + c)"),
    ("a / (b * c)", "a / (b * c)"),
    ("-(a.b)", "-a.b"),
    ("(-a).b", "(-a).b"),
    ("-(a * b)", "-(a * b)"),
    ("(-a) * b", "-a * b"),
    ("not (a and b)", "not (a and b)"),
    ("(not a) and b", "not a and b"),
    ("a or (b and c)", "a or b and c"),
    ("(a or b) and c", "(a or b) and c"),
    ("(a @ b) @ c", "(a @ b) @ c"),
    ("(a < b) == c", "(a < b) == c"),
    ("(0..p)..q", "(0..p)..q"),
    ("(m - w)..m", "m - w..m"),
    ("(dgx x 2) x 4", "(dgx x 2) x 4"),
    ("(a + b)[0]", "(a + b)[0]"),
    ("(f)(x)", "f(x)"),
    ("(1).3", "(1).3"),
    ("a.3.b", "a.3.b"),
    ("((Shard(0)) @ (tp))", "Shard(0) @ tp"),
    ("f( a ,b, k = 1 , )", "f(a, b, k=1)"),
    ("f(k=1, a)", "f(a, k=1)"),
    ("x[ : 2 ] + x[1:] + x[:]", "x[:2] + x[1:] + x[:]"),
])
def test_minimal_parentheses(messy, expected):
    assert _check_invariants(f"param v = {messy}\n") == f"param v = {expected}\n"


@pytest.mark.parametrize("messy, expected", [
    ("80GiB", "80 GiB"),
    ("19.5TFLOP/s", "19.5 TFLOP/s"),
    ("2   us", "2 us"),
    ("1_000 B", "1_000 B"),
    ("2f2b", "2f2b"),
    ("3 steps", "3 steps"),
    ("1f1b", "1f1b"),
    ("1_000", "1000"),
    ("2.50", "2.50"),
    ('"a\\"b\\\\c\\q\\n"', '"a\\"b\\\\cq\\n"'),
    ("{a:1,'b':2}".replace("'", '"'), "{ a: 1, b: 2 }"),
    ('{ "two words": 1, "x": 2 }', '{ "two words": 1, "x": 2 }'),
    ("[ ]", "[]"),
    ("{ }", "{}"),
])
def test_literals(messy, expected):
    assert _check_invariants(f"param v = {messy}\n") == f"param v = {expected}\n"


def test_schedules():
    _assert_formats("""
        schedule pipedream_flush(p:ranks,m:microbatches) {
          for r in 0..p on rank r {
            let w = min(p - r - 1, m)
            for i in 0..w        { F(r, i) }
            for i in 0..m - w    { F(r, w + i); B(r, i) }
            on rank 0 {
              B(r, 0) }
            if r == 0 { F(r, 0) } else { B(r, 0) }
          }
        }
        schedule tiny(ranks = 2, microbatches = 3) {
          rank 0:   0F0 0F1    0B0
          rank 1: 1F0 _ 1B0
          rank 2:
        }
        """, """
        schedule pipedream_flush(p: ranks, m: microbatches) {
          for r in 0..p on rank r {
            let w = min(p - r - 1, m)
            for i in 0..w { F(r, i) }
            for i in 0..m - w { F(r, w + i); B(r, i) }
            on rank 0 {
              B(r, 0)
            }
            if r == 0 {
              F(r, 0)
            } else {
              B(r, 0)
            }
          }
        }

        schedule tiny(ranks = 2, microbatches = 3) {
          rank 0: 0F0 0F1 0B0
          rank 1: 1F0 _   1B0
          rank 2:
        }
        """)


def test_long_dicts_and_lists_break_one_item_per_line():
    _assert_formats("""
        plan p {
          train = { global_batch: 1536, micro_batch: 1, precision: bf16, recompute: full, optimizer: adam, clip: 1.0 }
          mesh = [data_parallel = 1024, pipeline_parallel = 16, tensor_parallel = 8, expert_parallel = 2, sequence = 1]
          short = { a: [1, 2], b: { c: 3 } }
          nested = f({ first_key: first_value_here, second_key: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14] })
        }
        """, """
        plan p {
          train  = {
            global_batch: 1536,
            micro_batch: 1,
            precision: bf16,
            recompute: full,
            optimizer: adam,
            clip: 1.0,
          }
          mesh   = [
            data_parallel = 1024,
            pipeline_parallel = 16,
            tensor_parallel = 8,
            expert_parallel = 2,
            sequence = 1,
          ]
          short  = { a: [1, 2], b: { c: 3 } }
          nested = f({
            first_key: first_value_here,
            second_key: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
          })
        }
        """)


def test_line_exactly_100_columns_stays_flat():
    value = "{ key: " + "a" * 85 + " }"  # `  x = ` (6) + 94 = 100 columns
    text = f"plan p {{\n  x = {value}\n}}\n"
    assert len(text.splitlines()[1]) == 100
    assert _check_invariants(text) == text
    longer = text.replace("a" * 85, "a" * 86)
    assert _check_invariants(longer).count("\n") == 5


def test_trailing_whitespace_and_semicolons():
    _assert_formats("plan p { a = 1 ;b=2;   c = f(1,\n 2) }   # done   \n",
                    "plan p {\n  a = 1\n  b = 2\n  c = f(1, 2)\n}  # done\n")



# ---- alignment of hand-aligned constructs -----------------------------------------------------
LONG = "{ global_batch: 1536, micro_batch: 1, precision: bf16, recompute: full, optimizer: adam, seed: 1 }"


def test_trailing_comments_align_in_runs():
    _assert_formats("""
        node n {
          devices = 8 x a100  # one
          link = { bandwidth: 300 GB/s, latency: 2 us } # two
          nic = { bandwidth: 25 GB/s }         # three

          a = 1 # after a blank line: a new run
          bb = 22   # same run
          # an own-line comment ends the run
          c = 333 # alone
          d = 4
          e = 5 # a line without a comment ended the run
          f = 6 # so did a multi-line statement
          g = LONG  # after a multi-line statement
          h = 7 # alone again
        }
        """.replace("LONG", LONG), """
        node n {
          devices = 8 x a100                                # one
          link    = { bandwidth: 300 GB/s, latency: 2 us }  # two
          nic     = { bandwidth: 25 GB/s }                  # three

          a  = 1   # after a blank line: a new run
          bb = 22  # same run
          # an own-line comment ends the run
          c  = 333  # alone
          d  = 4
          e  = 5  # a line without a comment ended the run
          f  = 6  # so did a multi-line statement
          g  = {
            global_batch: 1536,
            micro_batch: 1,
            precision: bf16,
            recompute: full,
            optimizer: adam,
            seed: 1,
          }  # after a multi-line statement
          h  = 7  # alone again
        }
        """)


def test_trailing_comments_align_at_top_level_and_in_schedules():
    _assert_formats("""
        import "clusters/dgx_a100" # a
        import "models/gpt2"   # b
        schedule s(p: ranks, m: microbatches) {
          for r in 0..p on rank r {
            let w = min(p - r - 1, m) # warm-up
            for i in 0..w { F(r, i) } # forwards
            for i in 0..m - w { F(r, w + i); B(r, i) }   # steady state
          }
        }
        """, """
        import "clusters/dgx_a100"  # a
        import "models/gpt2"        # b

        schedule s(p: ranks, m: microbatches) {
          for r in 0..p on rank r {
            let w = min(p - r - 1, m)                   # warm-up
            for i in 0..w { F(r, i) }                   # forwards
            for i in 0..m - w { F(r, w + i); B(r, i) }  # steady state
          }
        }
        """)


def test_trailing_comment_alignment_keeps_two_spaces_past_long_lines():
    long_value = "{ key: " + "a" * 80 + " }"
    text = f"plan p {{\n  x = 1  # short\n  y = {long_value}  # long\n}}\n"
    formatted = _check_invariants(text)
    first, second = formatted.splitlines()[1:3]
    assert first.index("#") == second.index("#") == len(second) - len("# long")
    assert second.endswith(long_value + "  # long")


def test_stage_entries_align_their_values():
    _assert_formats("""
        plan p {
          stages {
            0: embed, layers[0:9]
            1..7: layers[9:72]   # the middle
            7 : layers[72:80], norm, head
            virtual = 2
            12: a

            100: b
            0..4: c
          }
        }
        """, """
        plan p {
          stages {
            0:    embed, layers[0:9]
            1..7: layers[9:72]  # the middle
            7:    layers[72:80], norm, head
            virtual = 2
            12: a

            100:  b
            0..4: c
          }
        }
        """)


def test_shard_rules_align_their_targets():
    _assert_formats("""
        plan p {
          data = zero1 over dp
          tensor = megatron over tp
          shard embed.tok = { weight: Shard(0) @ tp }   # vocabulary-parallel
          shard layers.*.attn.wq = colwise over tp
          shard head = [Shard(0) @ tp, Shard(1) @ dp] # 2-D

          shard x = replicate
          shard "layers.7.attn.wo" = rowwise over tp
        }
        """, """
        plan p {
          data   = zero1 over dp
          tensor = megatron over tp
          shard embed.tok        = { weight: Shard(0) @ tp }  # vocabulary-parallel
          shard layers.*.attn.wq = colwise over tp
          shard head             = [Shard(0) @ tp, Shard(1) @ dp]  # 2-D

          shard x                  = replicate
          shard "layers.7.attn.wo" = rowwise over tp
        }
        """)


def test_schedule_table_columns_line_up():
    _assert_formats("""
        schedule table(ranks = 2, microbatches = 12) {
          rank 0: 0F0 0F11 _ 0B11  # first
          rank 10: 10F0 _ 10B0
        }
        """, """
        schedule table(ranks = 2, microbatches = 12) {
          rank 0:  0F0  0F11 _    0B11  # first
          rank 10: 10F0 _    10B0
        }
        """)


def test_one_line_aliases_stay_together_and_align():
    _assert_formats("""
        model gpt2_small = gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50257) # 124M
        model gpt2_xl = gpt(layers=48, hidden=1600, heads=25, seq=1024, vocab=50257)   # 1.56B
        model big = llama(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, seq=8192, vocab=128256)
        model small = gpt2_small
        cluster pod = dgx_a100 x 64   # 64 nodes
        cluster two_pod = pod x 2
        """, """
        model gpt2_small = gpt(layers=12, hidden=768, heads=12, seq=1024, vocab=50257)   # 124M
        model gpt2_xl    = gpt(layers=48, hidden=1600, heads=25, seq=1024, vocab=50257)  # 1.56B

        model big = llama(
          layers=126,
          hidden=16384,
          heads=128,
          kv_heads=8,
          ffn=53248,
          seq=8192,
          vocab=128256,
        )

        model small = gpt2_small

        cluster pod     = dgx_a100 x 64  # 64 nodes
        cluster two_pod = pod x 2
        """)


# ---- calls -----------------------------------------------------------------------------------
def test_long_calls_break_one_argument_per_line():
    _assert_formats("""
        model fits = llama(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=8192)
        model m = llama(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=32768, vocab=32000,
                        experts=8, top_k=2)
        plan p {
          model = f(a_rather_long_positional_argument, another_long_positional_argument, g(1, 2), key=3456789)
          x = f(first_argument_is_long, second_argument_is_long) + g(third_argument, fourth_argument_xyz)
        }
        """, """
        model fits = llama(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=8192)

        model m = llama(
          layers=32,
          hidden=4096,
          heads=32,
          kv_heads=8,
          ffn=14336,
          seq=32768,
          vocab=32000,
          experts=8,
          top_k=2,
        )

        plan p {
          model = f(
            a_rather_long_positional_argument,
            another_long_positional_argument,
            g(1, 2),
            key=3456789,
          )
          x     = f(
            first_argument_is_long,
            second_argument_is_long,
          ) + g(third_argument, fourth_argument_xyz)
        }
        """)


def test_call_with_a_long_last_list_or_dict_opens_it_on_the_first_line():
    _assert_formats("""
        plan p {
          a = f(x, { first_key: first_value_here, second_key: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14] })
        }
        """, """
        plan p {
          a = f(x, {
            first_key: first_value_here,
            second_key: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
          })
        }
        """)


# ---- comments inside broken containers --------------------------------------------------------
def test_comments_in_dicts_lists_and_calls_stay_beside_their_items():
    _assert_formats("""
        plan p {
          train = {
            global_batch: 256  # sequences per step
            micro_batch: 4     # per rank
            # own line
            seq: 1024
          }
          mesh = [dp = 2, # data
                  tp = 4]
          model = gpt(layers=12, # blocks
                      hidden=768)
          short = { a: 1 }  # after the statement
        }
        """, """
        plan p {
          train = {
            global_batch: 256,  # sequences per step
            micro_batch: 4,     # per rank
            # own line
            seq: 1024,
          }
          mesh  = [
            dp = 2,  # data
            tp = 4,
          ]
          model = gpt(
            layers=12,  # blocks
            hidden=768,
          )
          short = { a: 1 }  # after the statement
        }
        """)


def test_comments_that_cannot_stay_inside_go_before_in_order():
    # c1 sits in an operator (it goes before the statement), c2 in a list: the list keeps it
    _assert_formats("""
        plan p {
          a = (1 + # c1
               2) + [3, # c2
                     4]
          b = [3, # c3
               4] + (1 + # c4
                     2)
          c = f(k=1, # c5
                x)
        }
        """, """
        plan p {
          # c1
          a = 1 + 2 + [
            3,  # c2
            4,
          ]
          # c3
          # c4
          b = [3, 4] + (1 + 2)
          # c5
          c = f(x, k=1)
        }
        """)


def test_call_exactly_100_columns_stays_flat():
    call = "f(" + "a" * 91 + ")"  # `  x = ` (6) + 94 = 100 columns
    text = f"plan p {{\n  x = {call}\n}}\n"
    assert len(text.splitlines()[1]) == 100
    assert _check_invariants(text) == text
    longer = text.replace("a" * 91, "a" * 92)
    assert _check_invariants(longer) == f"plan p {{\n  x = f(\n    {'a' * 92},\n  )\n}}\n"


def test_one_line_action_bodies_fit_in_100_columns():
    actions = "; ".join(["F(r, i)"] * 7) + "; F(r, 123456789)"  # `    for i in 0..m { ` (20) + 78 + ` }`
    text = f"schedule s(p: ranks, m: microbatches) {{\n  for r in 0..p on rank r {{\n    for i in 0..m {{ {actions} }}\n  }}\n}}\n"
    assert len(text.splitlines()[2]) == 100
    assert _check_invariants(text) == text
    assert _check_invariants(text.replace("123456789", "1234567890")).count("\n") == 14
