"""E1xx: the text is not a plan (tokens, strings, encoding, size, the file itself), or an output file cannot be
written (E110).

Each `_entry(...)` is one code: why the rule exists, a failing example and the fix; see
`plandsl.diagnostics.catalogue.entry` for the form."""
from __future__ import annotations

from plandsl.diagnostics.catalogue.entry import GPT, Family

FAMILY = Family("E1")
_entry = FAMILY.add

_DEEP = "(" * 65 + "16" + ")" * 65  # with the plan's and train's braces, well past the 64 allowed


_entry("E101", """
    The parser met a token that cannot continue the statement it is reading. Usually a
    missing comma or operator, or a word in the wrong place; the hint lists what the
    grammar would have accepted at that point. Nothing past a syntax error is checked,
    because the shape of the rest of the file is unknown.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh:     [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Attributes are set with `=`; `:` is for keys inside `{ }`.", ("mesh:    ", "mesh    ="))

_entry("E102", """
    The file ended while a statement, bracket or block was still open: typically a
    plan body whose closing `}` was lost while editing. The error points at the end of
    the file; the opening bracket is usually some lines above it.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    """, "Close the plan body with `}`.", ("micro_batch: 1 }\n", "micro_batch: 1 }\n}\n"))

_entry("E103", """
    A string (an import path, a layer name) was opened with `\"` and not closed on the
    same line. Strings cannot span lines, so the rest of the line would be swallowed.
    """, f"""
    import "clusters/dgx_a100
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Close the string.", ('dgx_a100\n', 'dgx_a100"\n'))

_entry("E104", """
    A character that no token of the language starts with, often one pasted from a
    document: a typographic multiplication sign, a smart quote, a non-breaking space.
    Cluster sizes are written with the letter `x` (`dgx_a100 x 64`).
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 \u00d7 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Write the repetition with the letter `x`.", ("dgx_a100 \u00d7 1", "dgx_a100 x 1"))

_entry("E105", """
    Plans are UTF-8 text. This file has a byte that is not UTF-8 (here a `\u00b5` saved by
    an editor in Latin-1) or a NUL byte (a binary file, or a file truncated while being
    written). The offset of the first bad byte is given; nothing else in the file is
    read.
    """, f"""
    # the node link has 2 \u00b5s latency
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Save the file as UTF-8 (the text itself is fine).", encoding="latin-1")

_entry("E106", """
    The file is larger than a plan can reasonably be (2 MB; only that much is read, and at most
    250,000 tokens are parsed), its brackets (all kinds counted together) nest more than 64 deep, or its imports nest more than 64 deep
    or load more than 256 files (8 MB together). All guard the parser and evaluator against
    generated or hostile input; a real plan never comes close, so this usually means the wrong
    file or a generator gone wrong.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: {_DEEP}, micro_batch: 1 }}
    }}
    """, "Drop the redundant brackets, or split a deep expression into `let` definitions.", (_DEEP, "16"))

_entry("E107", """
    A file plandsl was asked to read (a plan, an import, a schedule CSV, a token file) is a
    directory, a device, a FIFO or a socket. Only regular files are read: a device such as
    `/dev/zero` never ends and a FIFO may never answer, so they are refused from what the
    file system says they are, before a byte is read. A file that says it is regular but
    reports size 0 and has content is made up by the kernel (`/proc`, `/sys`) and is refused
    too, without being shown. Here the import names a folder that
    happens to be called `shared.plan`.
    """, f"""
    import "clusters/dgx_a100"
    import "shared"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Import a plan file (a folder's files are imported one by one: `import \"shared/models\"`).",
    ('import "shared"\n', ""), folders=("shared.plan",))

_entry("E108", """
    plandsl itself failed: an exception it did not expect escaped a stage while it worked on
    this file. That is a bug in plandsl, not a problem of the plan, and the message names the
    exception (its type and message). The command reports it like any other problem of that
    file and goes on with the next one (`check a.plan b.plan` still checks `b.plan`); it exits
    with status 1. Set `PLANDSL_DEBUG=1` to have the traceback added as a note. In this
    example the plan is fine and a stage was made to raise `KeyError('tp')`.
    """, f"""
    import "clusters/dgx_a100"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Report it to the plandsl maintainers with the command, the plan file(s) and the message "
         "(run it again with `PLANDSL_DEBUG=1` for the traceback); the plan itself needs no change.",
    internal=True)

_entry("E109", """
    The file exists but the system refuses to read it: permission denied, a path longer
    than the file system allows (255 bytes a name on Linux), a loop of symbolic links. The
    system's reason is given; nothing of the file is shown.
    """, f"""
    import "clusters/dgx_a100"
    import "{"models_" * 40}"
    plan p {{
      model   = {GPT}
      cluster = dgx_a100 x 1
      mesh    = [dp = 2, pp = 2, tp = 2]
      train   = {{ global_batch: 16, micro_batch: 1 }}
    }}
    """, "Name a file the system can read (here a name of at most 255 bytes).",
    (f'import "{"models_" * 40}"\n', ""))

_entry("E110", """
    A file the command was asked to write could not be written after the work was done: the disk or
    the quota is full, the path changed since the command started, or (`plandsl inspect FILE.plan`)
    the `.plandsl` folder where the plan reads its models' tables is a file. An output path that
    can be seen to be unwritable before any work starts (`-o` into a missing folder, onto a
    directory) is refused then, as a usage error (exit 2); this is what only writing finds out (exit
    1). The system's reason is given, at the path (line 1), or at the model's call for a layer table,
    or at no place for standard output (`plandsl show example.plan > /dev/full`). Every file goes
    through a temporary file beside it renamed over the old one at the end, which a failure leaves as
    it was (a table, a cluster file, `fmt`'s files, an `-o` or `--trace` file); a device or a FIFO
    named by `-o` is written through, as asked, and holds what was written before the failure. Here
    `.plandsl` beside the plan is a file.
    """, """
    import "clusters/local"
    plan p {
      model   = hf("LlamaForCausalLM", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
      cluster = localhost
      mesh    = [dp = 2] over devices[0:2]
      train   = { global_batch: 8, micro_batch: 1 }
    }
    """, "Move the file named `.plandsl` away (the tables go into a folder of that name beside the plan); "
         "elsewhere, free space on the disk or write to a path you may write.",
    command=("inspect",), fixed_command=("inspect",), files=(".plandsl",))
