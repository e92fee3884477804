"""The floor for ``scale.py``: the least a trivial call to N local hosts can
take on this machine when, as in any local slice, each host is its own
processes and all of them share this machine's CPUs.

This process plays the gateway. Each host is a relay process (the agent)
with one pre-started worker process. A call sends 8 bytes on TCP to every
relay; the relay writes them to its worker's pipe, the worker answers on
its pipe, and the relay sends the answer back. Cold, the worker exits once
it has answered (a cold call's worker lives for one call), and the relay
starts the next one when told to, after the call and outside the timing.
The gateway waits for every host's answer. Nothing else: no pickling, no job
records, no output capture, no Python beyond a read and a write per process.
"""

from __future__ import annotations

import selectors
import socket
import statistics
import subprocess
import sys
import time

from _quiet import wait_quiet

_WORKER = """
import os, sys
data = os.read(0, 64)
while data:
    os.write(1, data)
    if sys.argv[1] == "cold":
        os._exit(0)
    data = os.read(0, 64)
"""

_RELAY = """
import os, socket, subprocess, sys
gateway = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
gateway.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
mode, code = sys.argv[2], sys.argv[3]
def start():
    return subprocess.Popen([sys.executable, "-S", "-c", code, mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
worker = start()
def receive():
    data = b""
    while len(data) < 8:
        more = gateway.recv(8 - len(data))
        if not more:
            return b""
        data += more
    return data
while True:
    call = receive()
    if not call:
        break
    if call == b"next0000":          # (cold: between calls, outside the timing)
        worker.wait()
        worker = start()
        continue
    os.write(worker.stdin.fileno(), call)
    answer = os.read(worker.stdout.fileno(), 64)
    if not answer:               # the worker died: the gateway sees this relay end
        break
    gateway.sendall(answer)
worker.kill()
"""


def floor(hosts: int, mode: str, calls: int) -> float:
    """The median time of ``calls`` trivial calls to ``hosts`` relay-and-
    worker pairs, ``mode`` "cold" (each worker exits after its call; the
    machine quiet before each) or "warm" (the workers stay)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=hosts)
    port = listener.getsockname()[1]
    relays = [subprocess.Popen([sys.executable, "-S", "-c", _RELAY, str(port), mode, _WORKER])
              for _ in range(hosts)]
    conns, selector = [], selectors.DefaultSelector()
    try:
        listener.settimeout(60)
        for _ in range(hosts):
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conns.append(conn)
            selector.register(conn, selectors.EVENT_READ)
        samples = []
        for n in range(calls + 2):             # (the first two not counted)
            if mode == "cold":
                wait_quiet()
            start = time.perf_counter()
            for conn in conns:
                conn.sendall(b"call%04d" % (n % 10000))
            left = hosts
            while left:
                ready = selector.select(timeout=30)
                if not ready:
                    raise RuntimeError(f"{left} of the floor's {hosts} hosts did not "
                                       "answer within 30 s")
                for key, _ in ready:
                    if not key.fileobj.recv(64):
                        raise RuntimeError("a relay of the floor ended")
                    left -= 1
            samples.append(time.perf_counter() - start)
            if mode == "cold":
                for conn in conns:
                    conn.sendall(b"next0000")
        return statistics.median(samples[2:])
    finally:
        for conn in conns:
            conn.close()
        listener.close()
        for relay in relays:
            try:
                relay.wait(timeout=10)
            except subprocess.TimeoutExpired:
                relay.kill()
                relay.wait()
