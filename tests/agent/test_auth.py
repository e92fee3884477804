"""Only callers with the slice's token get anything from an agent: not a run,
not its health, not a data-port ticket; and a refused caller is told at once,
not retried. The agents are servicers in this process (``servicers``)."""

from __future__ import annotations

import os
import socket
import time

import grpc
import pytest

import remote_tpu
from raw_calls import blob_ticket, marking, marks
from remote_tpu._core import data_wire, digests
from remote_tpu._core.data_wire import send_frame
from remote_tpu._core.auth import new_token
from remote_tpu._core.channels import Credentials, health, stub
from remote_tpu._core.limits import CHUNK_SIZE
from remote_tpu._core.proto import remote_tpu_pb2 as pb
from remote_tpu_agent.wire import peer_link as _peer_link
from remote_tpu_agent.wire.peer_link import GatewayLink


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789", "other"])
def test_client_without_the_slice_token_is_refused_and_nothing_runs(servicers, tmp_path, token):
    if token == "other":
        token = new_token()           # a valid token, of another slice
    f = marking(tmp_path, accelerator="tpu-v4-16", hosts=servicers.addresses[0], token=token)
    with pytest.raises(remote_tpu.AuthenticationError) as info:
        f()
    msg = str(info.value)
    assert "refused this client's credentials" in msg and "REMOTE_TPU_TOKEN" in msg
    assert "remote-tpu-agent token init" in msg
    assert marks(tmp_path) == []


def test_health_needs_the_token_too(servicers):
    address = servicers.addresses[0]
    anonymous = Credentials()
    with pytest.raises(remote_tpu.AuthenticationError):
        health(address, anonymous)


def test_a_refusal_is_not_retried(servicer_factory, capsys):
    agents = servicer_factory(1)

    @remote_tpu.run(accelerator="tpu-v5litepod-4", hosts=agents.addresses[0],
                    token=new_token())                     # not the agent's token
    def f():
        return 1

    for attempt in (f, f.submit):
        start = time.monotonic()
        with pytest.raises(remote_tpu.AuthenticationError):
            attempt()
        assert time.monotonic() - start < 5
    assert "remote_tpu: no agent answered at" not in capsys.readouterr().err   # no retry


def test_a_connection_without_a_ticket_is_greeted_and_closed(servicers):
    ticket = blob_ticket(servicers, CHUNK_SIZE)
    assert ticket.port and len(ticket.nonce) == data_wire.NONCE_SIZE
    with socket.create_connection(("127.0.0.1", ticket.port), timeout=10) as s:
        greeting = data_wire.recv_exact(s, len(data_wire.MAGIC) + data_wire.NONCE_SIZE)
        assert greeting == data_wire.MAGIC + ticket.nonce
        s.sendall(os.urandom(data_wire.TICKET_SIZE) + b"x" * 1000)
        try:
            answer = s.recv(1)
        except ConnectionResetError:               # closed with our bytes unread
            answer = b""
        assert answer == b""                       # closed, nothing answered


def test_a_ticket_lets_in_one_connection_only(servicers):
    data = os.urandom(CHUNK_SIZE + 5)
    ticket = blob_ticket(servicers, len(data), digests.of(data))

    def send():
        s = data_wire.connect(servicers.addresses[0], ticket.port, ticket.nonce)
        s.sendall(ticket.ticket)
        return s
    with send() as s:
        s.sendall(data)
        assert pb.BlobStored.FromString(data_wire.read_reply(s)).refused == ""
    with send() as s:                              # the same ticket again
        with pytest.raises(ConnectionError):       # closed: a reset, or no reply
            s.sendall(data)
            data_wire.read_reply(s)


def test_a_corrupted_buffer_is_refused_and_the_sender_reads_why(servicers):
    data = os.urandom(2 * CHUNK_SIZE)
    ticket = blob_ticket(servicers, len(data), digests.of(b"something else"))
    with data_wire.connect(servicers.addresses[0], ticket.port, ticket.nonce) as s:
        s.sendall(ticket.ticket + data)
        stored = pb.BlobStored.FromString(data_wire.read_reply(s))
    assert "does not match its xxh3-128 digest" in stored.refused


def test_tickets_are_only_for_callers_with_the_token(servicers):
    with pytest.raises(grpc.RpcError) as err:
        stub(servicers.addresses[0], Credentials()).OpenBlob(
            pb.BlobChunk(blob=pb.BlobRef(digest=bytes(16), size=1)), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
def test_a_connection_that_dribbles_no_ticket_is_closed(servicers):
    """Someone without the token cannot hold the port's connections by sending
    a byte now and then: the ticket must come whole within 10 s."""
    port = blob_ticket(servicers, CHUNK_SIZE).port
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        data_wire.recv_exact(s, len(data_wire.MAGIC) + data_wire.NONCE_SIZE)
        s.settimeout(2)
        closed = False
        while not closed and time.monotonic() - start < 30:
            try:
                s.sendall(b"x")              # one byte of the ticket every 2 s
                closed = s.recv(1) == b""
            except socket.timeout:
                continue
            except ConnectionError:
                closed = True
    assert closed and time.monotonic() - start < 15


def test_a_link_is_only_for_callers_with_the_token_and_its_ticket_opens_one(servicers):
    with pytest.raises(grpc.RpcError) as err:
        stub(servicers.addresses[1], Credentials()).OpenLink(pb.LinkRequest(), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    creds = Credentials(token=servicers.token)
    ticket = stub(servicers.addresses[1], creds).OpenLink(pb.LinkRequest(), timeout=30,
                                                           metadata=creds.metadata)
    assert ticket.port == servicers.data_ports[1]
    link = GatewayLink(servicers.addresses[1],
                       _peer_link.connect(servicers.addresses[1], ticket, 5), 10.0)
    assert link.ask_health()(10).versions.remote_tpu == remote_tpu.__version__
    again = data_wire.connect(servicers.addresses[1], ticket.port, ticket.nonce)
    again.sendall(ticket.ticket)                       # the same ticket, once more:
    send_frame(again, _peer_link.HEALTH, bytes(4))
    again.settimeout(15)
    try:
        assert again.recv(1) == b""                    # closed, nothing answered
    except ConnectionResetError:                       # (or reset: what it sent went unread)
        pass
    again.close()
    link.close()
