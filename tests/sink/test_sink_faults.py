"""The fault plan's grammar: which requests of a kind a fault fires on."""

from __future__ import annotations

import pytest

from wbmerge.sink.faults import parse_fault


@pytest.mark.parametrize(
    "spec, fires_on",
    [
        ("graphql:UpsertBucket=500", [1, 2, 3, 4, 5]),
        ("graphql:UpsertBucket=500@2", [2]),
        ("graphql:UpsertBucket=500@2,4", [2, 4]),
        ("graphql:UpsertBucket=500@2+", [2, 3, 4, 5]),
        ("graphql:UpsertBucket=500@2+x2", [2, 3]),
        ("graphql:UpsertBucket=500x3", [1, 2, 3]),
    ],
)
def test_a_fault_fires_on_the_requests_its_spec_names(spec, fires_on):
    fault = parse_fault(spec)
    fired = []
    for count in range(1, 6):
        if fault.matches("graphql:UpsertBucket", count):
            fault.fired += 1
            fired.append(count)
    assert fired == fires_on
    assert not parse_fault(spec).matches("graphql:CreateRunFiles", fires_on[0])
