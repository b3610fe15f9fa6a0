"""Known fixes for remote-code model folders (`trust_remote_code` Python files), applied by AST, idempotently.

Each fix names the files it applies to, checks the code has the expected shape, edits only the lines it must
(comments and formatting elsewhere are kept), keeps the original as `<file>.kit-orig` (written once, never
overwritten) and re-parses the result. A file that matches a fix's name but not its shape stops with a message.
"""

from __future__ import annotations

import ast
import fnmatch
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from kit.errors import KitError
from kit.storage.atomic import atomic_write_text

BACKUP_SUFFIX = ".kit-orig"


class RemoteCodeFixError(KitError, ValueError):
    """A file looks like a known case but not in the shape the fix expects."""


@dataclass
class FixResult:
    """What happened to one file for one fix."""

    file: str
    fix: str
    status: str  # "applied" | "already applied" | "would apply" (dry run)
    detail: str
    backup: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


def _is_super_init(stmt: ast.stmt) -> bool:
    """`super().__init__(...)` or `super(Cls, self).__init__(...)` as a bare statement."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    func = stmt.value.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "__init__"
        and isinstance(func.value, ast.Call)
        and isinstance(func.value.func, ast.Name)
        and func.value.func.id == "super"
    )


def _tokenizer_inits(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Tokenizer"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    yield node, item


def fix_super_init_last(source: str, path: Path) -> tuple[Optional[str], str]:
    """Baichuan/Baichuan2 tokenizer: move `super().__init__(...)` to the end of `__init__`.

    transformers >= 4.34 calls get_vocab() inside the base __init__, before Baichuan has set `self.sp_model`
    (AttributeError); the ModelArts manual's fix is to call super().__init__() last.
    Returns (new source or None if already fixed, detail).
    """
    tree = ast.parse(source)
    inits = list(_tokenizer_inits(tree))
    if not inits:
        raise RemoteCodeFixError(
            f"{path}: expected a class named *Tokenizer with an __init__ (Baichuan tokenizer layout); none found. "
            "Check the file is the model's tokenizer, or fix it by hand: call super().__init__(...) last."
        )
    lines = source.splitlines(keepends=True)
    changed, details = False, []
    for cls, init in reversed(inits):  # bottom-up so earlier line numbers stay valid
        calls = [s for s in init.body if _is_super_init(s)]
        if len(calls) != 1:
            raise RemoteCodeFixError(
                f"{path}: {cls.name}.__init__ has {len(calls)} top-level super().__init__(...) calls; the fix "
                "expects exactly one. Move the call to the end of __init__ by hand."
            )
        call, last = calls[0], init.body[-1]
        if call is last:
            details.append(f"{cls.name}: super().__init__ already last")
            continue
        start, end = call.lineno - 1, call.end_lineno  # the call's full lines, keyword lines included
        block = lines[start:end]
        insert_at = last.end_lineno
        lines[insert_at:insert_at] = block
        del lines[start:end]
        changed = True
        details.append(
            f"{cls.name}: moved super().__init__ (line {call.lineno}) after line {last.end_lineno}"
        )
    if not changed:
        return None, "; ".join(details)
    new_source = "".join(lines)
    for _cls, init in _tokenizer_inits(ast.parse(new_source)):  # verify the result
        if not _is_super_init(init.body[-1]):
            raise RemoteCodeFixError(f"{path}: internal check failed after the edit; file left unchanged.")
    return new_source, "; ".join(details)


def _is_jit_script(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr in ("script", "script_method")
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "jit"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "torch"
    )


def fix_jit_script_decorators(source: str, path: Path) -> tuple[Optional[str], str]:
    """ChatGLM-style `@torch.jit.script` helpers: drop the decorator (same function, run eagerly).

    On NPU without transfer_to_npu the TorchScript fuser fails with "Unknown device for graph fuser"
    (LLaMA-Factory #3788, #4228); transfer_to_npu turns torch.jit.script into a no-op for the same reason.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for deco in node.decorator_list:
                if _is_jit_script(deco):
                    line = lines[deco.lineno - 1].strip()
                    if deco.lineno != deco.end_lineno or line not in (
                        "@torch.jit.script",
                        "@torch.jit.script_method",
                    ):
                        raise RemoteCodeFixError(
                            f"{path}:{deco.lineno}: a torch.jit decorator shares its line with "
                            "other code; remove it by hand."
                        )
                    spans.append((deco.lineno, node.name))
    if not spans:
        return None, "no @torch.jit.script decorators"
    for lineno, _name in sorted(spans, reverse=True):
        del lines[lineno - 1]
    new_source = "".join(lines)
    ast.parse(new_source)  # still valid Python
    names = ", ".join(sorted({name for _, name in spans}))
    return new_source, f"removed @torch.jit.script from {len(spans)} function(s): {names}"


@dataclass(frozen=True)
class KnownFix:
    """A fix: name, file patterns it applies to, the AST-based editor, and whether 'nothing to do' is reported."""

    name: str
    patterns: tuple
    apply: Callable[[str, Path], tuple]
    report_unchanged: bool = True  # False for fixes that only apply to some files matching the pattern


KNOWN_FIXES = (
    KnownFix("baichuan-tokenizer-super-init-last", ("tokenization_baichuan*.py",), fix_super_init_last),
    KnownFix("torch-jit-script-off", ("modeling_*.py",), fix_jit_script_decorators, report_unchanged=False),
)


def fix_remote_code(model_dir: Union[str, Path], *, dry_run: bool = False) -> list:
    """Apply every known fix to the Python files of `model_dir`; returns a FixResult per matching file."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"model_dir {folder} is not a folder; pass the HF model/tokenizer folder.")
    results = []
    for fix in KNOWN_FIXES:
        for path in sorted(folder.glob("*.py")):
            if not any(fnmatch.fnmatch(path.name, p) for p in fix.patterns):
                continue
            source = path.read_text(encoding="utf-8")
            new_source, detail = fix.apply(source, path)
            if new_source is None:
                if fix.report_unchanged:
                    results.append(FixResult(str(path), fix.name, "already applied", detail))
                continue
            if dry_run:
                results.append(FixResult(str(path), fix.name, "would apply", detail))
                continue
            backup = path.with_name(path.name + BACKUP_SUFFIX)
            if not backup.exists():  # keep the very first original, across repeated runs
                atomic_write_text(backup, source)
            atomic_write_text(path, new_source)
            results.append(FixResult(str(path), fix.name, "applied", detail, str(backup)))
    return results
