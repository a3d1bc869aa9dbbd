"""Files -> parsed modules with their imports resolved (E105-E107, E109 per file, E208, E209, E214).

An import names a `.plan` file (`.plan` may be left off) relative to the importing file, in a folder
of the search path (`--include DIR`, then `PLANDSL_PATH`), or in the standard library
(`import "clusters/dgx_a100"`). Only files inside those folders or the folder tree of the file named
on the command line are read, links resolved (E214 otherwise); every file goes through the bounded
reader (`plandsl.syntax.files`). Imports are loaded once each, at most `MAX_IMPORT_DEPTH` deep and
`MAX_FILES` files in all (E106); a cycle is reported with every file on it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shlex
from contextvars import ContextVar
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterable, Iterator

from plandsl.diagnostics import Diagnostic, Edit, Note, PlanError, did_you_mean, diag, nearest
from plandsl.syntax.files import FileProblem, read_bounded
from plandsl.syntax.parser import MAX_BYTES, decode, parse_source
from plandsl.diagnostics.source import SourceFile
from plandsl.syntax import Import, Module

MAX_IMPORT_DEPTH = 64    # a chain of imports (a imports b imports c ...); real plans use two or three
MAX_FILES = 256          # files one plan loads, the standard library's included
MAX_TOTAL_BYTES = 4 * MAX_BYTES  # all of them together
PATH_ENV = "PLANDSL_PATH"

_INCLUDE: ContextVar[tuple[str, ...]] = ContextVar("plandsl_include", default=())


def stdlib_root() -> Path:
    return Path(str(resources.files("plandsl.stdlib_plans")))


def stdlib_files() -> list[str]:
    """Every stdlib plan, as the name an import uses (`clusters/dgx_a100`)."""
    root = stdlib_root()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.plan"))


def read_source(path: str | os.PathLike, what: str = "plan file") -> SourceFile:
    """One plan file's (or `what`'s) text, read bounded (PlanError E106, E107, E109, E208; E105 when not UTF-8)."""
    try:
        data = read_bounded(path, MAX_BYTES, what)
    except FileProblem as problem:
        raise PlanError([problem.diagnostic(file=os.fspath(path))]) from None
    return decode(os.fspath(path), data)


@contextlib.contextmanager
def include(directories: Iterable[str | os.PathLike]) -> Iterator[None]:
    """Within the block, imports also resolve in `directories` (what `--include DIR` sets)."""
    token = _INCLUDE.set(_INCLUDE.get() + tuple(os.fspath(d) for d in directories))
    try:
        yield
    finally:
        _INCLUDE.reset(token)


def included() -> tuple[str, ...]:
    """The `--include` folders in force (passed on to the ranks of `plandsl run`)."""
    return _INCLUDE.get()


def search_path() -> tuple[Path, ...]:
    """Where imports resolve besides the importing file's folder and the standard library:
    the `--include` folders, then those of PLANDSL_PATH (os.pathsep-separated), in order."""
    from_env = [d for d in os.environ.get(PATH_ENV, "").split(os.pathsep) if d]
    return tuple(Path(d) for d in (*_INCLUDE.get(), *from_env))


def _inside(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


@dataclass
class Loaded:
    path: str
    source: SourceFile
    syntax: Module | None  # None when the file did not parse
    imports: list[tuple[Import, "Loaded | None"]] = field(default_factory=list)


@dataclass
class Loader:
    search_path: tuple[Path, ...] = field(default_factory=search_path)
    modules: dict[str, Loaded] = field(default_factory=dict)
    sources: dict[str, SourceFile] = field(default_factory=dict)
    diagnostics: list[Diagnostic] = field(default_factory=list)
    roots: tuple[str, ...] = ()  # folders files may be read from (absolute and real paths)
    total_bytes: int = 0
    refused: set[str] = field(default_factory=set)  # limits already reported

    def load_file(self, path: str) -> Loaded | None:
        self._set_roots(os.path.dirname(os.path.abspath(path)), os.path.dirname(os.path.realpath(path)))
        try:
            data = read_bounded(path, MAX_BYTES, "plan file")
        except FileProblem as problem:
            self.diagnostics.append(problem.diagnostic(file=path))
            return None
        self.total_bytes += len(data)
        return self._load(self._key(Path(path)), data, ())

    def load_text(self, text: str, path: str = "<string>") -> Loaded | None:
        base = os.getcwd() if path.startswith("<") else os.path.dirname(os.path.abspath(path))
        self._set_roots(base, os.path.realpath(base))
        # surrogatepass keeps a lone surrogate as bytes that decode() then reports as E105
        return self._load(path, text.encode("utf-8", errors="surrogatepass"), ())

    def _set_roots(self, *tree: str) -> None:
        if self.roots:
            return
        folders = [*tree, *(str(p) for p in self.search_path), str(stdlib_root())]
        roots = []
        for folder in folders:
            roots += [os.path.abspath(folder), os.path.realpath(folder)]
        self.roots = tuple(dict.fromkeys(roots))

    @staticmethod
    def _key(path: Path) -> str:
        try:
            return os.path.relpath(path) if not path.is_absolute() or str(path).startswith(os.getcwd()) else str(path)
        except ValueError:
            return str(path)

    def _load(self, key: str, data: bytes, chain: tuple[tuple[str, Import], ...]) -> Loaded | None:
        if key in self.modules:
            return self.modules[key]
        try:
            source = decode(key, data)
        except PlanError as error:
            self.sources.update(error.sources)
            self.diagnostics.extend(error.diagnostics)
            return None
        self.sources[key] = source
        try:
            syntax = parse_source(source)
        except PlanError as error:
            self.diagnostics.extend(error.diagnostics)
            loaded = Loaded(key, source, None)
            self.modules[key] = loaded
            return loaded
        loaded = Loaded(key, source, syntax)
        self.modules[key] = loaded
        for item in syntax.items:
            if isinstance(item, Import):
                loaded.imports.append((item, self._import(loaded, item, chain + ((key, item),))))
        return loaded

    def _import(self, importer: Loaded, item: Import, chain) -> Loaded | None:
        if not self.roots:
            self._set_roots(os.getcwd())
        try:
            path = self._find(importer.path, item.path)
        except FileProblem as problem:
            self.diagnostics.append(problem.diagnostic(item.span))
            return None
        if path is None:
            options = [f for f in stdlib_files() if f.split("/")[-1] == item.path.split("/")[-1]] or stdlib_files()
            extra = [str(p) for p in self.search_path]
            self.diagnostics.append(diag(
                "E208", f"cannot find import \"{item.path}\"", item.span,
                hint=did_you_mean(item.path, options, "standard library files"),
                edits=[Edit(item.span, f'import "{close}"') for close in [nearest(item.path, options)] if close],
                notes=[Note("looked next to the importing file"
                            + (f", in {', '.join(extra)}" if extra else "")
                            + f" and in the standard library ({stdlib_root()})")]))
            return None
        key = self._key(path)
        on_chain = [k for k, _ in chain]
        if key in on_chain:
            start = on_chain.index(key)
            cycle = chain[start:]
            names = " -> ".join([k for k, _ in cycle] + [key])
            self.diagnostics.append(diag(
                "E209", f"import cycle: {names}", item.span,
                hint="a file cannot import itself: remove this line" if len(cycle) == 1 else
                "move the shared definitions into a file that both import",
                notes=[Note(f"{k} imports \"{imp.path}\"", imp.span) for k, imp in cycle[:-1]]))
            return None
        if key in self.modules:
            return self.modules[key]
        problem = self._over_limits(len(chain))
        if problem is not None:
            if problem not in self.refused:  # once: every later import would say the same
                self.refused.add(problem)
                self.diagnostics.append(diag("E106", problem, item.span,
                                             hint="merge files, or import the shared ones from the top file"))
            return None
        limit = min(MAX_BYTES, MAX_TOTAL_BYTES - self.total_bytes)
        try:
            data = read_bounded(path, limit, "")
        except FileProblem as error:
            together = f" (the files of one plan: {MAX_TOTAL_BYTES:,} bytes together)" \
                if error.code == "E106" and limit < MAX_BYTES else ""
            self.diagnostics.append(FileProblem(error.code, f"import \"{_short(item.path)}\": {error.message}{together}",
                                                error.hint).diagnostic(item.span))
            return None
        self.total_bytes += len(data)
        return self._load(key, data, chain)

    def _over_limits(self, depth: int) -> str | None:
        if depth > MAX_IMPORT_DEPTH:
            return f"imports nested more than {MAX_IMPORT_DEPTH} deep (a imports b imports c ...)"
        if len(self.modules) >= MAX_FILES:
            return f"more than {MAX_FILES} files imported"
        return None

    def resolve(self, importer: str, name: str) -> Path | None:
        """The file `import "name"` in `importer` reads, or None (not found, or not allowed)."""
        if not self.roots:
            self._set_roots(os.path.dirname(os.path.abspath(importer)) if not importer.startswith("<")
                            else os.getcwd())
        try:
            return self._find(importer, name)
        except FileProblem:
            return None

    def _find(self, importer: str, name: str) -> Path | None:
        """The first `name`(.plan) in the importing file's folder, the search path, the standard library,
        inside the allowed roots; None when there is none; FileProblem E214 when the name only reaches
        outside them (or its links lead outside), E109 when the system refuses the path."""
        candidate = name if name.endswith(".plan") else name + ".plan"
        bases = [os.path.dirname(os.path.abspath(importer))] if not importer.startswith("<") else [os.getcwd()]
        bases += [str(p) for p in self.search_path] + [str(stdlib_root())]
        outside = None
        for base in bases:
            path = os.path.normpath(os.path.join(os.path.abspath(base), candidate))
            if not _inside(path, self.roots):
                outside = outside or path
                continue
            try:
                os.stat(path)
            except OSError as error:
                if error.errno in (errno.ENOENT, errno.ENOTDIR):
                    continue
                raise FileProblem("E109", f"cannot read import \"{_short(name)}\": "
                                  + ("its path is too long for the file system" if error.errno == errno.ENAMETOOLONG
                                     else error.strerror or str(error))) from None
            except ValueError:  # a NUL character in the name
                raise FileProblem("E109", "cannot read import: its name contains a NUL character") from None
            real = os.path.realpath(path)
            if not _inside(real, self.roots):
                raise FileProblem("E214", f"import \"{_short(name)}\" leads by a link to {real}, outside the "
                                  "folders imports are read from", self._hint(real))
            return Path(path)
        if outside is not None:
            raise FileProblem("E214", f"import \"{_short(name)}\" names a file outside the folders imports are "
                              "read from", self._hint(outside))
        return None

    def _hint(self, path: str) -> str:
        folder = os.path.dirname(path)
        return ("imports are read from the folder of the file being checked and below, the standard library, "
                f"and folders named with --include DIR or {PATH_ENV}: if you trust {_short(folder)}, "
                f"pass --include {shlex.quote(_short(folder))}")


def include_flags(folders) -> str:
    """`--include DIR` for each folder, quoted for a POSIX shell (a folder may hold spaces or `$`)."""
    return " ".join(f"--include {shlex.quote(str(folder))}" for folder in folders)


def _short(name: str) -> str:
    return name if len(name) <= 80 else name[:60] + "..." + name[-12:]
