"""This agent's data port: bulk bytes on plain TCP connections, each let in by
a one-use ticket handed out over gRPC (where the token was checked). The
protocol is in ``remote_tpu/_core/data_wire.py``.

A connection that brings no known ticket within ``_HELLO_SECONDS`` is closed; at
most ``MAX_CONNECTIONS`` are served at once and ``MAX_TICKETS`` wait, each for
``TICKET_SECONDS``: beyond them a sender is told to use gRPC. A lane (a warm
session's connection, ``wire.peer_lane``, ``wire.caller_lane``) stays open between calls: lanes
are counted apart, at most ``MAX_LANES``, and take none of the transfers' room.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from remote_tpu._core import data_wire

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
MAX_LANES = 256
MAX_TICKETS = 1024
TICKET_SECONDS = 60.0
_HELLO_SECONDS = 10.0

Handler = Callable[[socket.socket], bytes]     # serves one connection: its reply


class DataPort:
    def __init__(self, host: str, port: int = 0) -> None:
        host = host or "::"                  # every address, as gRPC takes it
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dual = host == "::" and socket.has_dualstack_ipv6()
        self._listener = socket.create_server((host, port), family=family,
                                              dualstack_ipv6=dual, backlog=128)
        self.port = self._listener.getsockname()[1]
        self.nonce = os.urandom(data_wire.NONCE_SIZE)
        self._lock = threading.Lock()
        self._tickets: dict[bytes, tuple[float, Handler, bool]] = {}
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.lanes = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="data-port").start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)     # wakes the accept (Linux)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass

    def issue(self, handler: Handler, lane: bool = False) -> bytes | None:
        """A ticket for one connection, which ``handler`` serves (``lane``: for
        as long as it likes); None when too many wait already (the sender then
        uses gRPC)."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, (expiry, *_) in self._tickets.items() if expiry < now]:
                del self._tickets[key]
            if len(self._tickets) >= MAX_TICKETS:
                return None
            ticket = os.urandom(data_wire.TICKET_SIZE)
            self._tickets[ticket] = (now + TICKET_SECONDS, handler, lane)
            return ticket

    def _take(self, ticket: bytes) -> tuple[Handler, bool] | None:
        with self._lock:
            entry = self._tickets.pop(ticket, None)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1], entry[2]

    def _as_lane(self) -> bool:
        """A lane's connection leaves the transfers' room for the lanes' own;
        False when that is full."""
        with self._lock:
            if self.lanes >= MAX_LANES:
                return False
            self.lanes += 1
        self._slots.release()
        return True

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()             # too many at once: the sender falls back to gRPC
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="data-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        lane = False
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(_HELLO_SECONDS)
                conn.sendall(data_wire.MAGIC + self.nonce)
                taken = self._take(data_wire.recv_exact(conn, data_wire.TICKET_SIZE,
                                                        within=_HELLO_SECONDS))
                if taken is None:
                    return
                handler, lane = taken
                if lane and not self._as_lane():
                    lane = False
                    log.warning("%d lanes are open already: one more is refused (its calls "
                                "go on gRPC)", MAX_LANES)
                    return
                conn.settimeout(data_wire.IO_TIMEOUT)
                reply = handler(conn)
                if not lane:
                    data_wire.send_reply(conn, reply)
        except OSError as exc:          # the sender went away: its own side reports it
            log.debug("data port connection ended: %s", exc)
        except Exception:  # noqa: BLE001 - one connection's bug must not end the port
            log.exception("data port connection failed")
        finally:
            if lane:
                with self._lock:
                    self.lanes -= 1
            else:
                self._slots.release()
