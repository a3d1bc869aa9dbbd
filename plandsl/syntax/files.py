"""The one way plandsl reads a file, and checks a path it will write, before any work starts.

Stage: input (every stage that opens a file goes through here). Contract: `read_bounded` returns at
most `limit` bytes of a regular file or raises `FileProblem`: a device, FIFO, socket or directory is
refused from its `stat` without blocking (the open is non-blocking and checked again on the open
descriptor), and at most `limit + 1` bytes are read, so an over-limit input answers at once with
constant memory; a file that reports size 0 yet has content (/proc, /sys) is refused after the read,
without showing it. `read_stdin` does the
same for standard input. `check_regular` is the regular-file test alone, for files read in chunks
(token files). `writable_file`/`writable_dir` say why an output path cannot be written, or None, before the work; `write_output`
writes one after it, and `unwritable` is the E110 of one that could not be written then after all.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from typing import BinaryIO, Callable

from plandsl.diagnostics import Diagnostic, PlanError, diag
from plandsl.diagnostics.source import Span

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))
_MISSING = (errno.ENOENT, errno.ENOTDIR)
_CHUNK = 1 << 20


class FileProblem(ValueError):
    """Why a file cannot be read: `code` E208 (missing), E107 (not a regular file), E106 (over the
    limit), E109 (any other OS error: permission, a name too long, a loop of links)."""

    def __init__(self, code: str, message: str, hint: str | None = None, path_shown: bool = True):
        super().__init__(message)
        self.code, self.message, self.hint = code, message, hint
        self.path_shown = path_shown  # False when the path itself is the problem (too long, a NUL in it)

    def diagnostic(self, span=None, file: str | None = None):
        """The problem as a Diagnostic at `span` (an import line), or for `file` named on the command line
        at its line 1, so that `check a b --format json` says which file each problem is about (at no
        place when the path itself is the problem)."""
        if span is None and file is not None and self.path_shown:
            span = Span(file, 1, 1, 1, 1)
        return diag(self.code, self.message, span, hint=self.hint)


def kind_of(mode: int) -> str:
    """`a directory`, `a character device`, ... for a mode that is not a regular file's."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _label(what: str, path: str) -> str:
    return f"{what} {path}" if what else path


def _os_problem(path: str, error: OSError, what: str) -> FileProblem:
    reason = error.strerror or str(error)
    if error.errno in _MISSING:
        return FileProblem("E208", f"cannot read {_label(what, path)}: {reason}")
    if error.errno == errno.ENAMETOOLONG:
        return FileProblem("E109", f"cannot read {what or 'the file'}: its path is too long for the file system "
                                   f"({len(os.fsencode(path)):,} bytes)", "is this the path you meant?", path_shown=False)
    if error.errno == errno.EISDIR:
        return FileProblem("E107", f"{_label(what, path)} is a directory, not a file")
    return FileProblem("E109", f"cannot read {_label(what, path)}: {reason}")


def _not_regular(path: str, mode: int, what: str) -> FileProblem:
    return FileProblem("E107", f"{_label(what, path)} is {kind_of(mode)}, not a regular file",
                       "name a file (devices, pipes and directories are not read)")


def check_regular(path: str | os.PathLike, what: str = "file") -> os.stat_result:
    """The `stat` of `path` (links followed) when it is a regular file, else FileProblem."""
    path = os.fspath(path)
    try:
        status = os.stat(path)
    except (OSError, ValueError) as error:  # ValueError: a NUL in the name
        raise _os_problem(path, error, what) if isinstance(error, OSError) else \
            FileProblem("E109", f"cannot read {what or 'the file'}: its name contains a NUL character",
                        path_shown=False) from None
    if not stat.S_ISREG(status.st_mode):
        raise _not_regular(path, status.st_mode, what)
    return status


def regular_file_problem(path: str | os.PathLike, what: str = "file") -> str | None:
    """Why `path` cannot be read as a regular file (`check_regular`'s message), or None."""
    try:
        check_regular(path, what)
    except FileProblem as problem:
        return problem.message
    return None


def read_bounded(path: str | os.PathLike, limit: int, what: str = "file") -> bytes:
    """At most `limit` bytes of the regular file `path`; FileProblem otherwise (see the module)."""
    path = os.fspath(path)
    check_regular(path, what)  # refuse a device before opening it: opening one can have effects
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        raise _os_problem(path, error, what) from None
    try:
        status = os.fstat(fd)  # the file opened may not be the one stat saw (a link changed meanwhile)
        if not stat.S_ISREG(status.st_mode):
            raise _not_regular(path, status.st_mode, what)
        if status.st_size > limit:
            raise _too_large(path, what, limit, status.st_size)
        data = _read_at_most(lambda size: os.read(fd, size), limit + 1)
    except OSError as error:
        raise _os_problem(path, error, what) from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise _too_large(path, what, limit, None)
    if data and status.st_size == 0:  # /proc, /sys: "regular", size 0, content made up by the kernel
        raise FileProblem("E107", f"{_label(what, path)} is a file the kernel generates (it reports size 0 and "
                                  "has content), not a regular file", "name a file of your own")
    return data


def _read_at_most(read: Callable[[int], bytes], count: int) -> bytes:
    """At most `count` bytes from `read` (a file descriptor's or a stream's), in chunks of _CHUNK."""
    chunks, left = [], count
    while left > 0:
        chunk = read(min(left, _CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_stdin(stream: BinaryIO, limit: int, what: str = "standard input") -> bytes:
    """At most `limit` bytes of `stream` (read(limit + 1): never more, whatever is piped in)."""
    data = _read_at_most(stream.read, limit + 1)
    if len(data) > limit:
        raise _too_large("-", what, limit, None)
    return data


def _too_large(path: str, what: str, limit: int, size: int | None) -> FileProblem:
    has = f"has {size:,} bytes" if size is not None else f"has more than {limit:,} bytes"
    shown = what if path == "-" else _label(what, path)
    return FileProblem("E106", f"{shown} {has}; at most {limit:,} are read",
                       "is this the file you meant? (plans are text of a few kilobytes)")


# ---- outputs -------------------------------------------------------------------------------------
_LINE_BREAKS = re.compile("[\\x00-\\x1f\\x7f\\x85\\u2028\\u2029]")


def shown_path(path: str) -> str:
    """A path as text a plan's comment can hold: bytes of its name that are not UTF-8 (which Python keeps from argv
    as lone surrogates, which no UTF-8 text holds) as `\\xNN` escapes, and so are control characters and line
    breaks (a newline in a name would end the comment and make the rest of the name plan text)."""
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return _LINE_BREAKS.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                            else f"\\u{ord(m.group()):04x}", text)


def writable_file(path: str) -> str | None:
    """Why `path` cannot be written as a file (without creating or changing it), or None."""
    if not path:
        return "the path is empty"
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return _creatable(path)
    except OSError as error:
        return _reason(error)
    if stat.S_ISDIR(status.st_mode):
        return "it is a directory"
    if stat.S_ISREG(status.st_mode) and not os.access(path, os.W_OK):
        return "it is not writable"
    return None  # a device or FIFO (/dev/null, /dev/stdout) is written as the user asked


def writable_dir(path: str) -> str | None:
    """Why `path` cannot be used (or created) as a directory to write into, or None."""
    if not path:
        return "the path is empty"
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return _creatable(path, directory=True)
    except OSError as error:
        return _reason(error)
    if not stat.S_ISDIR(status.st_mode):
        return f"it is {kind_of(status.st_mode) if not stat.S_ISREG(status.st_mode) else 'a file'}, not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return "it is not writable"
    return None


def _creatable(path: str, directory: bool = False) -> str | None:
    """A missing `path`: can it be created? (a file: its folder must exist; a directory: its nearest
    existing ancestor must be a writable directory)."""
    parent = os.path.dirname(os.path.abspath(path))
    while directory and not os.path.lexists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    try:
        status = os.stat(parent)
    except FileNotFoundError:
        return f"its folder {parent} does not exist"
    except OSError as error:
        return _reason(error)
    if not stat.S_ISDIR(status.st_mode):
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"its folder {parent} is not writable"
    if len(os.fsencode(os.path.basename(path))) > 255:  # its bytes: a name from non-UTF-8 argv holds surrogates
        return "its name is too long for the file system"
    return None


def _reason(error: OSError) -> str:
    if error.errno == errno.ENOTDIR:
        return "a part of the path before the name is a file, not a directory"
    if error.errno == errno.ENAMETOOLONG:
        return "the path is too long for the file system"
    return error.strerror or str(error)


_FULL = (errno.ENOSPC, errno.EDQUOT)
_REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)


def unwritable(path: str, error: OSError | str, what: str = "", span: Span | None = None,
               hint: str | None = None) -> Diagnostic:
    """E110: the output `path` (`what` it holds: "the layer table of ...", "the cluster file") could not be written,
    with the system's reason (`error`, or why as text): at `span` where a plan's line asked for it (inspect's model
    call), else at the path itself (line 1, as E208 is for a file that cannot be read); `path` "" is the command's
    standard output or error, at no place. The hint (unless given) says what to do about the reason."""
    reason = error if isinstance(error, str) else _reason(error)
    number = None if isinstance(error, str) else error.errno
    shown = f"{what} to {path}" if what and path else what or path or "the output"
    if hint is not None:
        pass
    elif not path:
        hint = "standard output or error went to a full disk, a closed pipe or a device that takes nothing " \
               "(`> /dev/full`): send it somewhere that takes it"
    elif number in _FULL:
        hint = "the disk (or your quota) is full: free space, or write to another disk"
    elif number in _REFUSED:
        hint = "the system refuses to write there: give a path you may write, or make this one writable"
    else:
        hint = "give another path, or mend this one (its folder must exist and be a directory you may write)"
    if span is None and path:
        span = Span(path, 1, 1, 1, 1)
    return diag("E110", f"cannot write {shown}: {reason}", span, hint=hint)


def write_output(path: str, data: bytes | str, what: str = "") -> None:
    """Write an output file the command was asked for (`-o`, `--trace`): a new or regular file (or a link to one)
    through a temporary file beside it renamed over it at the end (`_replaced`: a failure, a full disk, leaves the
    file that was there as it was, not cut off), a device or a FIFO written through, as the user asked (`-o
    /dev/stdout`); PlanError E110 when it cannot be (`writable_file` refused what it could see before the work: this
    is a full disk, or a path that changed since)."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        target = os.path.realpath(path)
        try:
            regular = stat.S_ISREG(os.stat(target).st_mode)
        except FileNotFoundError:
            regular = True  # a new file
        if not regular or not _replaced(target, payload):
            with open(path, "wb") as handle:
                handle.write(payload)
    except OSError as error:
        raise PlanError([unwritable(path, error, what)]) from None


def _replaced(target: str, payload: bytes) -> bool:
    """Write `payload` over the regular (or missing) file `target` through a temporary file beside it, renamed over it:
    the file's permission bits kept (a new one's those open() gives), a read-only one refused (OSError EACCES) as an
    in-place write would be. False, writing nothing, where no temporary file can be made beside it (a folder the user
    may not write holding a file they may): the caller writes in place. OSError for any other failure, the file left
    as it was and the temporary file removed."""
    try:
        status = os.stat(target)
    except FileNotFoundError:
        status = None
    if status is not None and not os.access(target, os.W_OK):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), target)
    return _through_temporary(target, payload, status)


def write_through_temporary(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it, renamed over `path` at the end, so that whatever was
    there is replaced, not written through (a FIFO was opened and waited on for ever, a link to /dev/full written
    into), and a reader sees the old file or the new one; the file gets the bits open() would have made (not
    mkstemp's 0600). OSError when it cannot be (the temporary file removed). `replace_file` keeps an existing file's
    bits and owner instead (`fmt`)."""
    _through_temporary(path, text.encode("utf-8"))


def _through_temporary(path: str, payload: bytes, status: os.stat_result | None = None) -> bool:
    """`payload` into a temporary file beside `path`, given `status`'s permission bits and owner (where allowed) or,
    without one, the bits open() would have made, then renamed over `path`; OSError on any failure, the temporary file
    removed. With `status` (a file there to keep), False where no temporary file can be made beside it (the folder
    refuses one: `_replaced` then writes in place)."""
    import tempfile  # lazy: only the commands writing a file through one import it (it imports random and shutil)
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=f".{_shortened(os.path.basename(path))}.", suffix=".tmp",
                                                 dir=os.path.dirname(os.path.abspath(path)))
    except OSError as error:
        if status is not None and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return False
        raise
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(payload)
        if status is not None:
            os.chmod(temporary, stat.S_IMODE(status.st_mode))
            with contextlib.suppress(OSError):  # only root may give a file away; the bits above still hold
                os.chown(temporary, status.st_uid, status.st_gid)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return True


def _shortened(name: str, most: int = 200) -> str:
    """`name` cut to at most `most` bytes, for a temporary file's name beside it: `.NAME.XXXXXXXX.tmp` within the 255
    bytes a file name may have where NAME itself takes up to 255 (was E110 'the path is too long' for such a name)."""
    while len(os.fsencode(name)) > most:
        name = name[:-1]
    return name


def replace_file(path: str, text: str) -> None:
    """Write `text` over the existing file `path` atomically (`fmt`): into a temporary file beside it, flushed
    and fsynced, given the file's permission bits (and owner, where allowed), then `os.replace`d over it, so
    that a reader sees the old file or the new one, never a part. A symlink's target is replaced and the link
    kept. On any failure the file is left as it was and the temporary file removed: PlanError E110 saying why."""
    import tempfile  # lazy: only fmt writes through a temporary file (it imports random and shutil)
    target = os.path.realpath(path)
    temporary = None
    try:
        status = os.stat(target)
        if not os.access(target, os.W_OK):  # a read-only file stays read-only, as an in-place write would
            raise PlanError([unwritable(path, OSError(errno.EACCES, os.strerror(errno.EACCES)))])
        descriptor, temporary = tempfile.mkstemp(prefix=f".{_shortened(os.path.basename(target))}.", suffix=".fmt",
                                                 dir=os.path.dirname(target))
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, stat.S_IMODE(status.st_mode))
        with contextlib.suppress(OSError):  # only root may give a file away; the bits above still hold
            os.chown(temporary, status.st_uid, status.st_gid)
        os.replace(temporary, target)
        temporary = None
    except OSError as error:
        raise PlanError([unwritable(path, error)]) from None
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    with contextlib.suppress(OSError):  # the rename itself on disk (POSIX: fsync the folder)
        folder = os.open(os.path.dirname(target), os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
