"""The in-memory ``SwitchControl`` of :mod:`tests.innet.fake_switch` keeps the contract: it implements every
protocol method and raises the contract's errors."""

from __future__ import annotations

import pytest

from innet.control import AlreadyExists, InvalidArgument, JobEntry, NotFound, SwitchControl
from tests.innet.fake_switch import FakeSwitch


def _protocol_methods() -> set[str]:
    return {name for name in vars(SwitchControl) if not name.startswith("_") and
            callable(getattr(SwitchControl, name))}


def test_fake_implements_every_protocol_method():
    fake = FakeSwitch()
    for name in _protocol_methods():
        assert callable(getattr(fake, name)), name
    assert fake.num_aggregators == 16 and fake.value_count == 4


def test_fake_follows_the_contract_errors():
    fake = FakeSwitch()
    fake.insert_job(JobEntry(1, 2, 3, 4))
    with pytest.raises(AlreadyExists):
        fake.insert_job(JobEntry(1, 2, 3, 4))
    with pytest.raises(NotFound):
        fake.modify_job(JobEntry(9, 2, 3, 4))
    with pytest.raises(NotFound):
        fake.delete_mcast_group(5)
    with pytest.raises(InvalidArgument):
        fake.read_aggregator(16)
