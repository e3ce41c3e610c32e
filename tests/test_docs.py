"""The documentation's promises about itself: the pages stay within their
sizes, every file a page cites exists, and every raw file under results/
is cited by a page. Pure text and file-system checks (CPU, well under a
second).

A citation is a backticked path or a Markdown link target. Paths that
start with a top-level folder of the repository (``results/``,
``cluster/``, ...) are read from the repository root; other paths are read
from the citing page's folder, which is how the results pages cite their
raw files (``h200_tree_eval_b1_t0.json``, ``drafter_variants/``). ``*``
and ``{a,b}`` are expanded, and each alternative must match a file. Bare
names of other files (``train.jsonl`` in prose) are not checked unless
they carry a results prefix (``h200_``, ``cpu_``, ...)."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
TOP = ("results", "cluster", "actors", "kernels", "bench", "examples", "tests", "docs", "data", "deploy")
RESULT_PREFIX = re.compile(r"^(h200|h200x2|h200x4|h200x8|h100|cpu)_[\w.*{},\-]*\.[\w*]+$")
PATHLIKE = re.compile(r"[\w./*{},\-]+")
LIMITS = {"README.md": 10_000, "results/README.md": 25_000}


def pages() -> list[Path]:
    out = [ROOT / "README.md", RESULTS / "README.md"]
    out += sorted((ROOT / "docs").glob("*.md"))
    out += sorted((RESULTS / "archive").rglob("README.md"))
    return [p for p in out if p.exists()]


def _braces(s: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", s)
    if not m:
        return [s]
    return [x for alt in m.group(1).split(",") for x in _braces(s[: m.start()] + alt + s[m.end():])]


def citations(page: Path) -> list[tuple[str, Path]]:
    """(citation, folder it is read from) for every path the page cites."""
    text = page.read_text()
    here = page.parent
    found: list[tuple[str, Path]] = []
    # Code blocks hold commands, not citations.
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        for tok in re.split(r",\s+", span.strip()):
            if not PATHLIKE.fullmatch(tok) or tok.startswith(("-", ".")) or "..." in tok:
                continue
            first = tok.split("/", 1)[0]
            if "/" in tok and first in TOP and (ROOT / first).is_dir():
                found.append((tok, ROOT))
            elif "/" in tok and first and (here / first).is_dir() and here != ROOT:
                found.append((tok, here))
            elif "/" not in tok and RESULT_PREFIX.match(tok):
                found.append((tok, here))
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        found.append((target.split("#", 1)[0], here))
    return found


def resolve(tok: str, base: Path) -> list[Path]:
    """The files (or folders) a citation names; [] when an alternative matches nothing."""
    hits: list[Path] = []
    for alt in _braces(tok):
        matched = [Path(p) for p in glob.glob(str(base / alt))]
        if not matched:
            return []
        hits += matched
    return hits


def test_page_sizes():
    for rel, limit in LIMITS.items():
        size = (ROOT / rel).stat().st_size
        assert size <= limit, f"{rel} is {size} bytes, over its {limit}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_files_exist(page: Path):
    missing = [tok for tok, base in citations(page) if not resolve(tok, base)]
    assert not missing, f"{page.relative_to(ROOT)} cites files that do not exist: {missing}"


def _cited_files() -> set[Path]:
    cited: set[Path] = set()
    for page in pages():
        for tok, base in citations(page):
            for hit in resolve(tok, base):
                hit = hit.resolve()
                if hit.is_dir():
                    cited.update(p.resolve() for p in hit.rglob("*") if p.is_file())
                else:
                    cited.add(hit)
    return cited


def test_every_result_file_is_cited():
    """No raw file under results/ sits there unexplained: each is cited by
    results/README.md, an archive page or a doc."""
    cited = _cited_files()
    raw = [p.resolve() for p in RESULTS.rglob("*") if p.is_file() and p.name != "README.md"]
    uncited = sorted(str(p.relative_to(ROOT)) for p in raw if p not in cited)
    assert not uncited, f"files under results/ that no page cites: {uncited}"


def test_current_files_are_cited_by_the_results_page():
    """What stays beside results/README.md is what a current figure cites;
    the rest belongs under results/archive/."""
    cited = {hit.resolve() for tok, base in citations(RESULTS / "README.md") for hit in resolve(tok, base)}
    here = [p for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md"]
    stray = sorted(p.name for p in here if p.resolve() not in cited)
    assert not stray, f"results/ files that results/README.md does not cite (archive them): {stray}"


def test_readme_results_are_in_the_results_page():
    """Every raw file the README's results table cites is one that
    results/README.md cites too (one current figure, one file)."""
    current = {hit.resolve() for tok, base in citations(RESULTS / "README.md") for hit in resolve(tok, base)}
    readme = [(tok, resolve(tok, base)) for tok, base in citations(ROOT / "README.md")
              if tok.startswith("results/") and not tok.endswith((".md", "/"))]
    outside = [tok for tok, hits in readme if not any(h.resolve() in current for h in hits)]
    assert not outside, f"README.md cites results files that results/README.md does not: {outside}"
