"""The README's figures and links: its studies table is what ``experiments/index.py`` renders
from the results files now, and every path it (and each folder README beside the code) names
exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The top README and the reference moved next to what it documents.
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "simcap").glob("*/README.md"))]

# Written by ``pip install``, not kept in the repository.
GENERATED = {"simcap/_compiled.txt"}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"`((?:simcap|experiments|benchmarks|tests|examples|calibration|\.ci)/[^`\s]*)`")
MODULE = re.compile(r"`(simcap(?:\.\w+)+)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _index():
    spec = importlib.util.spec_from_file_location("experiments_index", ROOT / "experiments" / "index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _slug(heading: str) -> str:
    """A heading's anchor, as markdown renderers make it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = FENCE.sub("", doc.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _placeholder(path: str) -> bool:
    """``simcap/catalog/models/NAME.json``, ``data/<model>/``: a pattern, not a file."""
    return any(c in path for c in "<>*{}") or bool(re.search(r"(^|/)[A-Z][A-Z_]+(\.|/|$)", path))


def _defines(source: str, name: str) -> bool:
    """The module defines, assigns, imports or lazily exports ``name``."""
    name = re.escape(name)
    return bool(re.search(rf"^\s*(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*(?:from|import)\s.*\b{name}\b"
                          rf"|[\"']{name}[\"']\s*:", source, re.M))


def test_studies_table_is_the_results_files():
    index = _index()
    block = index.readme_block((ROOT / "README.md").read_text())
    assert block == index.render(), "results changed: run python experiments/index.py --write"


def test_every_study_has_a_row():
    index = _index()
    assert [folder for folder, _, _ in index.STUDIES] and \
        {folder for folder, _, _ in index.STUDIES} == set(index.study_folders())


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_to_what_exists(doc):
    text = doc.read_text()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            missing.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            missing.append(target)
    for path in REPO_PATH.findall(text):
        if path not in GENERATED and not _placeholder(path) and not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"{doc.relative_to(ROOT)} names what does not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_named_exist(doc):
    """``simcap.a.b.name``: the longest prefix that is a module exists, and the first name after
    it appears in that module's source."""
    missing = []
    for dotted in set(MODULE.findall(doc.read_text())):
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            base = ROOT.joinpath(*parts[:n])
            source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            if source.exists():
                break
        rest = parts[n:]
        if len(rest) > 2 or (len(rest) == 2 and not rest[0][:1].isupper()):
            missing.append(dotted)  # a module that is not there (a class's method is two names)
        elif rest and not _defines(source.read_text(), rest[0]):
            missing.append(dotted)
    assert not missing, f"{doc.relative_to(ROOT)} names modules or names that do not exist: {missing}"
