"""A cost model of data-parallel training: predicted throughput and scaling efficiency at scale.

Per step, each worker computes (forward + backward of its batch), then the gradients are averaged
by ring allreduce, in fused buffers of at most `fusion_mb`:

    t_compute   = per_worker_batch / images_per_second_per_worker
    t_transfer  = 2(n-1)/n * gradient_bytes / link_bandwidth                  (flat ring)
                = 2(g-1)/g * B / intra_bw + 2(m-1)/m * (B/g) / inter_bw        (hierarchical:
                  g workers per node reduce-scatter inside the node, m nodes run the ring on 1/g)
    t_latency   = buffers * (2(n-1) * link_latency + cycle_time)              (or 2(m-1) hops)
    t_comm      = t_transfer + t_latency
    step        = t_compute + t_comm                                (no overlap: a lower bound)
    step        = t_compute + max(0, t_comm - overlap * t_backward)  (backward = 2/3 of compute:
                  gradients of late layers are reduced while early layers still compute)
    efficiency  = t_compute / step;  throughput = n * per_worker_batch / step

Every input is a published parameter (link speeds, GPU throughput of the model from public
benchmark tables, parameter counts from the papers) or one measured on this machine; nothing is
fitted to the published scaling results the README compares with.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Hardware:
    """A cluster profile from published parameters."""

    name: str
    workers_per_node: int
    inter_gbit: float  # per-node network link, Gbit/s
    inter_latency_us: float  # one message hop across the network
    intra_gbyte: float  # worker-to-worker inside a node, GB/s
    hierarchical: bool  # Horovod's hierarchical allreduce (NCCL inside, ring across nodes)
    cycle_ms: float = 1.0  # Horovod's negotiation cycle per fused buffer
    fusion_mb: float = 64.0  # Horovod's default fusion threshold
    source: str = ""


@dataclass(frozen=True)
class Workload:
    """A model at a per-worker batch on one worker of a profile."""

    name: str
    params_millions: float
    images_per_second: float  # one worker alone, synthetic data
    per_worker_batch: int
    source: str = ""


HARDWARE = {
    "p100-25gbe-roce": Hardware(
        "p100-25gbe-roce",
        4,
        25.0,
        10.0,
        10.0,
        False,
        cycle_ms=5.0,
        source="Horovod's 512-GPU benchmark: 128 servers x 4 Pascal GPUs, RoCE 25 Gbit/s; PCIe "
        "gen3 x16 inside (about 10 GB/s usable); 5 ms was Horovod's default cycle then",
    ),
    "p100-nvlink-50gbe": Hardware(
        "p100-nvlink-50gbe",
        8,
        50.0,
        10.0,
        80.0,
        True,
        cycle_ms=5.0,
        source="Goyal et al. 2017: Big Basin servers, 8 P100 with NVLink (about 80 GB/s "
        "effective per GPU), 50 Gbit/s Ethernet, hierarchical reduction",
    ),
    "v100-nvlink-100gb-ib": Hardware(
        "v100-nvlink-100gb-ib",
        8,
        100.0,
        2.0,
        130.0,
        True,
        source="DGX-1V class: 8 V100 with NVLink 2 (about 130 GB/s effective), one 100 Gbit/s "
        "EDR InfiniBand link per node",
    ),
}

WORKLOADS = {
    # P100 fp32 synthetic throughputs: TensorFlow's tf_cnn_benchmarks tables (DGX-1, batch 64/32).
    "inception3-p100": Workload(
        "inception3-p100",
        23.8,
        142.0,
        64,
        "Szegedy et al. 2016 params; TF benchmarks P100 142 img/s",
    ),
    "resnet50-p100": Workload(
        "resnet50-p100",
        25.6,
        219.0,
        32,
        "He et al. 2016 params; TF benchmarks P100 219 img/s; Goyal batch 32",
    ),
    "resnet101-p100": Workload(
        "resnet101-p100",
        44.5,
        125.0,
        64,
        "He et al. 2016 params; about 0.57x ResNet-50's rate (FLOPs 7.6/4.1)",
    ),
    "vgg16-p100": Workload(
        "vgg16-p100",
        138.4,
        154.0,
        64,
        "Simonyan and Zisserman params; TF benchmarks P100 154 img/s",
    ),
    "resnet50-v100": Workload(
        "resnet50-v100",
        25.6,
        390.0,
        64,
        "NVIDIA's V100 fp32 ResNet-50 training rate, about 390 img/s",
    ),
}

# Published scaling efficiencies the model is checked against (never used as inputs).
PUBLISHED = [
    {
        "workload": "inception3-p100",
        "hardware": "p100-25gbe-roce",
        "workers": 512,
        "efficiency": 0.90,
        "source": "Horovod benchmarks page (512 GPUs)",
    },
    {
        "workload": "resnet101-p100",
        "hardware": "p100-25gbe-roce",
        "workers": 512,
        "efficiency": 0.90,
        "source": "Horovod benchmarks page (512 GPUs)",
    },
    {
        "workload": "vgg16-p100",
        "hardware": "p100-25gbe-roce",
        "workers": 512,
        "efficiency": 0.68,
        "source": "Horovod benchmarks page (512 GPUs)",
    },
    {
        "workload": "resnet50-p100",
        "hardware": "p100-nvlink-50gbe",
        "workers": 256,
        "efficiency": 0.90,
        "source": "Goyal et al. 2017, 8 to 256 GPUs (about 90%)",
    },
]


def step_time(
    hw: Hardware, wl: Workload, workers: int, overlap: float = 0.0, bytes_per_param: int = 4
) -> dict[str, float]:
    """The step of one worker in a job of `workers`, in seconds, by component."""
    compute = wl.per_worker_batch / wl.images_per_second
    grad_bytes = wl.params_millions * 1e6 * bytes_per_param
    buffers = max(1, math.ceil(grad_bytes / (hw.fusion_mb * 1e6)))
    inter = hw.inter_gbit * 1e9 / 8
    nodes = max(1, math.ceil(workers / hw.workers_per_node))
    g = min(workers, hw.workers_per_node)
    if workers == 1:
        transfer, hops = 0.0, 0
    elif hw.hierarchical and nodes > 1:
        transfer = (
            2 * (g - 1) / g * grad_bytes / (hw.intra_gbyte * 1e9)
            + 2 * (nodes - 1) / nodes * grad_bytes / g / inter
        )
        hops = 2 * (nodes - 1)
    else:
        # A flat ring crosses each node's network link once each way: the link sets the pace.
        slowest = inter if nodes > 1 else hw.intra_gbyte * 1e9
        transfer = 2 * (workers - 1) / workers * grad_bytes / slowest
        hops = 2 * (workers - 1)
    latency = (
        0.0 if workers == 1 else buffers * (hops * hw.inter_latency_us * 1e-6 + hw.cycle_ms * 1e-3)
    )
    comm = transfer + latency
    step = compute + max(0.0, comm - overlap * (2 / 3) * compute)
    return {
        "compute": compute,
        "transfer": transfer,
        "latency": latency,
        "comm": comm,
        "step": step,
        "efficiency": compute / step,
        "throughput": workers * wl.per_worker_batch / step,
    }


def predict(hw: Hardware, wl: Workload, workers: list[int]) -> list[dict[str, float]]:
    """Bounds for each worker count: no overlap (lower) and full overlap of backward (upper)."""
    rows = []
    for n in workers:
        low, high = step_time(hw, wl, n, 0.0), step_time(hw, wl, n, 1.0)
        rows.append(
            {
                "workers": n,
                "efficiency_no_overlap": low["efficiency"],
                "efficiency_full_overlap": high["efficiency"],
                "throughput_no_overlap": low["throughput"],
                "throughput_full_overlap": high["throughput"],
                "compute_ms": 1e3 * low["compute"],
                "comm_ms": 1e3 * low["comm"],
            }
        )
    return rows


def compare_published() -> list[dict]:
    """Each published efficiency beside the model's bounds, and the error of the midpoint."""
    out = []
    for pub in PUBLISHED:
        hw, wl = HARDWARE[pub["hardware"]], WORKLOADS[pub["workload"]]
        row = predict(hw, wl, [pub["workers"]])[0]
        mid = (row["efficiency_no_overlap"] + row["efficiency_full_overlap"]) / 2
        out.append(
            {
                **pub,
                "model_no_overlap": row["efficiency_no_overlap"],
                "model_full_overlap": row["efficiency_full_overlap"],
                "model_midpoint": mid,
                "error_points": 100 * (mid - pub["efficiency"]),
            }
        )
    return out


def describe() -> dict:
    return {
        "hardware": {k: asdict(v) for k, v in HARDWARE.items()},
        "workloads": {k: asdict(v) for k, v in WORKLOADS.items()},
    }


# --- the cluster's hosts: predicted from what `hvd-train selftest` measures ---------------------

REDUCTIONS = ("flat", "two_level")


@dataclass(frozen=True)
class Compute:
    """One rank's step without communication, measured alone under the job's CPU confinement.

    Attributes:
      forward_s: the forward pass and loss.
      backward_s: the gradients (forward + backward minus forward).
      step_s: the whole step without communication (adds the update and the framework's work).
    """

    forward_s: float
    backward_s: float
    step_s: float


@dataclass(frozen=True)
class Link:
    """A host's data link as `hvd-train selftest` measures it: the slower direction's rate, in
    MB/s each way, and half the round trip of a one-byte message; and, where it ran on the job's
    ranks, the rate at which its allreduce moved bytes across each host's link (None: not
    measured). The gradients move at the lower of the two rates: on a host whose cores compute,
    the allreduce's copies, sums and TCP stack can hold it below what the link carries."""

    mb_per_s: float
    latency_us: float
    allreduce_mb_per_s: float | None = None

    @property
    def rate_mb_per_s(self) -> float:
        """The rate the gradients move at across each host's link."""
        if self.allreduce_mb_per_s is None:
            return self.mb_per_s
        return min(self.mb_per_s, self.allreduce_mb_per_s)


def cross_host_bytes(nbytes: float, hosts: int, slots: int, reduction: str = "flat") -> float:
    """Bytes one host sends (and receives) over its link to allreduce `nbytes` on every rank.

    A flat ring over the ranks, host by host, crosses each host's link once each way carrying
    2(n-1)/n of the data (n = hosts x slots); two-level reduction (inside each host, then across
    the hosts' leaders, then a broadcast inside) sends 2(m-1)/m of it across (m = hosts).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if hosts <= 1:
        return 0.0
    n = hosts if reduction == "two_level" else hosts * slots
    return 2 * (n - 1) / n * nbytes


def cluster_step(
    compute: Compute,
    link: Link,
    gradient_bytes: float,
    hosts: int,
    slots: int,
    *,
    buffers: int = 1,
    last_bytes: float | None = None,
    reduction: str = "flat",
    cycle_ms: float = 1.0,
    spare_cpu: bool = True,
) -> dict[str, float]:
    """The step of a job of `hosts` x `slots` ranks whose host links all run at `link`, in seconds.

    Each collective crosses the hosts' links (`cross_host_bytes`) and pays its ring's hops
    (2(n-1) x latency) and one Horovod cycle. Without overlap (`last_bytes` None: one group once
    every gradient exists) step = compute + comm. With overlap (buckets, or Horovod's per-tensor
    allreduce, issued as the gradients exist) only the last collective, of `last_bytes`, must wait
    for the whole backward pass, and the link cannot carry more than comm after the forward pass:
    step = max(compute + comm(last), forward + comm + update). Overlap needs a CPU to move the
    buckets while the backward pass runs: where no core is spare (`spare_cpu` False: CPU-only
    hosts whose ranks' compute fills every core, `core.placement.spare_cpu`), the collectives
    take their time from the compute, and step = compute + comm whatever the buckets.

    Args:
      compute: the step without communication (`Compute`).
      link: the measured link (`Link`).
      gradient_bytes: the bytes of the gradients on the wire (after any compression).
      hosts, slots: the job's hosts and ranks per host.
      buffers: how many collectives the gradients go out in.
      last_bytes: the bytes that wait for the whole backward pass where the allreduce overlaps
        it (the last collective's, or those of every collective from the one holding the
        gradient made last); None where it starts only after it.
      reduction: "flat" or "two_level" (`cross_host_bytes`).
      cycle_ms: Horovod's cycle time.
      spare_cpu: every host keeps a core free of the compute (or computes on GPUs).

    Returns:
      compute, transfer, latency, comm, last (the collective no overlap can hide), step,
      efficiency, and hidden: the part of comm the step does not show, (compute + comm - step) /
      comm.

    Raises:
      ValueError: a link rate that is not positive, fewer than one buffer, or an unknown
        reduction.
    """
    if link.rate_mb_per_s <= 0:
        raise ValueError(f"the link rate must be positive, got {link.rate_mb_per_s} MB/s")
    if buffers < 1:
        raise ValueError(f"need at least one buffer, got {buffers}")
    n = hosts if reduction == "two_level" else hosts * slots
    hop_s = 0.0 if hosts <= 1 else 2 * (n - 1) * link.latency_us * 1e-6 + cycle_ms * 1e-3

    def comm_of(nbytes: float, count: int) -> tuple[float, float]:
        moved = cross_host_bytes(nbytes, hosts, slots, reduction)
        return moved / (link.rate_mb_per_s * 1e6), count * hop_s

    transfer, latency = comm_of(gradient_bytes, buffers)
    comm = transfer + latency
    if last_bytes is None or not spare_cpu:
        last = comm
        step = compute.step_s + comm
    else:
        last = sum(comm_of(min(last_bytes, gradient_bytes), 1))
        update = max(0.0, compute.step_s - compute.forward_s - compute.backward_s)
        step = max(compute.step_s + last, compute.forward_s + comm + update)
    return {
        "compute": compute.step_s,
        "transfer": transfer,
        "latency": latency,
        "comm": comm,
        "last": last,
        "step": step,
        "efficiency": compute.step_s / step,
        "hidden": (compute.step_s + comm - step) / comm if comm > 0 else 0.0,
    }
