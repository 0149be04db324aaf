"""benchmarks/network.py's parts that need no cluster: the variants as data, what the plan is
told of each, the hidden part of the allreduce and the residuals, the table and the figures (no
Horovod job; the toolkit's reduction rule imports hvd_train.comm, hence TensorFlow)."""

import dataclasses

import pytest

from benchmarks import network
from hvd_train.bench import plan
from hvd_train.comm import reduction
from hvd_train.core import buckets

SIZES = [4000, 40, 8_000_000, 400, 12_000_000, 80]  # bytes per gradient, in variable order


def row(**changes) -> dict:
    """One model on one job, as a job reports it (before `analyse`)."""
    base = {
        "rate": "1gbit",
        "link": {"mb_per_s": 100.0, "latency_us": 40.0},
        "layout": "2x1",
        "model": "m",
        "stack": "modern",
        "gradient_MB": sum(SIZES) / 1e6,
        "gradient_tensors": len(SIZES),
        "gradient_bytes_per_tensor": SIZES,
        "forward_ms": 100.0,
        "backward_ms": 200.0,
        "ceiling_ms": 330.0,
        "allreduce_ms": 220.0,
        "variants": {
            "toolkit": {"step_ms": 450.0, "overrides": []},
            "keras3-per-tensor": {"step_ms": 500.0, "overrides": []},
        },
    }
    return {**base, **changes}


def result(rows: list[dict]) -> dict:
    variants = {
        n: dataclasses.asdict(network.VARIANTS[n]) for n in ("toolkit", "keras3-per-tensor")
    }
    return {"models": {"m": {}}, "layouts": ["2x1"], "variants": variants, "rows": rows}


def test_every_variant_runs_or_is_skipped_with_its_reason():
    runnable, skipped = network.available(list(network.VARIANTS))
    assert {v.name for v in runnable} | set(skipped) == set(network.VARIANTS)
    assert {v.name for v in runnable} >= {"toolkit", "keras3-per-tensor", "horovod-keras"}
    for name, reason in skipped.items():
        assert network.VARIANTS[name].overrides[0].partition("=")[0] in reason, reason
    assert network.VARIANTS["toolkit-two-level"].layouts == ("2x2",)  # one rank per host: flat
    for variant in network.VARIANTS.values():
        assert variant.stack in network.STACKS
        assert variant.kind in ("toolkit", "per_tensor", "horovod_keras", "mwms")


def test_a_variant_of_an_unknown_knob_or_value_is_skipped_naming_it(monkeypatch):
    monkeypatch.setitem(
        network.VARIANTS,
        "bad-key",
        network.Variant("bad-key", "modern", "toolkit", ("optimizer.nope=1",)),
    )
    monkeypatch.setitem(
        network.VARIANTS,
        "bad-value",
        network.Variant("bad-value", "modern", "toolkit", ("optimizer.compression=zip",)),
    )
    runnable, skipped = network.available(["toolkit", "bad-key", "bad-value"])
    assert [v.name for v in runnable] == ["toolkit"]
    assert "optimizer.nope" in skipped["bad-key"]
    assert "optimizer.compression" in skipped["bad-value"]


def test_plan_inputs_of_the_toolkit_are_its_own_bucket_layout():
    toolkit = network.VARIANTS["toolkit"]  # the default: one bucket, the hosts' core is busy
    default = network.plan_inputs(row(), toolkit)
    assert default["buffers"] == 1 and default["last_bytes"] is None
    bucketed = network.Variant("b8", "modern", "toolkit", ("optimizer.bucket_mb=8",))
    inputs = network.plan_inputs(row(), bucketed)
    layout = buckets.layout(SIZES, buckets.bucket_bytes(sum(SIZES), 2, 8))
    assert inputs["buffers"] == len(layout) > 1
    assert inputs["last_bytes"] == sum(SIZES[i] for i in layout[-1])
    assert inputs["wire_bytes"] == sum(SIZES) and inputs["reduction"] == "flat"
    one = network.plan_inputs(row(), network.VARIANTS["toolkit-one-group"])
    assert one["buffers"] == 1 and one["last_bytes"] is None  # nothing overlaps
    fp16 = network.plan_inputs(row(), network.VARIANTS["toolkit-fp16"])
    assert fp16["wire_bytes"] == sum(SIZES) / 2 and fp16["last_bytes"] is None
    # 2 hosts x 2 slots: the default follows the toolkit's rule; two-level where asked.
    rule = reduction.reduction_rule("auto", [2, 2], elastic=False, dynamic_process_sets=True)
    at_2x2 = network.plan_inputs(row(layout="2x2"), toolkit)
    assert at_2x2["reduction"] == rule
    # Two ranks on each host's one CPU: the smallest buckets.
    small = buckets.layout(SIZES, buckets.MIN_BUCKET_BYTES)
    assert at_2x2["buffers"] == len(small) > 1
    two = network.plan_inputs(row(layout="2x2"), network.VARIANTS["toolkit-two-level"])
    assert two["reduction"] == "two_level"
    # Under Gloo one rank per host's CPU also takes the smallest buckets; under MPI one bucket.
    under_gloo = network.plan_inputs(row(controller="gloo"), toolkit)
    assert under_gloo["buffers"] == len(small) > 1
    assert network.plan_inputs(row(controller="mpi"), toolkit)["buffers"] == 1
    # Where the ranks were told the link's rate the default follows it: at 9.56 Gbit/s one
    # bucket under Gloo, the smallest under MPI, with the two large tensors alone, before the
    # small ones' bucket, which holds the first layer's gradient: only it waits for the
    # backward pass. Rows without the rate keep the slow link's choice.
    fast = {"ranks_link_gbit": 9.56}
    assert network.plan_inputs(row(controller="gloo") | fast, toolkit)["buffers"] == 1
    smalls = [5, 3, 1, 0]
    assert buckets.layout(SIZES, buckets.MIB, buckets.MIB) == [[4], [2], smalls]
    alone = network.plan_inputs(row(controller="mpi") | fast, toolkit)
    assert alone["buffers"] == 3 and alone["last_bytes"] == sum(SIZES[i] for i in smalls)
    none_alone = network.VARIANTS["toolkit-none-alone"]
    shared = network.plan_inputs(row(controller="mpi") | fast, none_alone)
    assert shared["buffers"] == len(small) and shared["last_bytes"] == SIZES[1] + SIZES[0]


def test_plan_inputs_of_per_tensor_allreduce_end_with_the_first_layer():
    inputs = network.plan_inputs(row(), network.VARIANTS["keras3-per-tensor"])
    assert inputs == {
        "wire_bytes": sum(SIZES),
        "buffers": 1,
        "last_bytes": SIZES[0],
        "reduction": "flat",
        "spare_cpu": False,
    }


def test_plan_inputs_of_mwms_reduce_after_the_backward_pass():
    inputs = network.plan_inputs(row(), network.VARIANTS["mwms"])
    assert inputs == {
        "wire_bytes": sum(SIZES),
        "buffers": 1,
        "last_bytes": None,
        "reduction": "flat",
        "spare_cpu": False,
    }


def test_mwms_workers_follow_open_mpi_by_slot_placement():
    port = network.MWMS_PORT
    assert network.mwms_workers("h1:1,h2:1") == [f"h1:{port}", f"h2:{port}"]
    assert network.mwms_workers("h1:2,h2:2") == [
        f"h1:{port}",
        f"h1:{port + 1}",
        f"h2:{port}",
        f"h2:{port + 1}",
    ]


def test_analyse_hidden_fraction_and_residual_closed_forms():
    out = network.analyse(result([row()]))
    v = out["rows"][0]["variants"]["toolkit"]
    assert v["hidden"] == pytest.approx((330 + 220 - 450) / 220)
    assert v["efficiency"] == pytest.approx(330 / 450)
    inputs = network.plan_inputs(row(), network.VARIANTS["toolkit"])
    expected = plan.cluster_step(
        plan.Compute(0.1, 0.2, 0.33),
        plan.Link(100.0, 40.0),
        inputs["wire_bytes"],
        2,
        1,
        buffers=inputs["buffers"],
        last_bytes=inputs["last_bytes"],
        spare_cpu=inputs["spare_cpu"],
    )
    assert v["predicted_step_ms"] == pytest.approx(1e3 * expected["step"])
    assert v["residual"] == pytest.approx(450 / v["predicted_step_ms"] - 1)
    assert out["residuals"]["points"] == 2
    # Negative control: a step that hides nothing has hidden 0, one that hides all has 1.
    none = network.analyse(result([row(variants={"toolkit": {"step_ms": 550.0, "overrides": []}})]))
    all_ = network.analyse(result([row(variants={"toolkit": {"step_ms": 330.0, "overrides": []}})]))
    assert none["rows"][0]["variants"]["toolkit"]["hidden"] == pytest.approx(0.0)
    assert all_["rows"][0]["variants"]["toolkit"]["hidden"] == pytest.approx(1.0)


def test_2x2_layout_is_told_two_slots():
    one = network.analyse(result([row()]))["rows"][0]["variants"]["keras3-per-tensor"]
    two = network.analyse(result([row(layout="2x2")]))["rows"][0]["variants"]["keras3-per-tensor"]
    assert two["predicted_comm_ms"] > one["predicted_comm_ms"] * 1.4  # a flat ring: 1.5 S, not S


def test_plot_writes_the_three_figures(tmp_path):
    ten = {"rate": "10gbit", "link": {"mb_per_s": 1000.0, "latency_us": 30.0}}
    rows = [row(), row(**ten), row(controller="gloo"), row(controller="gloo", **ten)]
    pngs = network.plot(network.analyse(result(rows)), tmp_path, "n")
    assert [p.name for p in pngs] == ["n.png", "n-hidden.png", "n-predicted.png"]
    assert all(p.stat().st_size > 10_000 for p in pngs)


def test_rows_of_each_controller_are_their_own_lines():
    rows = [row(), row(controller="mpi"), row(controller="gloo"), row(stack="classic")]
    jobs = network._rows_by_job(rows)
    assert {label: len(rs) for label, rs in jobs.items()} == {
        "modern": 2,  # a row without a controller ran before the choice: under MPI
        "modern, gloo": 1,
        "classic": 1,
    }


def test_table_has_one_line_per_job_model_and_variant():
    rows = [row(), row(layout="2x2"), row(controller="gloo")]
    lines = network.table(network.analyse(result(rows))).splitlines()
    assert len(lines) == 2 + 3 * 2
    assert lines[2].startswith("| 1gbit (100) | 2x1 | mpi | m (20.0) | toolkit | 450 | 330 | 220 |")
    assert lines[6].startswith("| 1gbit (100) | 2x1 | gloo | m (20.0) | toolkit | 450 |")
