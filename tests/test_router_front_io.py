"""The dp front on uvicorn in this process, in front of fake replicas (plain sockets on
127.0.0.1): what it reads from clients and what a client hanging up does to the replica."""

from __future__ import annotations

import socket
import socketserver
import threading
import time

import httpx
import pytest
import uvicorn

from engine.builtins.routing_policies import RoundRobin
from engine.net import free_port
from engine.router.front import Router, build_front_app
from engine.router.policy import RouterOptions
from engine.router.replicas import ReplicaSet


class FakeReplica(socketserver.ThreadingTCPServer):
    """Reads one HTTP request per connection, then answers ``answer`` (bytes; and hangs up,
    unless ``hold``), and records when the front closes a connection it holds."""

    daemon_threads = allow_reuse_address = True

    def __init__(self, answer: bytes = b"", hold: bool = False):
        self.answer, self.requests, self.closed = answer, [], threading.Event()

        class Handler(socketserver.BaseRequestHandler):
            def handle(inner):
                conn, data = inner.request, b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, body = data.split(b"\r\n\r\n", 1)
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    body += conn.recv(65536)
                self.requests.append((head, body))
                conn.sendall(self.answer)
                if not hold:
                    return
                conn.settimeout(30)
                try:
                    if conn.recv(1) == b"":
                        self.closed.set()
                except OSError:
                    pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server_address[1]


@pytest.fixture
def front():
    """start(replica, **router kwargs) -> the front's URL, serving until the test ends."""
    servers = []

    def start(replica: FakeReplica, **kwargs) -> str:
        replicas = ReplicaSet(1, [])
        replicas.replicas[0].port = replica.port
        router = Router(replicas, RoundRobin(RouterOptions(1)), RouterOptions(1), "round_robin",
                        None, **kwargs)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(build_front_app(router, "127.0.0.1", port),
                                               host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="on"))
        threading.Thread(target=server.run, daemon=True).start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the front did not start"
            time.sleep(0.02)
        servers.append(server)
        return f"http://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.should_exit = True


OK = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n"
      b"connection: close\r\n\r\n{\"ok\": true}")


def test_the_front_refuses_a_body_past_max_request_bytes(front):
    replica = FakeReplica(OK)
    url = front(replica, max_request_bytes=1000)
    small = httpx.post(url + "/generate", json={"text": "x" * 900}, timeout=10)
    assert small.status_code == 200 and small.json() == {"ok": True}
    big = httpx.post(url + "/generate", json={"text": "x" * 5000}, timeout=10)
    assert big.status_code == 413, big.text
    error = big.json()["error"]
    assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]
    assert "--max-request-bytes" in error["message"]
    # far past the limit (no content-length read at all): refused as well
    huge = httpx.post(url + "/v1/completions", content=b"x" * 100_000,
                      headers={"content-type": "application/json"}, timeout=10)
    assert huge.status_code == 413
    assert len(replica.requests) == 1  # only the small one reached the replica


def test_a_client_hanging_up_closes_its_request_on_the_replica(front):
    replica = FakeReplica(hold=True)  # generates forever
    url = front(replica)
    port = int(url.rsplit(":", 1)[1])
    body = b'{"prompt": "hello", "max_tokens": 100000}'
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                       b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while not replica.requests:  # the replica is working on it
            assert time.monotonic() < deadline
            time.sleep(0.02)
    # the client is gone: the front must close its connection to the replica, whose
    # disconnect detection then aborts the request
    assert replica.closed.wait(10), "the replica still holds the request of a gone client"
    assert replica.requests[0][1] == body


def test_a_streaming_client_hanging_up_closes_its_request_on_the_replica(front):
    replica = FakeReplica(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                          b"transfer-encoding: chunked\r\n\r\n"
                          b"10\r\ndata: {\"a\": 1}\n\n\r\n", hold=True)
    url = front(replica)
    with httpx.stream("POST", url + "/generate", json={"text": "hi", "stream": True},
                      timeout=10) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()) == 'data: {"a": 1}'
    assert replica.closed.wait(10), "the replica still streams to a gone client"
