"""A model source -> its torch module, built on the meta device (nothing allocated); each failure a
coded diagnostic pointing at the user's line (E901: cannot import, E902: builds no torch module).

Stage: interpreter side of `plandsl inspect` (imports torch, transformers and the user's code).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect as pyinspect
import os
import sys
import threading
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from plandsl.diagnostics import Diagnostic, PlanError, did_you_mean, diag, limits
from plandsl.diagnostics.source import NO_SPAN, SourceFile, Span
from plandsl.ir.inspected import ModelSource

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Frames in these folders are not the user's: a diagnostic points at the deepest frame outside them.
_LIBRARY_ROOTS = tuple(str(Path(module.__file__).resolve().parent) for module in (torch, importlib, contextlib))
_PLANDSL_ROOT = str(Path(__file__).resolve().parents[2])


class Failure(Exception):
    """One diagnostic and the source files its spans point into."""

    def __init__(self, diagnostic: Diagnostic, sources: dict[str, SourceFile]):
        super().__init__(diagnostic.message)
        self.diagnostic, self.sources = diagnostic, sources

    def error(self) -> PlanError:
        return PlanError([self.diagnostic], self.sources)


def fail(code: str, message: str, where: tuple[Span, dict[str, SourceFile]] | None = None,
         hint: str | None = None) -> Failure:
    span, sources = where or (NO_SPAN, {})
    return Failure(diag(code, message, span, hint=hint), sources)


def line_span(path: str, line: int) -> tuple[Span, dict[str, SourceFile]]:
    """The span of `line` of the file at `path` (its text without the indentation), and the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return NO_SPAN, {}
    shown = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    source = SourceFile(shown, text)
    start = source._line_starts[line - 1] if 0 < line <= len(source._line_starts) else 0
    content = source.line_text(line)
    start += len(content) - len(content.lstrip())
    return source.span(start, start + len(content.strip()) or start + 1), {shown: source}


def user_frame(error: BaseException, library: tuple[str, ...] = ()) -> tuple[Span, dict[str, SourceFile]] | None:
    """The deepest frame of the error's traceback that is the user's code (not torch, the standard library,
    plandsl or `library`), as a span; None when there is none."""
    roots = _LIBRARY_ROOTS + (_PLANDSL_ROOT,) + library
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if frame.filename and not frame.filename.startswith("<")
              and not str(Path(frame.filename).resolve()).startswith(roots)]
    if isinstance(error, SyntaxError) and error.filename and error.lineno:
        return line_span(error.filename, error.lineno)
    return line_span(frames[-1].filename, frames[-1].lineno) if frames else None


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")


@contextlib.contextmanager
def _on_path(folders: tuple[str, ...]):
    """The folders first on sys.path while the user's code is imported (as `python -m` puts the current one)."""
    saved = list(sys.path)
    sys.path[:0] = [folder for folder in folders if folder not in sys.path]
    try:
        yield
    finally:
        sys.path[:] = saved


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build(source: ModelSource, dtype: str, search_path: tuple[str, ...],
          device: str = "meta") -> tuple[nn.Module, tuple[str, ...]]:
    """The source's module on `device` (the meta device: nothing allocated; the interpreter builds on the
    CPU), its floating parameters `dtype` by default, and the file of the factory's module (none for a
    Hugging Face class); `Failure`."""
    with _on_path(search_path), default_dtype(DTYPES[dtype]), _bounded(source):
        if source.kind == "hf":
            return _build_hf(source, device), ()
        return _build_factory(source, device)


class _TooMany(BaseException):
    """Raised inside the module's construction at its `MAX_MODULE_PARAMETERS`-th-and-one parameter: a BaseException,
    so that the builders' `except Exception` (a config transformers refuses, a factory raising: E902) lets it by."""


@contextlib.contextmanager
def _bounded(source: ModelSource):
    """Stop the construction (E505) past `limits.MAX_MODULE_PARAMETERS` parameter tensors registered in this thread: a
    config's layer count is a number in the plan, and the build's time and memory grow with it."""
    owner, count = threading.get_ident(), [0]

    def registered(module, name, param) -> None:
        if param is not None and threading.get_ident() == owner:
            count[0] += 1
            if count[0] > limits.MAX_MODULE_PARAMETERS:
                raise _TooMany()

    handle = register_module_parameter_registration_hook(registered)
    try:
        yield
    except _TooMany:
        raise fail("E505", f"{source.text} registers more than {limits.MAX_MODULE_PARAMETERS:,} parameter tensors "
                           "as it is built (plandsl's limit on a model from torch)",
                   hint="a model of today registers a few thousand (DeepSeek-V3's unfused experts about 48,000): "
                        "check its layer and expert counts") from None
    finally:
        handle.remove()


def _build_factory(source: ModelSource, device: str) -> tuple[nn.Module, tuple[str, ...]]:
    module_name, _, function_name = source.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as error:  # any failure of the user's import is E901 (sys.exit too: a script)
        missing = isinstance(error, ModuleNotFoundError) and error.name and module_name.startswith(error.name)
        raise fail("E901", f"cannot import '{module_name}' for model '{source.target}': {_described(error)}",
                   None if missing else user_frame(error),
                   hint="run plandsl where the package is importable (the current folder is searched first), "
                        "or add its folder to PYTHONPATH" if missing else None) from error
    factory = module
    for part in function_name.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            names = [name for name in vars(module) if not name.startswith("_")]
            raise fail("E901", f"module '{module_name}' has no '{function_name}'",
                       definition(module), hint=did_you_mean(function_name, names, f"names in {module_name}"))
    try:
        with torch.device(device):
            built = factory(**dict(source.args))
    except (Exception, SystemExit) as error:  # the user's factory raising is E902 (sys.exit too: argparse's refusal)
        raise fail("E902", f"factory '{source.target}' raised {_described(error)}",
                   user_frame(error) or definition(factory)) from error
    if not isinstance(built, nn.Module):
        raise fail("E902", f"factory '{source.target}' returned {type(built).__name__}, not a torch.nn.Module",
                   definition(factory), hint="return the model (an nn.Module instance) from the factory")
    path = getattr(module, "__file__", None)
    return built, (str(Path(path).resolve()),) if path else ()


def definition(obj) -> tuple[Span, dict[str, SourceFile]] | None:
    """Where a function (its `def` line) or a module (its first line) is written."""
    try:
        path = pyinspect.getsourcefile(obj)
        line = 1 if pyinspect.ismodule(obj) else pyinspect.getsourcelines(obj)[1]
    except (OSError, TypeError):
        return None
    return line_span(path, line) if path else None


def _build_hf(source: ModelSource, device: str) -> nn.Module:
    try:
        import transformers  # lazy: only a Hugging Face source needs it (~2 s)
    except ImportError as error:
        raise fail("E901", f"cannot import transformers for '{source.text}': {_described(error)}",
                   hint="python -m pip install transformers") from error
    cls = getattr(transformers, source.target, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and getattr(cls, "config_class", None)):
        names = [name for name in dir(transformers) if name.endswith(("Model", "LMHeadModel")) or "For" in name]
        raise fail("E901", f"transformers has no model class '{source.target}'",
                   hint=did_you_mean(source.target, names, "transformers model classes")
                   or "a class such as LlamaForCausalLM, GPT2LMHeadModel, MixtralForCausalLM")
    config_class = cls.config_class
    try:
        config = config_class(**dict(source.args))
        unknown = _unknown_key(config_class, dict(source.args), config.to_dict())
        if unknown is None:
            with torch.device(device):
                return cls(config)
    except Exception as error:  # a config transformers refuses is E902
        raise fail("E902", f"{source.target} cannot be built from this config: {_described(error)}") from error
    known = _config_keys(config_class)
    raise fail("E902", f"{config_class.__name__} has no key '{unknown}'",
               hint=did_you_mean(unknown, sorted(known), f"keys of {config_class.__name__}"))


def _config_keys(config_class) -> set[str]:
    """The keys a config class names: its constructor's parameters, its defaults, its aliases."""
    return (set(pyinspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
            | set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {})))


def _unknown_key(config_class, args: dict, built: dict) -> str | None:
    """A key the config class would keep as a stray attribute (a misspelling, silently kept by transformers):
    not one it names, and changing nothing but itself (a legacy key like `rope_theta` changes another)."""
    known = _config_keys(config_class)
    for key in args:
        if key in known:
            continue
        without = config_class(**{k: v for k, v in args.items() if k != key}).to_dict()
        if all(built.get(name) == without.get(name) for name in built if name != key):
            return key
    return None
