"""The real server as operators run it: `vllm-dspark serve` (multiprocess engine, HTTP),
with completions, streamed chat, bad per-request fields, a client that drops its stream
and a `/metrics` scrape. The server must keep answering and log no traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DRAFTER = REPO / "examples" / "drafters" / "smollm2-dspark-b7"
PLUGIN = {"vllm_dspark": {"policy": "sla", "sps_table": [[1, 11.9], [16, 6.8], [64, 3.2]], "min_tokens_per_s": 1.0,
                          "log_interval_s": 2}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(port: int, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return response.read().decode()


@pytest.fixture(scope="module")
def server(smollm2_target, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # as operators run it (conftest sets 0)
    command = [sys.executable, "-m", "vllm_dspark.cli", "serve", str(smollm2_target), "--served-model-name", "smollm2",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
               "--speculative-config", json.dumps({"method": "vllm_dspark", "model": str(DRAFTER), "num_speculative_tokens": 7}),
               "--additional-config", json.dumps(PLUGIN)]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            deadline = time.monotonic() + 400
            while True:
                if process.poll() is not None:
                    pytest.fail(f"server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
                try:
                    if get(port, "/health") is not None:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"server did not start:\n{log.read_text()[-4000:]}")
                time.sleep(2)
            yield port, log
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def completion(port: int, **extra) -> tuple[int, dict]:
    body = {"model": "smollm2", "prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0.0, **extra}
    return post(port, "/v1/completions", body)


def test_server_survives_bad_requests_and_dropped_streams(server):
    port, log = server
    status, first = completion(port)
    assert status == 200 and first["choices"][0]["text"]
    # Bad per-request speed floors: each answered (the default floor is used, with a
    # warning), none kills the engine.
    for bad in ["abc", None, -1, "nan", "inf", [1, 2], {"x": 1}]:
        status, body = completion(port, vllm_xargs={"dspark_min_tokens_per_s": bad})
        assert status in (200, 400), (bad, status, body)
    status, body = post(port, "/v1/chat/completions", {"model": "smollm2", "max_tokens": 16, "temperature": 0.7, "seed": 1,
                                                       "messages": [{"role": "user", "content": "Name three colours."}]})
    assert status == 200 and body["choices"][0]["message"]["content"]
    # A streaming client that goes away after the first chunks.
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps({"model": "smollm2", "max_tokens": 200, "stream": True,
                    "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}]}).encode(),
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        for _ in range(3):
            assert response.readline()
    # Still answering, with the same greedy text as before.
    status, again = completion(port)
    assert status == 200 and again["choices"][0]["text"] == first["choices"][0]["text"]
    time.sleep(3)  # one stats message after the engine went idle
    metrics = get(port, "/metrics")
    assert 'vllm_dspark_verified_draft_tokens_total{engine="0",policy="sla"}' in metrics
    assert "vllm_dspark_source_draft_tokens_total" in metrics
    text = log.read_text()
    assert "Traceback" not in text, text[text.find("Traceback") - 2000:][:6000]
