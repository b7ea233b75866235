"""The examples run end to end (one process, and several over TCP and MPI) and compute the right thing."""

from __future__ import annotations

import collections
import heapq
import importlib.util
import os
import re
import sys
from types import ModuleType

import pytest

from tests.collectives.launchers import ROOT, run_script

EX = os.path.join(ROOT, "examples")


def example(name: str) -> ModuleType:
    """The module of ``examples/<name>.py`` (the examples are scripts, not a package)."""
    if f"example_{name}" not in sys.modules:
        spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EX, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules[f"example_{name}"]


def _wordcount_reference(world: int, words: int, top: int) -> list[tuple[str, int]]:
    wordcount = example("wordcount")
    c: collections.Counter = collections.Counter()
    for r in range(world):
        c.update(wordcount.generated_words(r, world, words))
    return heapq.nlargest(top, c.items(), key=lambda kv: (kv[1], kv[0]))


def _printed_top(out: str) -> list[tuple[str, int]]:
    return [(m.group(2), int(m.group(1))) for m in re.finditer(r"^(?:\[\d+\] )?\s+(\d+)\s+(\S+)\s*$", out, re.M)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher,world", [("tcp", 3), ("mpi", 2)])
def test_wordcount(launcher: str, world: int) -> None:
    out = run_script(launcher, world, os.path.join(EX, "wordcount.py"), ["--words", "30000", "--top", "8"])
    assert "time taken" in out
    assert _printed_top(out) == _wordcount_reference(world, 30000, 8)


@pytest.mark.timeout(120)
def test_wordcount_file_single_process(tmp_path) -> None:
    wordcount = example("wordcount")
    text = tmp_path / "t.txt"
    text.write_text("the cat and the hat.\nThe end, the END!\n")
    best = wordcount.main([str(text), "--top", "2"])
    assert best == [("the", 4), ("end", 2)]


@pytest.mark.timeout(200)
def test_external_sort(tmp_path) -> None:
    out = run_script("tcp", 3, os.path.join(EX, "external_sort.py"),
                     ["--records", "20000", "--memory", "64KiB", "--spill-dir", str(tmp_path / "spill"),
                      "--out", str(tmp_path)])
    assert "globally ordered: True" in out and "sorted 60000 records" in out
    keys = []
    for task in range(3):
        with open(tmp_path / f"part-{task:05d}.txt") as f:
            keys.extend(int(line.split()[0]) for line in f)
    assert len(keys) == 60000 and keys == sorted(keys)
    assert not any(files for _, _, files in os.walk(tmp_path / "spill"))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("via", ["auto", "innet"])
def test_gradient_average(via: str) -> None:
    out = run_script("tcp", 3, os.path.join(EX, "gradient_average.py"),
                     ["--steps", "15", "--features", "20000", "--rows", "64", "--via", via])
    assert "replicas identical: True" in out
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert losses[-1] < losses[0] * 1e-3


@pytest.mark.timeout(200)
def test_topk_stream() -> None:
    topk_stream = example("topk_stream")
    world, events, k = 2, 4000, 5
    out = run_script("tcp", world, os.path.join(EX, "topk_stream.py"), ["--events", str(events), "--k", str(k)])
    m = re.search(r"final top \d+ after [0-9.]+ s: (\[.*\])", out)
    assert m, out
    got = [tuple(x) for x in eval(m.group(1))]
    c: collections.Counter = collections.Counter()
    for r in range(world):
        gen = topk_stream.events(r, 10_000)
        c.update(next(gen) for _ in range(events))
    expect = heapq.nlargest(k, c.items(), key=lambda kv: (kv[1], -kv[0]))
    assert got == expect
