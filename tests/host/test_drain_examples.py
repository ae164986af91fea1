"""The shipped drain examples (etc/charly-arbiter/drains.toml, ollama-unload), run for real.

Neither Ollama nor a model can be installed here, so each example runs
against a stand-in: a real HTTP server process speaking the part of the API
the example uses.  The Ollama stand-in answers `GET /api/ps` and `POST
/api/generate` as Ollama's API documents them, and holds each loaded model in
a runner process of its own that has the GPU's node open, as Ollama's runners
hold /dev/nvidia*; `keep_alive: 0` ends the runner.  The generic one answers
`POST /unload` and `GET /health`.  The holders are simulated (`sim:DIR`); the
commands, the servers, the runners and the node scan are real.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from simhosts import audio, gpu, holder, host

from charly_arbiter.compose import open_host
from charly_arbiter.core.config import load_config
from charly_arbiter.core.host import TokenSpec

REPO = Path(__file__).resolve().parents[2]
UNLOAD = REPO / "etc" / "charly-arbiter" / "ollama-unload"
EXAMPLES = REPO / "etc" / "charly-arbiter" / "drains.toml"
STANDIN = r"""
import json, subprocess, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

node, log, models = sys.argv[1], open(sys.argv[2], "a"), sys.argv[3:]
runners = {}
lock = threading.Lock()

def load(name):
    if name not in runners:
        runner = subprocess.Popen(["/bin/sleep", "600"], stdin=open(node, "rb"))
        runners[name] = runner

def unload(name):
    runner = runners.pop(name, None)
    if runner is not None:
        runner.kill()
        runner.wait()

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, document):
        body = json.dumps(document).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        log.write(f"GET {self.path}\n"); log.flush()
        with lock:
            if self.path == "/api/ps":
                self.reply({"models": [{"name": n, "model": n} for n in sorted(runners)]})
            elif self.path in ("/api/version", "/health"):
                self.reply({"version": "stand-in"})
            else:
                self.send_error(404)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)) or 0)
        log.write(f"POST {self.path} {body.decode()}\n"); log.flush()
        with lock:
            if self.path == "/api/generate":
                request = json.loads(body)
                if request.get("keep_alive") == 0:
                    unload(request["model"])
                    self.reply({"model": request["model"], "done": True, "done_reason": "unload"})
                else:
                    load(request["model"])
                    self.reply({"model": request["model"], "done": True})
            elif self.path == "/unload":
                for name in list(runners):
                    unload(name)
                self.reply({"unloaded": True})
            else:
                self.send_error(404)

for name in models:
    load(name)
server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
try:
    server.serve_forever()
finally:
    for name in list(runners):
        unload(name)
"""


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    started: list[subprocess.Popen[str]] = []

    def start(node: Path, *models: str) -> tuple[str, Path]:
        log = tmp_path / f"requests-{len(started)}.log"
        server = subprocess.Popen(
            [sys.executable, "-c", STANDIN, str(node), str(log), *models],
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(server)
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        return f"http://127.0.0.1:{port}", log

    yield start
    for server in started:
        server.terminate()
        server.wait(timeout=10)


def holders_of(node: Path) -> list[int]:
    found = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if fd.readlink() == node:
                found.append(int(fd.parts[2]))
        except OSError:
            continue
    return found


def test_ollama_unload_unloads_every_model_with_keep_alive_0(tmp_path: Path, standin) -> None:
    node = tmp_path / "nvidia0"
    node.touch()
    url, log = standin(node, "llama3.2:latest", "qwen2.5:7b")
    assert len(holders_of(node)) == 2
    result = subprocess.run(
        [str(UNLOAD), "--wait", "10", url], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["unloading llama3.2:latest", "unloading qwen2.5:7b"]
    posts = [
        json.loads(line.split(" ", 2)[2])
        for line in log.read_text().splitlines()
        if line.startswith("POST")
    ]
    assert posts == [
        {"model": "llama3.2:latest", "keep_alive": 0},
        {"model": "qwen2.5:7b", "keep_alive": 0},
    ]
    assert holders_of(node) == []
    unreachable = subprocess.run(
        [str(UNLOAD), "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60
    )
    assert unreachable.returncode == 1 and "ollama-unload: http://127.0.0.1:9" in unreachable.stderr


def examples(**urls: str) -> str:
    """drains.toml with every example enabled, its URLs pointed at the stand-ins."""
    text = re.sub(r"(?m)^#(?=[a-z_\[])", "", EXAMPLES.read_text())
    text = text.replace("/usr/libexec/charly-arbiter/ollama-unload", str(UNLOAD))
    text = text.replace("http://127.0.0.1:11434", urls["ollama"])
    return text.replace("http://127.0.0.1:8000", urls["generic"])


def test_the_examples_drain_in_place_and_before_a_stop(make_sim, tmp_path: Path, standin) -> None:
    sim = make_sim(
        host=host(
            gpu("0000:0a:00.0", group=12, extra='nodes = ["nvidia0"]'),
            audio("0000:0a:00.1", group=12),
            holder("systemd", "ollama.service", ["gpu0"], preemptible=True),
            holder("container", "inference", ["gpu0"], preemptible=True),
        )
    )
    (sim.sim_dir / "dev").mkdir()
    node = sim.sim_dir / "dev" / "nvidia0"
    node.touch()
    ollama, ollama_log = standin(node, "llama3.2")
    generic, generic_log = standin(tmp_path / "unused")
    config_text = sim.config_path.read_text() + examples(ollama=ollama, generic=generic)
    sim.config_path.write_text(config_text.replace("[timeouts]", "[timeouts]\nholder_drain = 10"))
    config = load_config(sim.config_path, environ={})
    machine = open_host(config)
    spec = TokenSpec("gpu0", "0000:0a:00.0", tuple(machine.token_functions("gpu0", "0000:0a:00.0")))
    assert [user.pid for user in machine.device_users([spec])] != []

    # Ollama: drained in place.  Its runner exits, the server stays.
    machine.stop("systemd:ollama.service")
    assert machine.device_users([spec]) == []
    assert not machine.is_running("systemd:ollama.service")
    assert sim.host().is_running("systemd:ollama.service"), "a drained holder was stopped"
    machine.start("systemd:ollama.service")
    assert machine.is_running("systemd:ollama.service")
    assert len(machine.device_users([spec])) == 1, "ready did not load the model again"
    requests = ollama_log.read_text()
    assert '"keep_alive": 0' in requests and '{"model": "llama3.2"}' in requests

    # The generic server: asked to unload, then stopped; ready asks for its health.
    machine.stop("container:inference")
    assert generic_log.read_text().splitlines()[-1].startswith("POST /unload")
    assert not sim.host().is_running("container:inference")
    machine.start("container:inference")
    assert sim.host().is_running("container:inference")
    assert generic_log.read_text().splitlines()[-1] == "GET /health"
