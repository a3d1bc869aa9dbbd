"""Files -> parsed modules with their imports resolved (E105-E106 per file, E208, E209).

An import names a file relative to the importing file, or one of the standard library
(`import "clusters/dgx_a100"`); `.plan` may be left off. Imports are loaded once each;
a cycle is reported with every file on it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from plandsl.diagnostics import Diagnostic, Note, PlanError, did_you_mean, diag
from plandsl.parser import decode, parse_source
from plandsl.source import SourceFile
from plandsl.syntax import Import, Module


def stdlib_root() -> Path:
    return Path(str(resources.files("plandsl.stdlib_plans")))


def stdlib_files() -> list[str]:
    """Every stdlib plan, as the name an import uses (`clusters/dgx_a100`)."""
    root = stdlib_root()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.plan"))


@dataclass
class Loaded:
    path: str
    source: SourceFile
    syntax: Module | None  # None when the file did not parse
    imports: list[tuple[Import, "Loaded | None"]] = field(default_factory=list)


@dataclass
class Loader:
    search_path: tuple[Path, ...] = ()
    modules: dict[str, Loaded] = field(default_factory=dict)
    sources: dict[str, SourceFile] = field(default_factory=dict)
    diagnostics: list[Diagnostic] = field(default_factory=list)

    def load_file(self, path: str) -> Loaded | None:
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            self.diagnostics.append(diag("E208", f"cannot read {path}: {error.strerror or error}"))
            return None
        return self._load(self._key(Path(path)), data, ())

    def load_text(self, text: str, path: str = "<string>") -> Loaded | None:
        # surrogatepass keeps a lone surrogate as bytes that decode() then reports as E105
        return self._load(path, text.encode("utf-8", errors="surrogatepass"), ())

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
        path = self.resolve(importer.path, item.path)
        if path is None:
            options = [f for f in stdlib_files() if f.split("/")[-1] == item.path.split("/")[-1]] or stdlib_files()
            self.diagnostics.append(diag(
                "E208", f"cannot find import \"{item.path}\"", item.span,
                hint=did_you_mean(item.path, options, "standard library files"),
                notes=[Note("looked next to the importing file and in the standard library "
                            f"({stdlib_root()})")]))
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
        return self._load(key, path.read_bytes(), chain)

    def resolve(self, importer: str, name: str) -> Path | None:
        candidates = [name] if name.endswith(".plan") else [name + ".plan", name]
        bases = [Path(importer).parent] if not importer.startswith("<") else [Path.cwd()]
        bases += list(self.search_path) + [stdlib_root()]
        for base in bases:
            for candidate in candidates:
                path = base / candidate
                if path.is_file():
                    return path
        return None
