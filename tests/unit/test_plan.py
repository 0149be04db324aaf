"""The cost model's closed forms (pure Python)."""

import pytest

from hvd_train.bench import plan
from hvd_train.bench.stats import bandwidth, summary

HW = plan.Hardware("t", 4, 8.0, 0.0, 100.0, False, cycle_ms=0.0, fusion_mb=1e9)
WL = plan.Workload("w", params_millions=250.0, images_per_second=100.0, per_worker_batch=50)


def test_one_worker_has_no_communication():
    row = plan.step_time(HW, WL, 1)
    assert row["comm"] == 0.0 and row["efficiency"] == 1.0 and row["step"] == pytest.approx(0.5)


def test_flat_ring_transfer_is_two_n_minus_one_over_n_of_the_gradient_over_the_link():
    row = plan.step_time(HW, WL, 8)  # 2 nodes: the 1 GB/s network link sets the pace
    assert row["transfer"] == pytest.approx(2 * 7 / 8 * 1e9 / 1e9)
    assert row["efficiency"] == pytest.approx(0.5 / (0.5 + 1.75))
    hidden = plan.step_time(HW, WL, 8, overlap=1.0)  # backward (1/3 s) hides part of it
    assert hidden["step"] == pytest.approx(0.5 + 1.75 - 1 / 3)


def test_hierarchical_sends_one_node_share_over_the_network():
    hw = plan.Hardware("h", 4, 8.0, 0.0, 100.0, True, cycle_ms=0.0, fusion_mb=1e9)
    row = plan.step_time(hw, WL, 8)
    assert row["transfer"] == pytest.approx(2 * 3 / 4 * 1e9 / 100e9 + 2 * 1 / 2 * 0.25e9 / 1e9)


def test_latency_counts_hops_and_cycles_per_fused_buffer():
    hw = plan.Hardware("l", 1, 8.0, 10.0, 100.0, False, cycle_ms=2.0, fusion_mb=400.0)
    row = plan.step_time(hw, WL, 4)  # 1 GB of gradients in 3 buffers of <= 400 MB
    assert row["latency"] == pytest.approx(3 * (2 * 3 * 10e-6 + 2e-3))


def test_every_published_figure_is_compared():
    rows = plan.compare_published()
    assert len(rows) == len(plan.PUBLISHED)
    for row in rows:
        assert 0 < row["model_no_overlap"] <= row["model_full_overlap"] <= 1


def test_bandwidth_definitions():
    assert bandwidth(int(1e9), 1.0, 2) == (1.0, 1.0)
    assert bandwidth(int(1e9), 0.5, 4) == (2.0, 3.0)
    stats = summary([1.0, 2.0, 3.0])
    assert stats["median"] == 2.0 and stats["ci95"] == pytest.approx(1.96)
