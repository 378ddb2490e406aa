"""The docs against the code: generated pages fresh, the README short, links whole, figures in one place.

docs/config.md, docs/config-nested.md and docs/cli.md are regenerated in memory by docs/generate.py and compared with the files; a
relative link in README.md or docs/*.md must name a file that exists (and, for a Markdown file, an anchor it
has); module docstrings in the code say what and why, not how fast: measured figures live in docs/results.md.
"""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README_MAX_LINES = 220
CODE_DIRS = ("lmforge", "trainer", "tasks", "flows")  # bench docstrings state targets, which are figures too
FIGURE_PATTERNS = (
    re.compile(r"\b\d+(?:\.\d+)? ?(?:s|ms|min|seconds|minutes|hours|GiB|MiB|GB|MB|tokens/s|tok/s|docs/s)(?![\w/])"),
    re.compile(r"\b\d+(?:\.\d+)? ?%"),
    re.compile(r"\b\d+(?:\.\d+)?x(?!\w)"),
    re.compile(r"\d ?×"),
)


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return _generator().render_all()[0]


@pytest.mark.parametrize("name", ["config.md", "config-nested.md", "cli.md"])
def test_generated_docs_are_fresh(name, generated):
    expected = generated[name]
    current = (DOCS / name).read_text(encoding="utf-8") if (DOCS / name).exists() else ""
    assert current == expected, f"docs/{name} is stale: run `make docs` (.venv/bin/python docs/generate.py)"


def test_generated_cli_does_not_depend_on_the_terminal(monkeypatch):
    gen = _generator()
    monkeypatch.setenv("COLUMNS", "40")
    narrow = gen.render_cli()
    monkeypatch.setenv("COLUMNS", "300")
    assert gen.render_cli() == narrow


def test_config_reference_lists_every_stage_kind_and_field():
    from tasks import REGISTRY

    text = (DOCS / "config.md").read_text(encoding="utf-8")
    for kind, sdef in REGISTRY.items():
        assert f'<a id="kind-{kind}"></a>' in text, kind
        for field in sdef.config.model_fields:
            assert f"| `{field}` |" in text, f"{kind}.{field}"


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_ANCHOR = re.compile(r'<a id="([^"]+)"></a>')


def _anchors(md: Path) -> set[str]:
    """Explicit `<a id>` anchors and GitHub's heading slugs of a Markdown file."""
    text = _FENCE.sub("", md.read_text(encoding="utf-8"))
    found = set(_ANCHOR.findall(text))
    for line in text.splitlines():
        m = re.match(r"^#{1,6} +(.*)$", line)
        if m:
            heading = re.sub(r"<[^>]+>", "", m.group(1)).strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return found


def _broken_links() -> list[str]:
    broken = []
    for md in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = _FENCE.sub("", md.read_text(encoding="utf-8"))
        for target in _LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(REPO)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no anchor #{anchor} in {dest.relative_to(REPO)}")
    return broken


def test_relative_links_resolve():
    assert _broken_links() == []


def docstring_figures() -> list[str]:
    """`path:line: text` for each measured-looking figure in a module docstring under the code folders."""
    hits = []
    for folder in CODE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            doc = ast.get_docstring(tree, clean=False)
            if not doc:
                continue
            first = tree.body[0].lineno
            for i, line in enumerate(doc.splitlines()):
                for pattern in FIGURE_PATTERNS:
                    for m in pattern.finditer(line):
                        hits.append(f"{path.relative_to(REPO)}:{first + i}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return hits


def test_module_docstrings_hold_no_measured_figures():
    hits = docstring_figures()
    assert hits == [], "measured figures belong in docs/results.md, not docstrings:\n" + "\n".join(hits)
