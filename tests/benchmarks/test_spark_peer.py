"""The PySpark peer (benchmarks/_spark_peer.py) on tiny inputs, when pyspark and java are here: each kind
answers right (checked the way its suite checks it) and reports its JVM start-up apart from its timed
seconds. Without pyspark or java the suites skip the peer with the reason (checked without a JVM)."""

import importlib.util
import os

import pytest

from benchmarks import _sort_data as sd
from benchmarks import _spark_peer, common
from benchmarks import groupby as gb_suite
from benchmarks import wordcount as wc_suite

SPARK_MISSING = common.spark_missing()
needs_spark = pytest.mark.skipif(SPARK_MISSING is not None, reason=f"PySpark peer not runnable: {SPARK_MISSING}")


def _timings_apart(d: dict) -> None:
    assert d["startup_s"] > 0 and d["load_s"] > 0 and d["seconds"] > 0
    assert d["workers"] == 2 and d["spark"]


@pytest.mark.slow                      # a JVM per kind: minutes on a loaded 2-core machine
@pytest.mark.timeout(900)
@needs_spark
def test_spark_sort_tiny_is_verified():
    total = 3000
    d = _spark_peer.run("sort", 2, total)
    assert d["n"] == total and len(d["parts"]) == 2
    sd.verify(d["parts"], sd.expected(2, total))       # all records, each part sorted, parts in order
    _timings_apart(d)


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_spark
def test_spark_wordcount_tiny_matches_counter():
    words = 20_000
    d = _spark_peer.run("wordcount", 2, words)
    _, ref = wc_suite.run_counter(words, 2)
    assert d["words"] == words and wc_suite.digest(d["counts"]) == ref
    _timings_apart(d)


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_spark
def test_spark_groupby_tiny_is_verified(tmp_path):
    table = gb_suite.whole_table(20_000, 500, 2)
    ref = gb_suite.reference(table)
    gb_suite.SPARK_STARTUP.clear()
    seconds = gb_suite.run_spark(gb_suite.spark_input(table, str(tmp_path)), ref, 2)   # raises if wrong
    assert seconds > 0 and len(gb_suite.SPARK_STARTUP) == 1 and gb_suite.SPARK_STARTUP[0] > 0


def test_groupby_without_java_skips_pyspark_with_the_reason(monkeypatch):
    monkeypatch.setattr(common, "spark_missing", lambda: "no java on PATH (PySpark needs Java 17)")
    times, skipped = gb_suite.measure(20_000, 500, 2, 1, dask=False)
    assert "twisternet" in times
    if importlib.util.find_spec("polars") is not None:      # polars is in the bench extra, not in dev
        assert "polars (1 process)" in times
    assert not any(n.startswith("pyspark") for n in times)
    assert "pyspark local[2]: no java on PATH (PySpark needs Java 17)" in skipped


def test_spark_missing_says_no_java_without_java_on_path(monkeypatch, tmp_path):
    # Whether or not pyspark is installed here: make it look installed, so the Java check is reached.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "pyspark" else real_find_spec(name, *a))
    monkeypatch.setenv("PATH", str(tmp_path))          # an empty directory: no java
    monkeypatch.delenv("JAVA_HOME", raising=False)
    assert common.spark_missing() == "no java on PATH (PySpark needs Java 17)"


def test_spark_missing_says_how_to_install_without_pyspark(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pyspark" else real_find_spec(name, *a))
    assert common.spark_missing() == "pyspark is not installed (pip install pyspark; needs Java 17)"


def test_groupby_spark_wrong_answer_fails(monkeypatch, tmp_path):
    """A PySpark answer that differs from pyarrow's is an error of the suite, not a timing."""
    import pyarrow as pa
    table = gb_suite.whole_table(2_000, 50, 2)
    ref = gb_suite.reference(table)

    def fake_run(kind, workers, parquet, out):
        wrong = ref.select(["k", "v_sum"]).set_column(1, "v_sum", pa.array(ref.column("v_sum").to_numpy() + 1))
        with pa.OSFile(out, "wb") as f, pa.ipc.new_file(f, wrong.schema) as w:
            w.write_table(wrong)
        return {"seconds": 0.1, "startup_s": 1.0}

    monkeypatch.setattr(_spark_peer, "run", fake_run)
    with pytest.raises(RuntimeError, match="pyspark: wrong sums"):
        gb_suite.run_spark(os.fspath(tmp_path / "unused.parquet"), ref, 2)
