"""benchmarks/scaleout_model.py: HAProxy's bounded-load arithmetic as lb_chash.c computes it, and a run."""

from __future__ import annotations

import json

from benchmarks.scaleout_model import eligible_slots, main


def test_the_bound_shares_the_rounded_up_total_by_place_in_the_file() -> None:
    # 7 open calls and the new one at 250%: ceil(8 x 2.5) = 20 slots over 3 replicas, the remainder of 2 going
    # to the second and third.
    assert [eligible_slots(7, 250, server, 3) for server in range(3)] == [6, 7, 7]
    # Never 0: one call may always go to its own replica.
    assert eligible_slots(0, 100, 0, 3) == 1


def test_a_factor_of_300_binds_from_four_replicas_on() -> None:
    """What the shipped factor's comment says: with three replicas no replica is ever refused a call, since it
    can hold at most every open call; with four the bound refuses a replica holding all of them."""
    assert all(eligible_slots(open_calls, 300, s, 3) > open_calls for open_calls in range(200) for s in range(3))
    assert any(eligible_slots(open_calls, 300, s, 4) <= open_calls for open_calls in range(1, 20) for s in range(4))


def test_the_model_prints_a_figure_per_policy(capsys) -> None:
    assert main(["--rings", "2", "--requests", "40", "--adapters", "6", "--factors", "200"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["policy"] for row in rows][:2] == ["bound alone, factor 200", "hot rule + factor 275"]
    for row in rows:
        assert 0.0 <= row["both_targets_met"] <= 1.0
        assert 1.0 <= row["loads_over_ideal"]["median"] <= 3.0
        assert 1.0 <= row["max_replica_share_over_mean"]["median"] <= 3.0
