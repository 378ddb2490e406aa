"""Code fingerprints: which code and which library versions make a stage's output.

A stage kind's fingerprint hashes
- the normalized source of its stage module (where `STAGE.run` is defined), of the modules its
  `StageDef.code` names (a training stage's child process: `trainer.entry` and the recipe it loads by
  name), and of every project module (packages lmforge, tasks, trainer) those import, transitively:
  `import x`, `from x import y` (y may be a submodule), relative imports and imports inside functions;
- the exact versions of the libraries in `LIBRARIES` that the same modules import;
- the StageDef's `version`, a manual bump for what the source cannot show.

Normalized means parsed with `ast`, docstrings dropped and dumped without positions: comments,
docstrings and formatting do not count, any other edit does. Modules are named by their relative
path (`trainer/sft.py`), so a fingerprint is the same in every checkout and on every machine.
Everything is computed once per process.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.stage import StageDef

ROOT = Path(__file__).resolve().parent.parent  # the checkout: lmforge/, tasks/, trainer/ sit here
PACKAGES = ("lmforge", "tasks", "trainer")
HASH_LEN = 12

#: Modules that cannot shape what a stage writes, left out with everything only they import:
#: - lmforge.tracking, trainer.metrics: what goes to MLflow (tags, params, metrics) about a run;
#: - lmforge.log: log formatting and levels;
#: - lmforge.provenance: the commit, versions and machine written into manifests (not the files);
#: - lmforge.errors, trainer.errors: exception types and their messages;
#: - lmforge.fingerprint: this module, which only names the code;
#: - lmforge.interrupt: a stop request, after which a stage raises instead of writing anything;
#: - lmforge.lease, lmforge.gc, lmforge.owner: who may build an artifact, and removing what dead runs left; never
#:   its bytes;
#: - lmforge.monitoring, trainer.monitoring: Prometheus metrics about a run;
#: - tasks.evaluation.tracking: the eval reports attached to MLflow, read from the artifact after it is written;
#: - tasks (the package's __init__): finds the stage modules, runs none of them.
#: A module that decides a file's bytes, a default or an order never belongs here.
#: CPython 3.11's ast.parse is not safe in concurrent threads ("AST constructor recursion depth mismatch",
#: seen when Prefect planned stages in parallel threads): one parse at a time
_AST_LOCK = threading.Lock()


def _parse(source: str, filename: str) -> ast.Module:
    """ast.parse, one at a time here, and again when a parse elsewhere in the process (a library's thread: seen
    with a Dask cluster in the flow) broke CPython 3.11's shared recursion counter: a parse is pure, so a retry is
    exact (cpython gh-106905, fixed in later releases)."""
    for attempt in range(4):
        try:
            with _AST_LOCK:
                return ast.parse(source, filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e):
                raise
            time.sleep(0.05 * (attempt + 1))
    with _AST_LOCK:  # the last try raises whatever it meets
        return ast.parse(source, filename)
EXCLUDED = frozenset({"lmforge.tracking", "trainer.metrics", "lmforge.log", "lmforge.provenance", "lmforge.errors",
                      "trainer.errors", "lmforge.fingerprint", "lmforge.interrupt", "lmforge.lease", "lmforge.gc",
                      "lmforge.owner",
                      "lmforge.monitoring", "trainer.monitoring", "tasks", "tasks.evaluation.tracking"})

#: Libraries whose version shapes an output: import name -> distribution name.
LIBRARIES = {"torch": "torch", "transformers": "transformers", "trl": "trl", "peft": "peft",
             "tokenizers": "tokenizers", "lm_eval": "lm-eval", "datasketch": "datasketch",
             "webdataset": "webdataset", "bitsandbytes": "bitsandbytes", "deepspeed": "deepspeed",
             "accelerate": "accelerate", "datasets": "datasets", "ijson": "ijson"}
#: A library that runs another one's code for us: transformers tokenizes with tokenizers, trl and peft
#: build on transformers.
IMPLIES = {"transformers": ("tokenizers",), "trl": ("transformers",), "peft": ("transformers",)}


@dataclass(frozen=True)
class CodeFingerprint:
    """What made (or would make) an artifact: the manifest's `code` block."""

    fingerprint: str
    modules: dict[str, str] = field(default_factory=dict)  # relative path -> 12 hex of its normalized source
    libraries: dict[str, str] = field(default_factory=dict)  # distribution -> version ("not installed")
    version: str = "1"  # the StageDef's manual bump

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fingerprint": self.fingerprint, "modules": dict(self.modules),
                               "libraries": dict(self.libraries)}
        if self.version != "1":
            out["version"] = self.version
        return out


def for_stage(sdef: "StageDef") -> CodeFingerprint:
    """The fingerprint of a stage kind in this process's checkout and environment."""
    return fingerprint(sdef.run.__module__, tuple(sdef.code), sdef.version)


@functools.cache
def fingerprint(stage_module: str, extra: tuple[str, ...] = (), version: str = "1") -> CodeFingerprint:
    modules, imports = _closure((stage_module, *extra))
    libs: set[str] = set()
    for lib in imports:
        libs |= {lib, *_implied(lib)}
    libraries = {LIBRARIES[lib]: _library_version(LIBRARIES[lib]) for lib in sorted(libs)}
    full = dict(sorted((_rel_path(m), _module_hash(m)) for m in modules))
    body = json.dumps({"modules": full, "libraries": libraries, "version": version}, sort_keys=True)
    return CodeFingerprint(hashlib.sha256(body.encode()).hexdigest()[:16],
                           {path: h[:HASH_LEN] for path, h in full.items()}, libraries, version)


def cache_clear() -> None:
    """Forget everything computed so far (tests that edit a module's source or a library version)."""
    for f in (fingerprint, _analyze, _module_file, _library_version):
        getattr(f, "cache_clear", lambda: None)()  # a test may have replaced _library_version


def diff(before: dict[str, Any], after: CodeFingerprint) -> tuple[list[str], list[str]]:
    """What changed from a manifest's `code` block to `after`: (modules, e.g. ['trainer/sft.py'], libraries and
    versions, e.g. ['trl 1.12.0 -> 1.13.0'])."""
    modules: list[str] = []
    old_m, new_m = before.get("modules", {}), after.modules
    for path in sorted(set(old_m) | set(new_m)):
        if path not in new_m:
            modules.append(f"{path} (no longer used)")
        elif path not in old_m:
            modules.append(f"{path} (new)")
        elif old_m[path] != new_m[path]:
            modules.append(path)
    other: list[str] = []
    old_l, new_l = before.get("libraries", {}), after.libraries
    for lib in sorted(set(old_l) | set(new_l)):
        if old_l.get(lib) != new_l.get(lib):
            other.append(f"{lib} {old_l.get(lib, 'unused')} -> {new_l.get(lib, 'unused')}")
    if before.get("version", "1") != after.version:
        other.append(f"stage version {before.get('version', '1')} -> {after.version}")
    if not modules and not other and before.get("fingerprint") != after.fingerprint:
        other.append(f"fingerprint {before.get('fingerprint')} -> {after.fingerprint}")
    return modules, other


# ----------------------------------------------------------------------------------------------
# the import walk


def _closure(roots: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """(project modules, library import names) reachable from `roots`."""
    seen: set[str] = set()
    libs: set[str] = set()
    todo = [m for m in roots if _module_file(m) is not None]
    missing = [m for m in roots if _module_file(m) is None]
    if missing:
        raise ModuleNotFoundError(f"code fingerprint: no source for module(s) {', '.join(missing)}")
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for dep in _imports(name):
            top = dep.split(".")[0]
            if top in LIBRARIES:
                libs.add(top)
            elif top in PACKAGES and dep not in EXCLUDED and dep not in seen and _module_file(dep) is not None:
                todo.append(dep)
    return seen, libs


def _implied(lib: str) -> set[str]:
    out: set[str] = set()
    for dep in IMPLIES.get(lib, ()):
        out |= {dep, *_implied(dep)}
    return out


def _imports(name: str) -> tuple[str, ...]:
    return _analyze(name)[1]


def _module_hash(name: str) -> str:
    return _analyze(name)[0]


@functools.cache
def _analyze(name: str) -> tuple[str, tuple[str, ...]]:
    """(sha256 of the normalized source, imported modules) of a project module, from one parse."""
    path = _module_file(name)
    tree = _parse(_read_source(path), str(path))
    imports = _imported_modules(tree, name if path.name == "__init__.py" else name.rpartition(".")[0])
    return hashlib.sha256(_normalized(tree).encode()).hexdigest(), imports


def _imported_modules(tree: ast.Module, package: str) -> tuple[str, ...]:
    """Modules a module imports anywhere in its source (also inside functions), as absolute names: for
    `import a.b.c` a, a.b and a.b.c (importing runs each package's __init__); for `from a import b` a, and
    a.b when b is a submodule. Imports under `if TYPE_CHECKING:` never run and are left out."""
    found: list[str] = []
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found += _with_parents(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[:len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join([*parts, *([node.module] if node.module else [])])
            if not base:
                continue
            found += _with_parents(base)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and sub.split(".")[0] in PACKAGES and _module_file(sub) is not None:
                    found.append(sub)
    return tuple(dict.fromkeys(found))


def _walk(tree: ast.AST):
    """ast.walk, minus the bodies of `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                todo.extend(child.orelse)
            else:
                todo.append(child)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


@functools.cache
def _module_file(name: str) -> Path | None:
    """The source file of a module: under ROOT for the project's packages, else wherever Python finds it
    (a stage defined outside them, e.g. in a test). None when there is none."""
    if name.split(".")[0] in PACKAGES:
        base = ROOT.joinpath(*name.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None
    mod = sys.modules.get(name)
    origin = getattr(mod, "__file__", None)
    if origin is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        origin = spec.origin if spec else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _rel_path(name: str) -> str:
    """`trainer/sft.py`, `tasks/__init__.py`: from the module's name, so the same in every checkout."""
    path = _module_file(name)
    return name.replace(".", "/") + ("/__init__.py" if path is not None and path.name == "__init__.py" else ".py")


# ----------------------------------------------------------------------------------------------
# normalized source and library versions (module-level functions, so tests can replace them)


def _read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def normalized_source(source: str, filename: str = "<source>") -> str:
    """The AST without docstrings and positions: equal for sources that differ in comments, docstrings
    and formatting only."""
    return _normalized(_parse(source, filename))


def _normalized(tree: ast.Module) -> str:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:]
    return ast.dump(tree, include_attributes=False)


@functools.cache
def _library_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
