"""A real S3 server on 127.0.0.1 for the object-storage tests: moto's server mode (what s3fs's own
tests use), started on a free port, stopped at the end (the fixture asserts that nothing is left
running or listening).

The clients reach it through `Endpoint`, a loopback TCP relay on a port of its own that stays the
same when the server behind it is restarted (`S3Server.restart`: moto keeps its objects in memory, so
the new server is given them back by moto's recorder, which replays every request the old one was
sent, before clients are let in again), or that the tests take down and bring back on its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import pytest

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/moto-api/", timeout=1):
            return True
    except OSError:
        return False


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


@dataclass
class Endpoint:
    """Accepts on `port` and relays each connection to `target` until `stop()`; `start()` again."""
    port: int
    target: int
    _server: socket.socket | None = None
    _open: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((HOST, self.port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def stop(self) -> None:
        """Refuse new connections and cut the open ones (a client sees refused / reset)."""
        server, self._server = self._server, None
        if server is not None:
            try:  # wakes the accept() blocked in the relay's thread (close alone would leave it listening)
                server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            server.close()
        with self._lock:
            for s in self._open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._open.clear()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:  # closed by stop()
                return
            try:
                upstream = socket.create_connection((HOST, self.target))
            except OSError:  # moto is gone (the fixture's end): the client sees its connection closed
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    # Tests may watch the traffic: called with (src, dst, data) for the first bytes of each direction
    # of each connection (the client opens a connection per request).
    first_bytes: ClassVar[Callable[[socket.socket, socket.socket, bytes], None] | None] = None

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        first = True
        try:
            while data := src.recv(65536):
                if first and self.first_bytes is not None:
                    self.first_bytes(src, dst, data)
                first = False
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def start_moto(recording: Path) -> tuple[subprocess.Popen, int]:
    """moto's server on a free loopback port, recording every request it is sent into `recording`
    (moto's recorder), so that a restarted server can be given back its objects."""
    port = free_port()
    env = {**os.environ, "MOTO_ENABLE_RECORDING": "1", "MOTO_RECORDER_FILEPATH": str(recording)}
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 30
    while not answers(port):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"moto's S3 server did not start on {HOST}:{port}")
        time.sleep(0.05)
    return process, port


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=3)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass
class S3Server:
    process: subprocess.Popen
    moto_port: int
    endpoint: Endpoint
    recording: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.endpoint.port}"

    def restart(self) -> None:
        """Stop the server (clients are refused from now on), start a new one, give it back every
        object (moto's recorder replays the requests the old one was sent), then let clients in."""
        self.endpoint.stop()
        stop(self.process)
        self.process, self.moto_port = start_moto(self.recording)
        with urllib.request.urlopen(urllib.request.Request(
                f"http://{HOST}:{self.moto_port}/moto-api/recorder/replay-recording", method="POST")):
            pass
        self.endpoint.target = self.moto_port
        self.endpoint.start()


@pytest.fixture
def s3_server(tmp_path, monkeypatch):
    """A running S3 server; the environment (this process's and its children's) points every S3
    client at it, with test credentials and a cache folder of the test's own."""
    recording = tmp_path / "moto-recording"
    process, port = start_moto(recording)
    endpoint = Endpoint(free_port(), port)
    endpoint.start()
    server = S3Server(process, port, endpoint, recording)
    env = {"AWS_ENDPOINT_URL": server.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
           "PAN_DATA_CACHE": str(tmp_path / "storage-cache")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    try:
        yield server
    finally:
        endpoint.stop()
        stop(server.process)
    assert server.process.poll() is not None and not listening(server.moto_port) and not listening(endpoint.port), \
        "the S3 server is still running"
