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


# --- the cluster model: only what selftest measures and compute measured alone -------------------

COMPUTE = plan.Compute(forward_s=0.1, backward_s=0.2, step_s=0.35)  # update + framework: 50 ms
LINK = plan.Link(mb_per_s=100.0, latency_us=50.0)


def test_cross_host_bytes_flat_ring_and_two_level():
    assert plan.cross_host_bytes(1e8, 2, 1) == pytest.approx(1e8)  # 2(n-1)/n at n = 2
    assert plan.cross_host_bytes(1e8, 2, 2) == pytest.approx(1.5e8)  # n = 4: 1.5 S per host
    assert plan.cross_host_bytes(1e8, 2, 2, "two_level") == pytest.approx(1e8)  # m = 2 hosts
    assert plan.cross_host_bytes(1e8, 1, 4) == 0.0  # one host: nothing crosses a link
    with pytest.raises(ValueError, match="reduction"):
        plan.cross_host_bytes(1e8, 2, 2, "tree")


def test_cluster_step_without_overlap_adds_the_whole_allreduce():
    row = plan.cluster_step(COMPUTE, LINK, 1e8, 2, 1, cycle_ms=1.0)
    assert row["transfer"] == pytest.approx(1.0)  # 1e8 bytes at 100 MB/s
    assert row["latency"] == pytest.approx(2 * 50e-6 + 1e-3)  # 2(n-1) hops and one cycle
    assert row["step"] == pytest.approx(0.35 + row["comm"])
    assert row["hidden"] == pytest.approx(0.0) and row["last"] == row["comm"]
    assert row["efficiency"] == pytest.approx(0.35 / row["step"])


def test_cluster_step_with_overlap_is_bound_by_the_link_or_by_the_last_bucket():
    # A slow link: the link is busy from the end of the forward pass to the end of the step.
    slow = plan.cluster_step(COMPUTE, LINK, 1e8, 2, 1, buffers=4, last_bytes=2.5e7, cycle_ms=0)
    assert slow["step"] == pytest.approx(0.1 + slow["comm"] + 0.05)
    assert slow["hidden"] == pytest.approx((0.35 + slow["comm"] - slow["step"]) / slow["comm"])
    # A fast link: only the last bucket's allreduce shows after the compute.
    fast = plan.cluster_step(
        COMPUTE, plan.Link(1e4, 0.0), 1e8, 2, 1, buffers=4, last_bytes=2.5e7, cycle_ms=0
    )
    assert fast["last"] == pytest.approx(2.5e7 / 1e10)
    assert fast["step"] == pytest.approx(0.35 + fast["last"])
    # Negative control: without overlap the same job is slower by what the overlap hid.
    flat = plan.cluster_step(COMPUTE, LINK, 1e8, 2, 1, buffers=4, cycle_ms=0)
    assert flat["step"] - slow["step"] == pytest.approx(0.35 - 0.1 - 0.05)


def test_cluster_step_without_a_spare_core_hides_nothing_whatever_the_buckets():
    busy = plan.cluster_step(
        COMPUTE, LINK, 1e8, 2, 1, buffers=4, last_bytes=2.5e7, cycle_ms=0, spare_cpu=False
    )
    serial = plan.cluster_step(COMPUTE, LINK, 1e8, 2, 1, buffers=4, cycle_ms=0)
    assert busy == serial
    assert busy["step"] == pytest.approx(0.35 + busy["comm"]) and busy["hidden"] == 0.0
    # Negative control: the same buckets with a core spare hide part of the allreduce.
    spare = plan.cluster_step(COMPUTE, LINK, 1e8, 2, 1, buffers=4, last_bytes=2.5e7, cycle_ms=0)
    assert spare["step"] == pytest.approx(busy["step"] - 0.2) and spare["hidden"] > 0.1


def test_cluster_step_two_level_sends_less_across_at_two_slots():
    flat = plan.cluster_step(COMPUTE, LINK, 1e8, 2, 2, cycle_ms=0)
    two = plan.cluster_step(COMPUTE, LINK, 1e8, 2, 2, reduction="two_level", cycle_ms=0)
    assert flat["transfer"] == pytest.approx(1.5) and two["transfer"] == pytest.approx(1.0)
    assert two["latency"] < flat["latency"]  # 2 hops across the hosts' leaders instead of 6


def test_cluster_step_moves_the_gradients_at_the_lower_of_link_and_allreduce_rate():
    # The selftest's allreduce moved 50 MB/s across each host's link of 100 MB/s: the hosts' CPUs
    # hold the gradients to 50.
    held = plan.cluster_step(COMPUTE, plan.Link(100.0, 50.0, 50.0), 1e8, 2, 1, cycle_ms=0)
    assert held["transfer"] == pytest.approx(2.0)
    # An allreduce faster than the link (its measurement's noise) never raises the rate.
    fast = plan.cluster_step(COMPUTE, plan.Link(100.0, 50.0, 400.0), 1e8, 2, 1, cycle_ms=0)
    assert fast["transfer"] == pytest.approx(1.0)
    assert plan.cluster_step(COMPUTE, LINK, 1e8, 2, 1, cycle_ms=0)["transfer"] == pytest.approx(1.0)


def test_cluster_step_refuses_what_it_cannot_model():
    with pytest.raises(ValueError, match="link rate"):
        plan.cluster_step(COMPUTE, plan.Link(0.0, 1.0), 1e8, 2, 1)
    with pytest.raises(ValueError, match="link rate"):
        plan.cluster_step(COMPUTE, plan.Link(100.0, 1.0, 0.0), 1e8, 2, 1)
    with pytest.raises(ValueError, match="buffer"):
        plan.cluster_step(COMPUTE, LINK, 1e8, 2, 1, buffers=0)


# The published rows lie inside the plan's band (no overlap .. full overlap of the backward pass),
# VGG-16's within BAND_POINTS above it (docs/network.md).
BAND_POINTS = 0.025


def test_published_rows_lie_inside_the_band():
    for row in plan.compare_published():
        low, high = row["model_no_overlap"], row["model_full_overlap"]
        assert low - BAND_POINTS <= row["efficiency"] <= high + BAND_POINTS, row
    # Negative control: a band narrowed to its midpoint leaves some published rows outside.
    outside = [
        row
        for row in plan.compare_published()
        if abs(row["model_midpoint"] - row["efficiency"]) > BAND_POINTS
    ]
    assert outside
