"""The watchdog at scale: 4096 ranks over real UDP sockets in one process.

Rank 0 and rank 1 are real `Watchdog`s; ranks 2 and up are simulated: a few sockets carry their
heartbeats (packed by `faults.pack_heartbeat`, as a `Watchdog` packs its own) and receive what rank
0 sends them. The simulated ranks report one constant step while ranks 0 and 1 step, so every
summary names the same number of ranks behind: the bytes per heartbeat are then exact.
"""

import json
import re
import socket
import time

from hvd_train.core import faults
from hvd_train.core.faults import StallRule, Summary, Watchdog

HEARTBEAT_S = 0.5
SIM_SOCKETS = 64  # sockets carrying ranks 2..size-1 (far below the fd limit at any size)
RULE = StallRule(floor_s=4.0, factor=1.0, startup_s=60.0)  # 4 s > the 2.5 s of silence
SAFE_DATAGRAM = 1400  # bytes: one Ethernet frame's payload, with room for tunnels' headers


class SimulatedRanks:
    """Ranks 2..size-1: their heartbeats to rank 0, and what rank 0 sends back to them."""

    def __init__(self, size, contact):
        self.size, self.contact = size, contact
        self.socks = []
        for _ in range(SIM_SOCKETS):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
            self.socks.append(sock)
        self.sent_bytes = self.sent = 0
        self.received_bytes = self.received = self.largest_received = 0
        self.last_summary = None

    def beat(self, silent=()):
        chief = (self.contact.host, self.contact.port)
        for rank in range(2, self.size):
            if rank in silent:
                continue
            data = faults.pack_heartbeat(self.contact.token, rank, 1, False)
            self.socks[rank % SIM_SOCKETS].sendto(data, chief)
            self.sent += 1
            self.sent_bytes += len(data)
            if rank % 512 == 0:
                self.drain()  # keep the queues short
        self.drain()

    def drain(self):
        for sock in self.socks:
            while True:
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    break
                self.received += 1
                self.received_bytes += len(data)
                self.largest_received = max(self.largest_received, len(data))
                self.last_summary = data

    def summary(self):
        if self.last_summary is None:
            return None
        return Summary.unpack(self.contact.token, self.last_summary)

    def close(self):
        for sock in self.socks:
            sock.close()


def after_a_beat(dog):
    """Rank 0's traffic just after one of its beats (it counts a beat once the beat's sends are
    done), so that a window between two such moments holds whole beats."""
    beats = dog.traffic.beats
    while dog.traffic.beats == beats:
        time.sleep(0.001)
    return dog.traffic.beats, dog.traffic.sent_bytes, dog.traffic.largest_sent


def run_job(size, silent_rank, measured_beats=6):
    """Bytes per heartbeat, and the stall messages, of a `size`-rank job whose `silent_rank`
    goes silent while rank 0 waits for it."""
    sock0, contact = faults.open_socket(0, spans_hosts=False)
    sock1, _ = faults.open_socket(1, spans_hosts=False)
    stalls = {0: [], 1: []}
    dog0 = Watchdog(0, size, sock0, contact, RULE, HEARTBEAT_S, on_stall=stalls[0].append)
    dog1 = Watchdog(1, size, sock1, contact, RULE, HEARTBEAT_S, on_stall=stalls[1].append)
    sims = SimulatedRanks(size, contact)
    next_round = time.monotonic()

    def one_round(silent=(), chief_steps=True):
        nonlocal next_round
        if chief_steps:
            dog0.step_done()
        dog1.step_done()
        sims.beat(silent)
        next_round += HEARTBEAT_S
        time.sleep(max(0.0, next_round - time.monotonic()))

    try:
        dog0.phase("train"), dog1.phase("train")
        deadline = time.monotonic() + 20
        while not ((s := sims.summary()) and s.silent_count == 0 and s.behind_count):
            assert time.monotonic() < deadline, "rank 0 did not hear every rank"
            one_round()
        beats0, sent0, _ = after_a_beat(dog0)
        sims_sent0 = sims.sent_bytes
        dog1_bytes0, dog1_count0 = dog1.traffic.received_bytes, dog1.traffic.received
        for _ in range(measured_beats):
            one_round()
        beats1, sent1, largest = after_a_beat(dog0)
        # One heartbeat from every rank but 0 (rank 1's: the size of its own), one beat of rank 0.
        rank_1_heartbeat = dog1.traffic.sent_bytes / dog1.traffic.sent
        heartbeats = (sims.sent_bytes - sims_sent0) / measured_beats + rank_1_heartbeat
        chief = (sent1 - sent0) / (beats1 - beats0)
        per_rank = (dog1.traffic.received_bytes - dog1_bytes0) / (
            dog1.traffic.received - dog1_count0
        )
        assert sims.summary().silent_count == 0  # nobody named silent while all were heard

        deadline = time.monotonic() + 30
        while not stalls[0]:
            assert time.monotonic() < deadline, "rank 0's watchdog did not fire"
            one_round(silent={silent_rank}, chief_steps=False)  # rank 0 waits in the collective
        rank_1_view = dog1.lost_ranks(wait=False)
    finally:
        dog0.close(), dog1.close(), sims.close()
    return {
        "heartbeats": heartbeats,
        "chief": chief,
        "total": heartbeats + chief,
        "per_rank": per_rank,
        "largest": max(largest, dog1.traffic.largest_sent, sims.largest_received),
        "stall": stalls[0][0],
        "rank_1_view": rank_1_view,
        "rank_1_stalls": stalls[1],
        "ignored": dog0.traffic.ignored + dog1.traffic.ignored,
        "send_failures": dog0.traffic.send_failures + dog1.traffic.send_failures,
    }


def old_protocol_bytes(size):
    """Bytes per heartbeat of the watchdog before summaries: a JSON heartbeat from each rank, and
    the whole table (every rank's age, steps, busy) from rank 0 to each rank."""
    heartbeats = sum(len(json.dumps([r, 12345, False])) for r in range(1, size))
    table = json.dumps({r: [0.123456789, 12345, False] for r in range(size)})
    return heartbeats + (size - 1) * len(table), len(table)


def test_bytes_per_heartbeat_grow_linearly_and_rank_0_names_the_silent_one_of_4096():
    started = time.monotonic()
    small, large = run_job(256, silent_rank=201), run_job(4096, silent_rank=3001)
    took = time.monotonic() - started

    ratio = large["total"] / small["total"]
    print(
        f"bytes per heartbeat: N=256 {small['total']:.0f} (rank 0 sends {small['chief']:.0f}), "
        f"N=4096 {large['total']:.0f} (rank 0 sends {large['chief']:.0f}); ratio {ratio:.2f}; "
        f"largest datagram {large['largest']} B; each rank receives {large['per_rank']:.0f} B; "
        f"{took:.1f} s"
    )
    linear = 4095 / 255  # the ranks besides rank 0, each one heartbeat and one summary
    assert 0.9 * linear < ratio < 1.1 * linear, ratio
    # Negative control: the old protocol's growth fails the same assertion (N^2), and its table
    # did not fit one datagram (at 4096 ranks, not even the 65507 bytes UDP allows).
    old_small, old_table_small = old_protocol_bytes(256)
    old_large, old_table_large = old_protocol_bytes(4096)
    assert not 0.9 * linear < old_large / old_small < 1.1 * linear
    assert old_table_small > SAFE_DATAGRAM and old_table_large > 65507

    for job in (small, large):
        assert job["largest"] <= faults.MAX_DATAGRAM < SAFE_DATAGRAM
        assert job["ignored"] == 0 and job["send_failures"] == 0
    assert large["per_rank"] == small["per_rank"]  # what one rank receives does not grow with N

    for job, rank in ((small, 201), (large, 3001)):
        assert f"did not arrive: rank {rank} (no heartbeat for" in job["stall"], job["stall"]
        assert re.findall(r"rank (\d+) \(no heartbeat", job["stall"]) == [str(rank)]
        assert f"rank {rank} (no heartbeat for" in job["rank_1_view"]  # told by rank 0's summary
        assert job["rank_1_stalls"] == []
    assert took < 60


def test_every_datagram_fits_one_frame_at_any_size():
    peers = {r: faults.Peer(float("inf"), 2**40, True) for r in range(100_000)}
    everyone_silent = faults.summarize(peers, silence_s=1)
    token = b"\x01" * faults.TOKEN_BYTES
    data = everyone_silent.pack(token)
    assert len(data) == faults.MAX_DATAGRAM < SAFE_DATAGRAM
    got = Summary.unpack(token, data)
    assert got == everyone_silent and got.silent_count == 100_000 and got.truncated
    assert got.why().endswith(f"and {100_000 - faults.SUMMARY_RANKS} more silent")
    behind = {r: faults.Peer(0.1, 7 if r % 2 else 9, False) for r in range(100_000)}
    assert len(faults.summarize(behind, silence_s=1).pack(token)) < faults.MAX_DATAGRAM
    assert len(faults.pack_heartbeat(token, 2**32 - 1, 2**64 - 1, True)) < 32
    # Another job's datagram is not this job's summary or heartbeat.
    assert Summary.unpack(b"\x02" * faults.TOKEN_BYTES, data) is None
    assert faults.unpack_heartbeat(token, data, 100_000) is None
