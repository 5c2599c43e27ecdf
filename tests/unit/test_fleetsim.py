"""The fleet simulation (tests/support/fleetsim.py) at small sizes: one node alone fills near
its link's time, a fleet within twice that with the warm node serving little, and without
peers' pieces the files serve only what no one else holds."""

from __future__ import annotations

import pytest

from fleetsim import Fleet, simulate

GIB = 1 << 30
LINK = 100e9 / 8


def fleet(nodes: int, store: float = 4 * LINK) -> Fleet:
    return Fleet(nodes=nodes, link=LINK, store_rate=store, set_bytes=189 * GIB)


def test_one_node_fills_near_its_links_time() -> None:
    alone = simulate(fleet(1))
    wire = 189 * GIB / LINK
    assert wire <= alone.fleet_seconds < 1.5 * wire
    assert alone.served["peers"] == 0 and alone.served["files"] == 0


@pytest.mark.parametrize("nodes", [10, 100])
def test_a_fleet_fills_within_twice_one_nodes_time(nodes: int) -> None:
    one = simulate(fleet(1)).fleet_seconds
    many = simulate(fleet(nodes))
    assert len(many.ready) == nodes and min(many.ready) > 0
    assert many.fleet_seconds <= 2 * one
    moved = sum(many.served.values())
    assert many.served["warm"] < 0.5 * moved
    assert many.served["files"] == 0
    assert moved >= nodes * 189 * GIB


def test_without_a_store_the_peers_carry_it_and_the_files_stay_cold() -> None:
    got = simulate(fleet(10, store=0.0))
    assert got.served["store"] == 0 and got.served["files"] == 0
    assert got.fleet_seconds <= 2 * simulate(fleet(1, store=0.0)).fleet_seconds
