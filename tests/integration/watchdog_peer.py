"""One rank's watchdog, or rank 0's address choice, for tests/integration/test_watchdog_hosts.py,
which runs it inside a network namespace (a "host").

usage:
  watchdog_peer.py chief SIZE                       rank 0: prints "contact HOST PORT TOKEN", steps
                                                    until SIGUSR1 (then waits, as if in a
                                                    collective) and prints "stall MESSAGE"
  watchdog_peer.py rank RANK SIZE HOST PORT TOKEN   another rank: steps until it is stopped
  watchdog_peer.py address ENVIRONS_JSON            prints JSON: rank 0's address for each
                                                    environment, and the old rule's choice

Ranks print "traffic received=R ignored=I sent=S send_failures=F" every half second. The contact
passes on the command line what `_start_watchdog` broadcasts.
"""

import json
import logging
import signal
import socket
import sys
import threading
import time

from hvd_train.core import faults
from hvd_train.core.environment import LauncherEnvironmentError

HEARTBEAT_S = 0.1
RULE = faults.StallRule(floor_s=1.0, factor=5.0, startup_s=30.0)


def report(dog):
    t = dog.traffic
    print(
        f"traffic received={t.received} ignored={t.ignored} sent={t.sent} "
        f"send_failures={t.send_failures}",
        flush=True,
    )


def run_rank(rank, size, sock, contact, blocked):
    stalls = []
    dog = faults.Watchdog(rank, size, sock, contact, RULE, HEARTBEAT_S, on_stall=stalls.append)
    dog.phase("train")
    next_report = 0.0
    while not stalls:
        if not blocked.is_set():
            dog.step_done()
        if time.monotonic() >= next_report:
            report(dog)
            next_report = time.monotonic() + 0.5
        time.sleep(0.02)
    report(dog)
    print("stall", stalls[0], flush=True)
    dog.close()


def main(argv):
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    mode = argv[0]
    if mode == "address":
        chosen = []
        for environ in json.loads(argv[1]):
            try:
                chosen.append(list(faults.chief_address(environ, spans_hosts=True)))
            except LauncherEnvironmentError as err:
                chosen.append(["error", str(err)])
        old = socket.gethostbyname(socket.gethostname())  # the rule before chief_address
        print(json.dumps({"chosen": chosen, "old": old}), flush=True)
        return
    blocked = threading.Event()
    if mode == "chief":
        size = int(argv[1])
        sock, contact = faults.open_socket(0, spans_hosts=True)
        signal.signal(signal.SIGUSR1, lambda *_: blocked.set())
        print("contact", contact.host, contact.port, contact.token.hex(), flush=True)
        run_rank(0, size, sock, contact, blocked)
    else:
        rank, size, host, port, token = argv[1:6]
        sock, _ = faults.open_socket(int(rank), spans_hosts=True)
        contact = faults.Contact(host, int(port), bytes.fromhex(token))
        run_rank(int(rank), int(size), sock, contact, blocked)


if __name__ == "__main__":
    main(sys.argv[1:])
