"""Every relative link and every repository path that README.md and docs/*.md mention exists.

Links (``[text](docs/x.md#anchor)``) are resolved against the page's directory and, with an anchor,
checked against the headings of the target page (GitHub's anchor rules). Paths written in the text
(``channels/tcp/peer.py``, ``benchmarks/RESULTS*.md``, ``collectives/barrier/``) are resolved against the
repository root; a module may be named without ``.py`` (``collectives/gather`` is the module or the
package). So moving or renaming a file, or a heading, fails the default run until the docs follow.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from tests.jobs import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Top-level directories whose paths the docs name; a path in the text must start with one of them.
TOP = ("twisternet", "channels", "collectives", "innet", "benchmarks", "examples", "tests", "docs", ".ci")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./$~-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*-]*)")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation but - and _ dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    found: list[str] = []
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.append(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def exists(path: str) -> bool:
    if "*" in path:
        return any(ROOT.glob(path))
    p = ROOT / path.rstrip("/")
    return p.exists() or p.with_name(p.name + ".py").exists()


def link_problems(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):        # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            problems.append(f"link to a missing file: ({target})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"link to a missing heading: ({target}); {dest.name} has {sorted(anchors(dest))}")
    return problems


def path_problems(page: Path) -> list[str]:
    text = URL.sub(" ", page.read_text())
    text = LINK.sub(lambda m: m.group(0).replace(m.group(1), ""), text)   # link targets: checked above
    missing = set()
    for raw in PATH.findall(text):
        path = raw.rstrip(".,:;")
        if not exists(path):
            missing.add(path)
    return [f"names a path that does not exist: {p}" for p in sorted(missing)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_exist(page: Path) -> None:
    problems = link_problems(page) + path_problems(page)
    assert not problems, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


def test_slug_follows_github() -> None:
    assert slug("Shared-memory slots (`channels/shm_slots.py`)") == "shared-memory-slots-channelsshm_slotspy"
    assert slug("3. Layers (arrows point to what a layer may import)") == \
        "3-layers-arrows-point-to-what-a-layer-may-import"
    assert slug("Measured (emulated cluster, 4 hosts × 2 ranks, 1 Gbit/s)") == \
        "measured-emulated-cluster-4-hosts--2-ranks-1-gbits"


def test_checker_catches_a_broken_link_and_path(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n[ok](#title) [gone](#nope) [file](missing.md) see `channels/tcp/nothere.py` "
                    "and `channels/tcp/peer.py`, `collectives/barrier/`, `benchmarks/RESULTS*.md`.\n")
    problems = link_problems(page) + path_problems(page)
    assert len(problems) == 3, problems
    assert any("#nope" in p for p in problems) and any("missing.md" in p for p in problems)
    assert any("channels/tcp/nothere.py" in p for p in problems)


def test_docs_pages_named_in_the_code_exist() -> None:
    """Docstrings and comments point readers at docs/*.md pages: those pages exist."""
    missing = set()
    for package in ("twisternet", "channels", "collectives", "innet", "benchmarks", "examples"):
        for source in (ROOT / package).rglob("*.py"):
            for page in re.findall(r"docs/[\w./-]+?\.md", source.read_text()):
                if not (ROOT / page).exists():
                    missing.add(f"{source.relative_to(ROOT)}: {page}")
    assert not missing, "names a docs page that does not exist:\n  " + "\n  ".join(sorted(missing))


def test_every_docs_page_is_linked() -> None:
    """No page under docs/ is an orphan: README.md or another page links to it."""
    linked = set()
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            file = target.partition("#")[0]
            if file and not re.match(r"[a-z][a-z0-9+.-]*:", file):
                dest = (page.parent / file).resolve()
                if dest != page.resolve():
                    linked.add(dest)
    orphans = [p.relative_to(ROOT) for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages nothing links to (add them to the README's documentation index): {orphans}"
