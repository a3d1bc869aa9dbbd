"""Command-line flags as a launch script spells them -> `Flag`s with the span each was written at.

Stage: below the adapters (`megatron`). Contract: `read_flags(text, path)` splits shell words the way bash
would for flags and their values (single and double quotes, backslash escapes, `\\`-newline continuations,
`#` comments, and bash arrays `NAME=(` ... `)` as Megatron-LM's example scripts group them) and never
raises: a word that is neither a flag nor a flag's value is a `Flag` named by the word (the adapter reports
it). `args_text(args)` is the one line a list of arguments (after `plandsl import ... --`) reads as.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from plandsl.diagnostics.source import SourceFile, Span

# One shell word: runs of unquoted characters, '...' and "..." strings, and backslash escapes. Words end at bash's
# own separators (IFS: space, tab, newline; \r as a CRLF file's), not at any Unicode space: `--lr\u00a00.1` is one
# word to bash and an unknown argument to the tool, where `\s` had read it as `--lr 0.1`.
# `\\` before a line end continues the line, CRLF's too: before \r\n it was an escaped \r, one more word (`--num-layers 2
# \\` then CRLF gave --num-layers two values).
_WORD = re.compile(r"""(?:[^ \t\r\n'"\\#]|'[^']*'|"(?:[^"\\]|\\.)*"|\\(?!\r\n)[^\n]|(?<=[^ \t\r\n])\#)+""")
_SPACE = re.compile(r"(?:[ \t\r]|\\\r?\n)+")
_COMMENT = re.compile(r"#[^\n]*")
_ARRAY_START = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\($")


@dataclass(frozen=True)
class Flag:
    """`--name` and the values written after it (none for a switch); `name` is as written (`--fp16`), or a
    stray word that is no flag (the adapter reports it)."""
    name: str
    values: tuple[str, ...]
    span: Span          # the flag itself
    value_span: Span    # its values (the flag when it has none)

    @property
    def text(self) -> str:
        return " ".join((self.name, *self.values))


def _words(source: SourceFile) -> list[tuple[str, Span]]:
    """(unquoted word, span) for each shell word of the text, comments and array brackets left out."""
    text, words, at = source.text, [], 0
    while at < len(text):
        space = _SPACE.match(text, at)
        if space:
            at = space.end()
            continue
        if text[at] == "\n":
            at += 1
            continue
        if text[at] == "#":
            at = _COMMENT.match(text, at).end()
            continue
        word = _WORD.match(text, at)
        if word is None:  # an unterminated quote: the rest of the line is one word
            end = text.find("\n", at)
            end = len(text) if end == -1 else end
            words.append((text[at:end], source.span(at, end)))
            at = end
            continue
        raw = word.group(0)
        value = _unquoted(raw) if raw.strip() else raw
        if not (_ARRAY_START.match(raw) or raw == ")"):
            words.append((value, source.span(at, word.end())))
        at = word.end()
    return words


_PIECE = re.compile(r"""'([^']*)'|"((?:[^"\\]|\\.)*)"|\\(.)|([^'"\\]+)""")
_ESCAPED_IN_QUOTES = re.compile(r'\\(["\\])')


def _unquoted(raw: str) -> str:
    """One shell word (`_WORD`) as shlex's POSIX split reads it: '...' as written, "..." with \\" and \\\\ undone
    (another backslash kept), \\x outside quotes as x, in one pass. shlex added a character at a time to a string
    held by its object, which copied the token each time: one quoted value of 1 MB took 12 s."""
    pieces, at = [], 0
    for piece in _PIECE.finditer(raw):
        if piece.start() != at:  # not a word of `_WORD`'s (it does not happen): shlex's reading, however slow
            return _shlex_word(raw)
        single, double, escaped, plain = piece.groups()
        pieces.append(single if single is not None else _ESCAPED_IN_QUOTES.sub(r"\1", double)
                      if double is not None else escaped if escaped is not None else plain)
        at = piece.end()
    return "".join(pieces) if at == len(raw) else _shlex_word(raw)


def _shlex_word(raw: str) -> str:
    try:
        return shlex.split(raw)[0]
    except (ValueError, IndexError):
        return raw


def read_flags(text: str, path: str) -> tuple[SourceFile, list[Flag]]:
    """The flags of `text` in order; `--name=value` is split into the flag and one value."""
    source = SourceFile(path, text)
    # (name, values, span, first value's span, last value's span) for each flag: its values gathered in a list and
    # the Flag built once (a Flag rebuilt with a tuple one longer for each value was quadratic in a flag's values:
    # `--seed` followed by 50,000 words took 3 s)
    read: list[tuple[str, list[str], Span, Span | None, Span | None]] = []
    for word, span in _words(source):
        if word.startswith("--") and len(word) > 2:
            name, equals, value = word.partition("=")
            if equals:
                flag_span = source.span(span.start, span.start + len(name))
                value_span = source.span(flag_span.end + 1, span.end)
                read.append((name, [value], flag_span, value_span, value_span))
            else:
                read.append((name, [], span, None, None))
        elif read and read[-1][0].startswith("--"):
            name, values, flag_span, first, _ = read[-1]
            values.append(word)
            read[-1] = (name, values, flag_span, first or span, span)
        else:
            read.append((word, [], span, None, None))
    flags = [Flag(name, tuple(values), span, first.to(last) if first else span)
             for name, values, span, first, last in read]
    return source, flags


WHOLE_DIGITS = 30
"""Digits of an integer a flag may give: past 10^30 no count or degree means anything (plandsl's caps are far below),
and int() itself refuses 4,300 with words of its own."""
_WHOLE = re.compile(r"-?[0-9]{1,%d}" % WHOLE_DIGITS)  # ASCII digits: `\\d` and int() take '٤' for 4


def whole_number(text: str, signed: bool = False) -> int | None:
    """`text` as an integer written in ASCII digits, at most WHOLE_DIGITS of them (a minus sign where `signed`),
    or None."""
    text = text.strip()
    if not _WHOLE.fullmatch(text) or (text.startswith("-") and not signed):
        return None
    return int(text)


def too_long(text: str) -> str:
    """` (of at most 30 digits)` where `text` is an integer whole_number refuses for its length alone."""
    return f" (of at most {WHOLE_DIGITS} digits)" if re.fullmatch(r"-?[0-9]+", text.strip()) and \
        len(text.strip().lstrip("-")) > WHOLE_DIGITS else ""


def shown_value(text: str) -> str:
    """A flag's value quoted for a message, a long one shortened."""
    return f"`{text}`" if len(text) <= 40 else f"`{text[:20]}...{text[-10:]}` ({len(text):,} characters)"


def args_text(args: list[str] | tuple[str, ...]) -> str:
    """The arguments as one shell line (each quoted where it needs it), which `read_flags` splits back."""
    return " ".join(shlex.quote(arg) for arg in args) + "\n"
