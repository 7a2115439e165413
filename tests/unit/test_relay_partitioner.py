"""The relay's cached partitioner picks the partition Kafka's default partitioner picks."""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given
from hypothesis import strategies as st

from ledgerbox.relay._publisher import partition_for


@given(key=st.binary(max_size=64), count=st.integers(min_value=1, max_value=64))
def test_same_partition_as_the_default_partitioner(key: bytes, count: int) -> None:
    partitions = list(range(count))
    expected = DefaultPartitioner()(key, partitions, partitions)
    assert partition_for(key, partitions) == expected
    assert partition_for(key, partitions) == expected  # cached: same answer
