"""Free ports for tritonserver (clover.serving.server): distinct, whatever the system hands out."""

from __future__ import annotations

from pathlib import Path

import clover.serving.server as server_module
from clover.serving.server import TritonInstall, TritonServer, free_ports


def test_free_ports_are_distinct_and_avoid_the_given_ones():
    first = free_ports(1)[0]
    ports = free_ports(64, avoid=(first,))
    assert len(set(ports)) == 64 and first not in ports


class _RepeatingSocket:
    """A socket whose bind hands out the next port of a script: 5000 twice, as a system may for a port just
    released (what made three one-at-a-time picks collide and tritonserver refuse to start)."""

    script = iter(())

    def __init__(self, *args) -> None:
        self.port = None

    def bind(self, address) -> None:
        self.port = next(_RepeatingSocket.script)

    def getsockname(self):
        return ("127.0.0.1", self.port)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_a_server_asked_for_any_ports_gets_three_distinct_ones(monkeypatch, tmp_path):
    monkeypatch.setattr(_RepeatingSocket, "script", iter([5000, 5000, 8001, 5001, 5002]))
    monkeypatch.setattr(server_module.socket, "socket", _RepeatingSocket)
    server = TritonServer(tmp_path, http_port=0, grpc_port=0, metrics_port=0,
                          install=TritonInstall(Path("/bin/true"), "PATH"))
    assert [server.http_port, server.grpc_port, server.metrics_port] == [5000, 8001, 5001]
    monkeypatch.setattr(_RepeatingSocket, "script", iter([8001, 5003]))
    server = TritonServer(tmp_path, http_port=8000, grpc_port=8001, metrics_port=0,
                          install=TritonInstall(Path("/bin/true"), "PATH"))
    assert server.metrics_port == 5003  # not the grpc port asked for
