"""Trace format: exact parsing, clear errors naming the line, hypothesis round trips, generator output."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twisternet.coflow import (MB, PortCapacities, Trace, TraceCoflow, TraceFormatError,
                               effective_bottleneck, format_trace, generate_trace, parse_trace,
                               read_trace, write_trace)

SAMPLE = """\
4 2

1 0 2 0 3 1 2:4.0   
2 1500 1 1 2 0:1.5 3:0
"""


def test_parse_sample_exactly() -> None:
    tr = parse_trace(SAMPLE)
    assert tr.num_ports == 4 and len(tr.coflows) == 2
    c1 = tr.coflows[0]
    assert (c1.id, c1.arrival_ms, c1.mappers, c1.reducers) == (1, 0.0, (0, 3), ((2, 4.0),))
    flows = c1.to_coflow()
    # Reducer 2 receives 4 MB spread equally over 2 mappers: two flows of 2 MB each.
    assert sorted(zip(flows.src.tolist(), flows.dst.tolist(), flows.size.tolist())) == [
        (0, 2, 2 * MB), (3, 2, 2 * MB)]
    c2 = tr.coflows[1].to_coflow()
    assert c2.arrival == pytest.approx(1.5)
    # The zero-MB reducer carries no flow.
    assert list(zip(c2.src.tolist(), c2.dst.tolist(), c2.size.tolist())) == [(1, 0, 1.5 * MB)]


def test_deadlines_from_isolated_cct() -> None:
    tr = parse_trace(SAMPLE)
    caps = PortCapacities.uniform(4, MB)  # 1 MB/s ports
    cfs = tr.to_coflows(caps, deadline_slack=3.0)
    # Coflow 1: egress 2 receives 4 MB at 1 MB/s -> isolated CCT 4 s -> deadline 12 s.
    assert cfs[0].deadline == pytest.approx(12.0)
    assert cfs[1].deadline == pytest.approx(3 * 1.5)


@pytest.mark.parametrize("text, line, msg", [
    ("", 1, "missing header"),
    ("4\n", 1, "header"),
    ("4 1\n1 0 2 0 2:4 1 3:1\n", 2, "mapper port must be an integer"),  # 2 mappers, lists 1
    ("4 1\n1 0 1 0 1 2:x\n", 2, "reducer MB"),
    ("4 1\n1 0 1 9 1 2:1\n", 2, "mapper port 9 outside"),
    ("4 1\n1 0 1 0 1 2-1\n", 2, "port:MB"),
    ("4 1\n1 0 1 0 2 2:1\n", 2, "expected 2 reducer"),
    ("4 2\n1 0 1 0 1 2:1\n\n1 5 1 0 1 2:1\n", 4, "duplicate coflow id 1"),
    ("4 2\n1 0 1 0 1 2:1\n", 2, "announces 2"),
    ("4 1\n1 0 1 0 1 2:1\n2 0 1 0 1 2:1\n", 3, "more coflow lines"),
    ("4 1\n1 -5 1 0 1 2:1\n", 2, "arrival"),
    ("4 1\nx 0 1 0 1 2:1\n", 2, "coflow id"),
])
def test_malformed_input_names_the_line(text: str, line: int, msg: str) -> None:
    with pytest.raises(TraceFormatError, match=msg) as exc:
        parse_trace(text, source="t.txt")
    assert exc.value.line_no == line
    assert str(exc.value).startswith(f"t.txt:{line}:")


@st.composite
def traces(draw):
    ports = draw(st.integers(1, 12))
    n = draw(st.integers(0, 6))
    ids = draw(st.lists(st.integers(0, 10 ** 6), min_size=n, max_size=n, unique=True))
    cfs = []
    for cid in ids:
        arrival = draw(st.one_of(st.integers(0, 10 ** 7).map(float),
                                 st.floats(0, 1e7, allow_nan=False, allow_infinity=False)))
        mappers = tuple(draw(st.lists(st.integers(0, ports - 1), min_size=1, max_size=5)))
        reducers = tuple(draw(st.lists(
            st.tuples(st.integers(0, ports - 1),
                      st.floats(0, 1e6, allow_nan=False, allow_infinity=False)),
            min_size=1, max_size=5)))
        cfs.append(TraceCoflow(cid, arrival, mappers, reducers))
    return Trace(ports, cfs)


@settings(max_examples=150, deadline=None)
@given(traces())
def test_format_parse_round_trip(tr: Trace) -> None:
    text = format_trace(tr)
    back = parse_trace(text)
    assert back == tr
    assert format_trace(back) == text
    # Whitespace tolerance: blank lines and trailing blanks change nothing.
    noisy = "\n\n" + "\n".join(line + "  \t" for line in text.splitlines()) + "\n\n"
    assert parse_trace(noisy) == tr


def test_generator_round_trip_and_mix(tmp_path) -> None:
    tr = generate_trace(num_ports=40, num_coflows=300, seed=7)
    path = tmp_path / "gen.txt"
    write_trace(tr, path)
    back = read_trace(path)
    assert back == tr
    assert generate_trace(num_ports=40, num_coflows=300, seed=7) == tr  # seeded
    assert generate_trace(num_ports=40, num_coflows=300, seed=8) != tr
    arrivals = [c.arrival_ms for c in tr.coflows]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 and arrivals[-1] <= 3600 * 1000
    widths = sorted(c.num_flows for c in tr.coflows)
    sizes = sorted(c.total_mb for c in tr.coflows)
    for c in tr.coflows:
        assert 1 <= len(c.mappers) <= 40 and 1 <= len(c.reducers) <= 40
        assert len(set(c.mappers)) == len(c.mappers)
    # Most coflows are narrow (<= 50 flows); some are wide.
    narrow = sum(w <= 50 for w in widths) / len(widths)
    assert 0.55 < narrow < 0.85 and widths[-1] > 200
    # Heavy tail: the largest 10% of coflows carry most of the bytes, the median is small.
    top = sum(sizes[int(0.9 * len(sizes)):]) / sum(sizes)
    assert top > 0.5 and sizes[len(sizes) // 2] < 0.01 * sizes[-1]
    # Every generated coflow is a valid simulator input.
    caps = tr.capacities(MB)
    for c in back.to_coflows(caps):
        assert effective_bottleneck(c, caps.ingress, caps.egress) > 0
