"""Every ```python block of README.md runs as shown under ``twisternet run -n 4``.

A block that uses names it does not define gets them from PRELUDES, and only those: the README's
"Using it" block iterates ``words`` (the job's input, left to the reader), so the prelude gives it a
few words. A block that needs a name not listed here fails the test, naming it.
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

from tests.jobs import ROOT, run_tcp

pytestmark = pytest.mark.timeout(300)

README = ROOT / "README.md"
#: Inputs the README leaves to the reader, by name: the only code added in front of a block.
PRELUDES = {
    "words": 'words = "the quick brown fox jumps over the lazy dog and the cat".split() * 50\n',
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def undefined_names(code: str) -> set[str]:
    """Names the block reads but neither assigns, imports, defines, nor gets from builtins."""
    tree = ast.parse(code)
    bound: set[str] = set(dir(builtins))
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return used - bound


BLOCKS = python_blocks(README.read_text())


def test_readme_has_python_blocks() -> None:
    assert BLOCKS, "README.md lost its ```python blocks"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs_under_twisternet_run_n4(index: int, tmp_path: Path) -> None:
    code = BLOCKS[index]
    missing = undefined_names(code)
    unknown = missing - set(PRELUDES)
    assert not unknown, f"README python block {index} uses {sorted(unknown)} without defining them"
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text("".join(PRELUDES[n] for n in sorted(missing)) + code + '\nprint("SNIPPET DONE", flush=True)\n')
    p = run_tcp(4, script, timeout=240, grace=20)
    assert p.returncode == 0, f"README python block {index} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert p.stdout.count("SNIPPET DONE") == 4, p.stdout[-3000:]
