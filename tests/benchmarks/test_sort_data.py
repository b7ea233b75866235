"""The sort suite's input, range partitioner and verification: a wrong sort must be caught."""

import pytest

from benchmarks import _sort_data as sd


def test_shares_cover_the_input_once():
    total = 1003
    spans = [sd.share(r, 4, total) for r in range(4)]
    assert sum(c for _, c in spans) == total
    assert [s for s, _ in spans] == [0, 251, 502, 753]
    recs = [r for w in range(4) for r in sd.generate(w, 4, total)]
    assert len(recs) == total and len({v for _, v in recs}) == total          # values carry the index
    assert all(len(k) == sd.KEY_BYTES and len(v) == sd.VALUE_BYTES for k, v in recs)
    assert sd.generate(1, 4, total) == sd.generate(1, 4, total)                # deterministic


def test_range_partitioner_is_ordered_and_balanced():
    dests = [3, 5, 9]
    recs = [r for w in range(2) for r in sd.generate(w, 2, 30000)]
    by = {d: [] for d in dests}
    for k, _v in recs:
        by[sd.range_destination(k, dests)].append(k)
    assert all(abs(len(v) - 10000) < 600 for v in by.values())
    assert max(by[3]) < min(by[5]) and max(by[5]) < min(by[9])


def _sorted_parts(world, total, dests=2):
    recs = sorted(r for w in range(world) for r in sd.generate(w, world, total))
    cut = len(recs) // dests
    return [recs[:cut], recs[cut:]]


def test_verify_accepts_a_correct_sort_and_text_summaries_agree():
    want = sd.expected(2, 5000)
    parts = _sorted_parts(2, 5000)
    sd.verify([sd.summarize(p) for p in parts], want)
    sd.verify([sd.summarize([sd.to_text(r) for r in p], text=True) for p in parts], want)


@pytest.mark.parametrize("damage", ["lose", "duplicate", "change", "unsorted", "overlap"])
def test_verify_rejects_a_wrong_sort(damage):
    want = sd.expected(2, 5000)
    a, b = _sorted_parts(2, 5000)
    if damage == "lose":
        b = b[:-1]
    elif damage == "duplicate":
        b = b + [b[-1]]
        a = a[1:]                        # same count, different records
    elif damage == "change":
        k, v = b[7]
        b[7] = (k, v[:-1] + b"!")
    elif damage == "unsorted":
        a[3], a[4] = a[4], a[3]
    else:
        b.insert(0, a.pop(0))            # both sorted, but b starts below a's end
    with pytest.raises(ValueError):
        sd.verify([sd.summarize(a), sd.summarize(b)], want)


def test_arrow_share_holds_the_same_records():
    table = sd.generate_table(1, 3, 1000)
    recs = sd.generate(1, 3, 1000)
    assert table.column("key").to_pylist() == [k for k, _ in recs]
    assert table.column("value").to_pylist() == [v for _, v in recs]


@pytest.mark.parametrize("damage", [None, "unsorted", "unsorted across batches", "change"])
def test_batch_summary_is_summarize_of_the_batches(damage):
    import pyarrow as pa   # a dev dependency (the arrow extra): no skip
    recs = sorted(r for w in range(2) for r in sd.generate(w, 2, 3000))
    recs.insert(5, (recs[4][0][:-1] + b"\x00", recs[4][1]))         # a key ending in a zero byte
    recs.sort()
    if damage == "unsorted":
        recs[10], recs[11] = recs[11], recs[10]
    elif damage == "unsorted across batches":
        recs[100], recs[101] = recs[101], recs[100]     # batches of 100 from recs[1]: across a boundary
    elif damage == "change":
        recs[7] = (recs[7][0], recs[7][1][:-1] + b"!")
    table = pa.table({"key": pa.array([k for k, _ in recs], pa.binary(sd.KEY_BYTES)),
                      "value": pa.array([v for _, v in recs], pa.binary(sd.VALUE_BYTES))})
    summary = sd.BatchSummary()
    for batch in table.slice(1).to_batches(max_chunksize=100):   # an offset into the buffers too
        summary.add(batch)
    assert summary.result() == sd.summarize(recs[1:])
    assert summary.result()["sorted"] is (damage in (None, "change"))
