"""`hvd-train selftest`: every rank of a job checks its part of the allocation; rank 0 prints one
table and the problems (docs/cli.md, "hvd-train selftest").

Each rank checks its Horovod build, runs collectives of rank-built tensors against their closed
forms, names its job interface (`core.network.job_interface`), times a fixed compute workload and
finds NCCL (`doctor.nccl_library`); one process per host then measures each host pair's bandwidth
and latency over plain TCP between the hosts' job-interface addresses, one pair at a time.

`run` is the collective part (every rank calls it). The rules that turn the gathered numbers into
problems (`find_problems`), the table (`table`) and the pair schedule (`pair_schedule`) are pure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hvd_train import doctor
from hvd_train.core import network, outcome
from hvd_train.core.environment import LauncherEnvironmentError
from hvd_train.errors import UserError

EXIT_PROBLEMS = 1  # as `hvd-train doctor`: the check ran and found something wrong

ALL_PAIRS_UP_TO = 8  # hosts: every pair measured; beyond, a ring (each host and the next)
# The compute workload: the same on every rank, timed after a barrier.
MATMUL_SIZE = 512
MATMULS_PER_REPEAT = 40
REPEATS = 5
# One host pair: a ping-pong of one byte, then a stream each way of at most STREAM_SECONDS of
# sending or STREAM_BYTES, whichever ends first; the whole pair within PAIR_TIMEOUT_S.
PINGS, PING_WARMUP = 30, 5
STREAM_SECONDS = 0.1
STREAM_BYTES = 64 << 20
CHUNK_BYTES = 256 << 10
PAIR_TIMEOUT_S = 10.0
MB = 1e6  # bandwidth in MB/s (10^6 bytes per second): 1 Gbit/s is 125 MB/s
# One allreduce across the whole job, timed ALLREDUCE_REPEATS times: the rate the gradients get,
# which the hosts' CPUs (copies, sums, the TCP stack) can hold below the link's. Its size: what the
# slowest link carries in ALLREDUCE_SECONDS, within [1 MiB, 32 MiB] (a slow link stays quick).
ALLREDUCE_MAX_BYTES = 32 << 20
ALLREDUCE_MIN_BYTES = 1 << 20
ALLREDUCE_SECONDS = 0.25
ALLREDUCE_REPEATS = 3


@dataclass(frozen=True)
class Options:
    """What a selftest checks against.

    Attributes:
      max_skew: a rank whose compute step is slower than the median of all ranks by more than
        this fraction is a problem.
      min_bandwidth: a host pair below this many MB/s (either way) is a problem; 0: no floor
        (a pair below half the median of the others always is).
      json_path: where rank 0 writes the report as JSON; None: nowhere.
    """

    max_skew: float = 0.25
    min_bandwidth: float = 0.0
    json_path: Path | None = None


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvd-train selftest",
        description="check this job's allocation: the Horovod build, the collectives, the "
        "network, the ranks' compute speed, each host pair's links, NCCL (run it on every rank, "
        "e.g. hvd-train launch --np N --hosts ... -- selftest)",
    )
    parser.add_argument(
        "--max-skew",
        type=float,
        default=Options.max_skew,
        metavar="FRACTION",
        help="a rank's compute step may be this much slower than the median [0.25: 25%%]",
    )
    parser.add_argument(
        "--min-bandwidth",
        type=float,
        default=Options.min_bandwidth,
        metavar="MB/S",
        help="the least bandwidth of a host pair, in MB/s (1 Gbit/s = 125 MB/s) [0: no floor]",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="rank 0 writes the report here")
    return parser


def options(args: argparse.Namespace) -> Options:
    """The checked options of a parsed command line.

    Raises:
      UserError: a negative --max-skew or --min-bandwidth.
    """
    if not args.max_skew >= 0:
        raise UserError(f"hvd-train selftest: --max-skew must be >= 0, got {args.max_skew}")
    if not args.min_bandwidth >= 0:
        raise UserError(
            f"hvd-train selftest: --min-bandwidth must be >= 0 MB/s, got {args.min_bandwidth}"
        )
    return Options(args.max_skew, args.min_bandwidth, args.json)


@dataclass
class RankReport:
    """What one rank found about itself."""

    rank: int
    host: str
    local_rank: int
    controller: str
    build: dict[str, bool]
    versions: dict[str, str | None]  # horovod, tensorflow
    nccl: str | None  # NCCL's version, None where absent
    gpus: int
    interface: str | None = None  # the job interface's name, address and network
    address: str | None = None
    network: str | None = None
    interface_error: str | None = None  # HVD_TRAIN_IFACE names no interface of this host
    step_ms: float = 0.0  # the compute workload: median over REPEATS
    collective_errors: list[str] = field(default_factory=list)
    port: int | None = None  # where this host's measuring process listens
    nccl_socket_ifname: str | None = None  # what NCCL will use (hvd_train.init sets it)


@dataclass
class Link:
    """One host pair, measured from host `a` (the client) to host `b`."""

    a: str
    b: str
    mb_per_s: float | None = None  # the slower direction
    a_to_b_mb_per_s: float | None = None
    b_to_a_mb_per_s: float | None = None
    latency_us: float | None = None  # half the median round trip of a one-byte ping-pong
    error: str | None = None


@dataclass
class AllreduceTiming:
    """One allreduce of `nbytes` on every rank of the job, the median of ALLREDUCE_REPEATS.

    `mb_per_s` is the rate at which it moved bytes across each host's link: a flat ring over the
    job's ranks carries 2(n-1)/n of the data each way (`plan.cross_host_bytes`); None on one host.
    """

    nbytes: int
    seconds: float
    ranks: int
    hosts: int
    mb_per_s: float | None


def allreduce_bytes(links: Sequence[Link]) -> int:
    """The size of the timed allreduce: what the slowest measured link carries in
    ALLREDUCE_SECONDS, within [ALLREDUCE_MIN_BYTES, ALLREDUCE_MAX_BYTES], whole float32s."""
    rates = [x.mb_per_s for x in links if x.mb_per_s]
    if not rates:
        return ALLREDUCE_MAX_BYTES
    wanted = int(min(rates) * MB * ALLREDUCE_SECONDS)
    return max(ALLREDUCE_MIN_BYTES, min(ALLREDUCE_MAX_BYTES, wanted)) // 4 * 4


def allreduce_timing(nbytes: int, seconds: float, ranks: int, hosts: int) -> AllreduceTiming:
    """The timing of one allreduce, and its rate across each host's link."""
    from hvd_train.bench import plan

    moved = plan.cross_host_bytes(nbytes, hosts, ranks // hosts if hosts else 0)
    rate = moved / seconds / MB if hosts > 1 and seconds > 0 else None
    return AllreduceTiming(nbytes, seconds, ranks, hosts, rate)


def pair_schedule(hosts: int) -> list[tuple[int, int]]:
    """The host pairs to measure, as (client, server) host indices, in order: every pair up to
    ALL_PAIRS_UP_TO hosts, a ring beyond (host i and i+1, the last and the first)."""
    if hosts <= ALL_PAIRS_UP_TO:
        return [(a, b) for a in range(hosts) for b in range(a + 1, hosts)]
    return [(a, (a + 1) % hosts) for a in range(hosts)]


def hosts_of(ranks: Sequence[RankReport]) -> dict[str, list[RankReport]]:
    """The ranks of each host, hosts in the order of their first rank."""
    by_host: dict[str, list[RankReport]] = {}
    for report in sorted(ranks, key=lambda r: r.rank):
        by_host.setdefault(report.host, []).append(report)
    return by_host


def _rank_names(reports: Sequence[RankReport]) -> str:
    return ("rank " if len(reports) == 1 else "ranks ") + ",".join(str(r.rank) for r in reports)


def find_problems(
    ranks: Sequence[RankReport], links: Sequence[Link], options: Options
) -> list[str]:
    """The problems the gathered reports show, one line each naming the rank or the hosts."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    return [
        *_build_problems(ranks),
        *_collective_problems(ranks),
        *_network_problems(ranks),
        *_skew_problems(ranks, options.max_skew),
        *_link_problems(links, options.min_bandwidth),
    ]


def _build_problems(ranks: Sequence[RankReport]) -> list[str]:
    problems = []
    for r in ranks:
        if not r.build.get(r.controller, False):
            problems.append(
                f"rank {r.rank} on host {r.host}: the job runs Horovod's {r.controller} "
                f"controller, which this build lacks: {doctor.REINSTALL}"
            )
    by_host = hosts_of(ranks)
    for what, value in (
        ("Horovod versions", lambda r: r.versions.get("horovod")),
        ("TensorFlow versions", lambda r: r.versions.get("tensorflow")),
        ("Horovod builds", lambda r: _built_list(r.build)),
    ):
        seen = {host: value(reports[0]) for host, reports in by_host.items()}
        if len(set(seen.values())) > 1:
            listed = ", ".join(f"{host} {found}" for host, found in seen.items())
            problems.append(f"{what} differ between hosts: {listed}")
    for host, reports in by_host.items():
        first = reports[0]
        if first.gpus and not first.build.get("nccl"):
            problems.append(
                f"host {host}: {first.gpus} GPU(s), but Horovod was built without NCCL (GPU "
                "tensors go through host memory): run mpi_scripts/install.sh with GPU=1"
            )
        if first.build.get("nccl") and first.nccl is None:
            problems.append(
                f"host {host}: Horovod was built with NCCL, but no NCCL library is found: "
                "pip install nvidia-nccl-cu<CUDA major>, or put libnccl.so.2 on the library path"
            )
    if any(r.build.get("nccl") for r in ranks):
        versions = {host: reports[0].nccl for host, reports in by_host.items()}
        if len({v for v in versions.values() if v}) > 1:
            listed = ", ".join(f"{host} {found or 'absent'}" for host, found in versions.items())
            problems.append(f"NCCL versions differ between hosts (NCCL needs one): {listed}")
    return problems


def _built_list(build: dict[str, bool]) -> str:
    return "+".join(name for name in ("mpi", "gloo", "nccl", "cuda") if build.get(name)) or "none"


def _collective_problems(ranks: Sequence[RankReport]) -> list[str]:
    return [f"rank {r.rank} on host {r.host}: {e}" for r in ranks for e in r.collective_errors]


def _network_problems(ranks: Sequence[RankReport]) -> list[str]:
    by_host = hosts_of(ranks)
    problems = [
        f"rank {r.rank} on host {r.host}: {r.interface_error}" for r in ranks if r.interface_error
    ]
    if len(by_host) < 2:
        return problems  # one host: loopback and shared memory, no network between hosts
    for r in ranks:
        if r.interface is None and not r.interface_error:
            problems.append(
                f"rank {r.rank} on host {r.host}: no job interface in a job across hosts (name "
                f"the network: {network.JOB_IFACE}=a.b.c.d/n or an interface name)"
            )
    on = [r for r in ranks if r.network]
    networks: dict[str, list[RankReport]] = {}
    for r in on:
        networks.setdefault(str(r.network), []).append(r)
    if len(networks) > 1:
        # The job's network: the most ranks', rank 0's on a tie (dicts keep rank order).
        job = max(networks, key=lambda n: len(networks[n]))
        for net, reports in networks.items():
            if net == job:
                continue
            for host, mine in hosts_of(reports).items():
                problems.append(
                    f"host {host} ({_rank_names(mine)}): interface {mine[0].interface} "
                    f"{mine[0].address} is on {net}, the other ranks on {job} "
                    f"({_rank_names(networks[job])})"
                )
    addresses: dict[str, dict[str, str]] = {}
    for r in on:
        addresses.setdefault(str(r.address), {})[r.host] = str(r.interface)
    for address, hosts in addresses.items():
        if len(hosts) > 1:
            names = ", ".join(f"{host} ({name})" for host, name in hosts.items())
            problems.append(
                f"hosts {names} all have the job's address {address}: a host-local interface "
                "(docker0 and other bridges) carries no traffic between hosts; name the job's "
                f"network ({network.JOB_IFACE}=a.b.c.d/n)"
            )
    return problems


def _skew_problems(ranks: Sequence[RankReport], max_skew: float) -> list[str]:
    if len(ranks) < 2:
        return []
    median = statistics.median(r.step_ms for r in ranks)
    return [
        f"rank {r.rank} on host {r.host}: compute step {r.step_ms:.1f} ms, "
        f"{100 * (r.step_ms / median - 1):.0f}% slower than the median {median:.1f} ms "
        f"(--max-skew {max_skew:g})"
        for r in ranks
        if r.step_ms > median * (1 + max_skew)
    ]


def _link_problems(links: Sequence[Link], min_bandwidth: float) -> list[str]:
    problems = [f"hosts {x.a} - {x.b}: not measured: {x.error}" for x in links if x.error]
    measured = [(x, x.mb_per_s) for x in links if x.mb_per_s is not None]
    for link, speed in measured:
        if speed < min_bandwidth:
            problems.append(
                f"hosts {link.a} - {link.b}: {speed:.1f} MB/s, below --min-bandwidth "
                f"{min_bandwidth:g} MB/s"
            )
        others = [other for x, other in measured if x is not link]
        if others and speed < statistics.median(others) / 2:
            problems.append(
                f"hosts {link.a} - {link.b}: {speed:.1f} MB/s, below half the median of "
                f"the other pairs ({statistics.median(others):.1f} MB/s)"
            )
    return problems


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def table(
    ranks: Sequence[RankReport],
    links: Sequence[Link],
    problems: Sequence[str],
    allreduce: AllreduceTiming | None = None,
) -> str:
    """The report rank 0 prints: the job, one row per host, one per host pair, the allreduce, the
    problems."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    by_host = hosts_of(ranks)
    first = ranks[0]
    median = statistics.median(r.step_ms for r in ranks)
    lines = [
        f"selftest: {len(ranks)} rank(s) on {len(by_host)} host(s), controller "
        f"{first.controller}; Horovod {first.versions.get('horovod')} "
        f"(built: {_built_list(first.build)}), TensorFlow {first.versions.get('tensorflow')}"
    ]
    rows = [["host", "ranks", "interface", "address", "network", "step ms", "skew", "nccl"]]
    for host, reports in by_host.items():
        slowest = max(reports, key=lambda r: r.step_ms)
        local = reports[0]
        rows.append(
            [
                host,
                ",".join(str(r.rank) for r in reports),
                local.interface or "- (none)",
                local.address or "-",
                local.network or "-",
                f"{slowest.step_ms:.1f}",
                f"{100 * (slowest.step_ms / median - 1):+.0f}%",
                local.nccl or "absent",
            ]
        )
    lines += _columns(rows)
    if len(by_host) < 2:
        lines.append("pairs: none (one host)")
    else:
        rows = [["pair", "MB/s", "a->b MB/s", "b->a MB/s", "latency us"]]
        for link in links:
            if link.error:
                rows.append([f"{link.a} - {link.b}", "-", "-", "-", "-"])
                continue
            rows.append(
                [
                    f"{link.a} - {link.b}",
                    f"{link.mb_per_s:.1f}",
                    f"{link.a_to_b_mb_per_s:.1f}",
                    f"{link.b_to_a_mb_per_s:.1f}",
                    f"{link.latency_us:.0f}",
                ]
            )
        lines += _columns(rows)
    if allreduce is not None:
        across = (
            f", {allreduce.mb_per_s:.1f} MB/s across each host's link"
            if allreduce.mb_per_s is not None
            else ""
        )
        lines.append(
            f"allreduce of {allreduce.nbytes / MB:.1f} MB on {allreduce.ranks} rank(s): "
            f"{1e3 * allreduce.seconds:.1f} ms{across}"
        )
    failed = sum(bool(r.collective_errors) for r in ranks)
    lines.append(
        "collectives (allreduce sum and average, allgather, broadcast): "
        + (f"wrong on {failed} rank(s)" if failed else f"as expected on {len(ranks)} rank(s)")
    )
    lines += [f"PROBLEM: {p}" for p in problems]
    lines.append("selftest: ok" if not problems else f"selftest: {len(problems)} problem(s)")
    return "\n".join(lines)


def report_json(
    ranks: Sequence[RankReport],
    links: Sequence[Link],
    problems: Sequence[str],
    options: Options,
    allreduce: AllreduceTiming | None = None,
) -> dict[str, Any]:
    """Everything the table shows, and the options it was checked against, as JSON data."""
    return {
        "allreduce": asdict(allreduce) if allreduce is not None else None,
        "options": {"max_skew": options.max_skew, "min_bandwidth_mb_per_s": options.min_bandwidth},
        "hosts": list(hosts_of(ranks)),
        "ranks": [asdict(r) for r in sorted(ranks, key=lambda r: r.rank)],
        "links": [asdict(x) for x in links],
        "problems": list(problems),
        "ok": not problems,
    }


# --- the collective part ------------------------------------------------------------------------


def run(options: Options) -> int:
    """The selftest on this rank (collective: every rank of the job calls it). Rank 0 prints the
    table and writes --json; every rank returns the same exit code: 0 healthy, EXIT_PROBLEMS
    when there is a problem, outcome.EXIT_WRITE_FAILED when rank 0 cannot write --json."""
    from hvd_train import comm

    comm.init()
    me = _examine_this_rank(comm)
    listener = _listen(me)
    ranks = comm.allgather_object(me, name="hvd_train.selftest.ranks")
    try:
        mine = _measure_links(comm, ranks, me.rank, listener)
    finally:
        if listener is not None:
            listener.close()
    links = [
        x for found in comm.allgather_object(mine, name="hvd_train.selftest.links") for x in found
    ]
    nbytes = allreduce_bytes(links)  # the same on every rank: the links were gathered
    seconds = _time_allreduce(comm, nbytes)
    allreduce = allreduce_timing(nbytes, seconds, len(ranks), len(hosts_of(ranks)))
    code = outcome.EXIT_OK
    if me.rank == 0:
        problems = find_problems(ranks, links, options)
        sys.stdout.write(table(ranks, links, problems, allreduce) + "\n")
        sys.stdout.flush()
        code = EXIT_PROBLEMS if problems else outcome.EXIT_OK
        if problems:  # the toolkit's error line: launchers' own failure reports are dropped
            sys.stderr.write(f"hvd-train: error: selftest found {len(problems)} problem(s)\n")
            sys.stderr.flush()
        if options.json_path is not None:
            try:
                report = report_json(ranks, links, problems, options, allreduce)
                data = json.dumps(report, indent=1)
                options.json_path.write_text(data + "\n")
            except OSError as err:
                sys.stderr.write(f"hvd-train: error: selftest: cannot write --json: {err}\n")
                code = outcome.EXIT_WRITE_FAILED
    code = comm.broadcast_object(code, 0, name="hvd_train.selftest.exit_code")
    comm.shutdown()
    return code


def _examine_this_rank(comm: Any) -> RankReport:
    """This rank's build, collectives, interface and compute time (collective)."""
    import tensorflow as tf

    topology = comm.topology()
    me = RankReport(
        rank=topology.rank,
        host=socket.gethostname(),
        local_rank=topology.local_rank,
        controller=comm.controller(),
        build=comm.build_info(),
        versions={
            "horovod": doctor.package_version("horovod"),
            "tensorflow": doctor.package_version("tensorflow-cpu", "tensorflow"),
        },
        nccl=found.version if (found := doctor.nccl_library()) else None,
        gpus=len(tf.config.list_physical_devices("GPU")),
    )
    try:
        chosen = network.job_interface(os.environ)
    except LauncherEnvironmentError as err:
        me.interface_error = str(err)
    else:
        if chosen is not None:
            me.interface, me.address, me.network = chosen.name, chosen.address, str(chosen.network)
    me.nccl_socket_ifname = os.environ.get(network.NCCL_IFACE)
    me.collective_errors = _check_collectives(comm, topology.rank, topology.size)
    me.step_ms = _compute_step_ms(comm)
    return me


def _check_collectives(comm: Any, rank: int, size: int) -> list[str]:
    """Collectives of rank-built tensors against their closed forms (collective)."""
    import numpy as np
    import tensorflow as tf

    errors = []

    def expect(what: str, got: Any, wanted: Any) -> None:
        got = np.asarray(got)
        if got.shape != np.shape(wanted) or not np.array_equal(got, wanted):
            errors.append(f"{what} gave {got.ravel()[:6].tolist()}, expected {wanted!r}"[:300])

    ones = tf.ones([4], tf.float32) * (rank + 1)
    total = size * (size + 1) / 2  # sum of (rank+1) over the ranks
    got = comm.allreduce(ones, op=comm.Sum, name="hvd_train.selftest.sum").numpy()
    expect("allreduce sum of (rank+1)*ones", got, np.full([4], total, np.float32))
    got = comm.allreduce(ones, op=comm.Average, name="hvd_train.selftest.average").numpy()
    expect("allreduce average of (rank+1)*ones", got, np.full([4], (size + 1) / 2, np.float32))
    # Rank r sends r+1 rows of r: rows of different lengths, concatenated in rank order.
    rows = tf.fill([rank + 1, 2], float(rank))
    got = comm.allgather(rows, name="hvd_train.selftest.allgather").numpy()
    wanted = np.concatenate([np.full([r + 1, 2], float(r), np.float32) for r in range(size)])
    expect("allgather of rank r's r+1 rows of r", got, wanted)
    root = size - 1  # the last rank: a root other than rank 0
    value = tf.fill([3], float(rank + 7))
    got = comm.broadcast(value, root_rank=root, name="hvd_train.selftest.broadcast").numpy()
    expect(f"broadcast from rank {root}", got, np.full([3], root + 7, np.float32))
    return errors


def _time_allreduce(comm: Any, nbytes: int) -> float:
    """Seconds of one allreduce of `nbytes` on every rank, the median of ALLREDUCE_REPEATS after
    a warm-up, each started after a barrier (collective)."""
    import tensorflow as tf

    tensor = tf.ones([nbytes // 4], tf.float32)
    times = []
    for _ in range(ALLREDUCE_REPEATS + 1):
        comm.barrier()
        start = time.perf_counter()
        comm.allreduce(tensor, op=comm.Average, name="hvd_train.selftest.allreduce").numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first pays for the negotiation and the buffers


def _compute_step_ms(comm: Any) -> float:
    """The median time of REPEATS repeats of a fixed matmul workload, each started after a
    barrier so that every rank computes at the same time (collective)."""
    import tensorflow as tf

    matrix = tf.random.stateless_uniform([MATMUL_SIZE, MATMUL_SIZE], seed=[1, 2])

    @tf.function
    def work(x: tf.Tensor) -> tf.Tensor:
        for _ in range(MATMULS_PER_REPEAT):
            x = tf.linalg.matmul(x, matrix) / MATMUL_SIZE  # bounded: entries stay below 1
        return tf.reduce_sum(x)

    work(matrix).numpy()  # traced and warm before the clock runs
    times = []
    for _ in range(REPEATS):
        comm.barrier()
        start = time.perf_counter()
        work(matrix).numpy()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _listen(me: RankReport) -> socket.socket | None:
    """The socket on which this host's measuring process (local rank 0) takes pairs, on its job
    interface's address; its port goes into `me`."""
    if me.local_rank != 0 or me.address is None:
        return None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((me.address, 0))
        listener.listen(4)
    except OSError as err:
        listener.close()
        me.interface_error = f"cannot listen on its job interface's address {me.address}: {err}"
        return None
    me.port = listener.getsockname()[1]
    return listener


def _measure_links(
    comm: Any, ranks: Sequence[RankReport], rank: int, listener: socket.socket | None
) -> list[Link]:
    """The host pairs this rank measured (collective: one barrier per pair, so that pairs are
    measured one at a time and links do not compete)."""
    leaders = [reports[0] for reports in hosts_of(ranks).values()]
    links = []
    for a, b in pair_schedule(len(leaders)):
        client, server = leaders[a], leaders[b]
        if rank == client.rank:
            links.append(_client(client, server))
        elif rank == server.rank and listener is not None and client.address is not None:
            _serve(listener, client.address)
        comm.barrier()
    return links


def _client(me: RankReport, peer: RankReport) -> Link:
    link = Link(me.host, peer.host)
    if me.address is None or peer.address is None or peer.port is None:
        host = me.host if me.address is None else peer.host
        link.error = f"host {host} has no job interface to measure on"
        return link
    deadline = time.monotonic() + PAIR_TIMEOUT_S
    try:
        with socket.create_connection(
            (peer.address, peer.port), timeout=PAIR_TIMEOUT_S, source_address=(me.address, 0)
        ) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            trips = []
            for i in range(PINGS):
                start = time.perf_counter()
                conn.sendall(b"p")
                _receive(conn, memoryview(bytearray(1)), deadline)
                if i >= PING_WARMUP:
                    trips.append(time.perf_counter() - start)
            _send_stream(conn, deadline)
            ack = _receive(conn, memoryview(bytearray(16)), deadline)
            sent, seconds = struct.unpack("!Qd", ack)
            forward = sent / seconds / MB
            received, seconds = _receive_stream(conn, deadline)
            backward = received / seconds / MB
    except (OSError, ValueError, ZeroDivisionError) as err:
        link.error = f"{type(err).__name__}: {err}"
        return link
    link.a_to_b_mb_per_s, link.b_to_a_mb_per_s = forward, backward
    link.mb_per_s = min(forward, backward)
    link.latency_us = 1e6 * statistics.median(trips) / 2
    return link


def _serve(listener: socket.socket, client_address: str) -> None:
    """The server's side of one pair; its failures show on the client's side."""
    deadline = time.monotonic() + PAIR_TIMEOUT_S
    listener.settimeout(PAIR_TIMEOUT_S)
    try:
        while True:
            conn, (address, _) = listener.accept()
            if address == client_address:
                break
            conn.close()  # not the pair's client
            if time.monotonic() > deadline:
                return
        with conn:
            conn.settimeout(PAIR_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            byte = memoryview(bytearray(1))
            for _ in range(PINGS):
                conn.sendall(_receive(conn, byte, deadline))
            received, seconds = _receive_stream(conn, deadline)
            conn.sendall(struct.pack("!Qd", received, seconds))
            _send_stream(conn, deadline)
    except (OSError, ValueError):
        return


def _receive(conn: socket.socket, view: memoryview, deadline: float) -> memoryview:
    """Fill `view` from the connection; returns it."""
    done = 0
    while done < len(view):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pair took over {PAIR_TIMEOUT_S:g} s")
        got = conn.recv_into(view[done:])
        if got == 0:
            raise ConnectionError("the peer closed the connection")
        done += got
    return view


def _send_stream(conn: socket.socket, deadline: float) -> None:
    """Frames of CHUNK_BYTES for STREAM_SECONDS or STREAM_BYTES, then an empty frame."""
    frame = struct.pack("!I", CHUNK_BYTES) + bytes(CHUNK_BYTES)
    start, sent = time.perf_counter(), 0
    while time.perf_counter() - start < STREAM_SECONDS and sent < STREAM_BYTES:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pair took over {PAIR_TIMEOUT_S:g} s")
        conn.sendall(frame)
        sent += CHUNK_BYTES
    conn.sendall(struct.pack("!I", 0))


def _receive_stream(conn: socket.socket, deadline: float) -> tuple[int, float]:
    """The bytes of a stream and the seconds from its first frame's header to its last byte,
    timed here, where the bytes arrive (the sender's clock would count its socket buffer)."""
    header = memoryview(bytearray(4))
    chunk = memoryview(bytearray(CHUNK_BYTES))
    _receive(conn, header, deadline)
    start, received = time.perf_counter(), 0
    end = start
    while (length := struct.unpack("!I", header)[0]) > 0:
        if length > CHUNK_BYTES:
            raise ValueError(f"a frame of {length} bytes (at most {CHUNK_BYTES})")
        _receive(conn, chunk[:length], deadline)
        received += length
        end = time.perf_counter()
        _receive(conn, header, deadline)
    return received, end - start
