"""The real `tarn` binary as a process for tests: started on ephemeral
loopback ports, stopped by its PID. Shared by tests/ and e2e/ (which has no
boto3: `client()` imports it when called)."""

import json
import os
import re
import ssl
import signal
import subprocess
import time
import urllib.request

ACCESS_KEY = "tarnadmin"
SECRET_KEY = "tarnadmin-secret"
BIN = os.environ.get("TARN_BIN") or os.path.expanduser("~/.cache/tarn-target/debug/tarn")


class Server:
    def __init__(self, root, drives=4, extra_args=(), env=None, expected_errors=(), cores=2, nofile=None, ca=None):
        self.root = root
        # The CA bundle clients trust when the server serves TLS.
        self.ca = ca
        self.cores = cores
        # (soft, hard) open-files limits to start the server under.
        self.nofile = nofile
        self.drives = [os.path.join(root, f"d{i}") for i in range(drives)]
        self.extra_args = list(extra_args)
        self.env = env
        self.expected_errors = [re.compile(p) for p in expected_errors]
        self.proc = None
        self.logs = []
        self.start()

    def start(self):
        args = [BIN, "server", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--cores", str(self.cores)]
        for d in self.drives:
            args += ["--drive", d]
        args += self.extra_args
        env = dict(os.environ)
        env.pop("TARN_ACCESS_KEY", None)
        env.pop("TARN_SECRET_KEY", None)
        env.setdefault("TARN_LOG", "info")
        env["NO_COLOR"] = "1"
        if self.env:
            env.update(self.env)
        log_path = os.path.join(self.root, f"server-{len(self.logs)}.log")
        self.logs.append(log_path)
        self.log = open(log_path, "w")
        limit = None
        if self.nofile:
            import resource

            def limit(n=self.nofile):
                resource.setrlimit(resource.RLIMIT_NOFILE, n)
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=self.root, env=env,
                                     preexec_fn=limit)
        self.endpoint = self.admin = self.kv_endpoint = None
        deadline = time.time() + 30
        while time.time() < deadline and (self.endpoint is None or self.admin is None):
            line = self.proc.stdout.readline()
            if not line:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tarn exited with {self.proc.returncode}: {open(log_path).read()}")
                continue
            m = re.match(r"S3 endpoint: (https?://\S+)", line)
            if m:
                self.endpoint = m.group(1)
            m = re.match(r"Admin endpoint: (https?://\S+)", line)
            if m:
                self.admin = m.group(1)
            m = re.match(r"KV endpoint: (\S+)", line)
            if m:
                self.kv_endpoint = m.group(1)
                # A restart listens where clients already point.
                if "--kv-listen" in self.extra_args:
                    i = self.extra_args.index("--kv-listen")
                    self.extra_args[i + 1] = self.kv_endpoint
        if self.endpoint is None:
            self.kill()
            raise RuntimeError("tarn did not print its endpoint")

    def stop(self, timeout=40):
        """SIGTERM, then wait; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("tarn did not stop within the grace period after SIGTERM")
        finally:
            self.log.close()

    def kill(self):
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        try:
            self.log.close()
        except Exception:
            pass

    def restart(self):
        self.stop()
        self.start()

    def unexpected_errors(self):
        bad = []
        for path in self.logs:
            for line in open(path, errors="replace"):
                if " ERROR " in line and not any(p.search(line) for p in self.expected_errors):
                    bad.append(line.rstrip())
        return bad

    def client(self, key=None, **config):
        """A boto3 client signing as root, or as the user whose `key`
        (`add_user`'s answer) is given."""
        import boto3
        import botocore.config

        cfg = botocore.config.Config(retries={"max_attempts": 1, "mode": "standard"}, **config)
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=key["access_key"] if key else ACCESS_KEY,
            aws_secret_access_key=key["secret_key"] if key else SECRET_KEY,
            region_name="us-east-1",
            config=cfg,
            verify=self.ca,
        )


def kv_server(tmp_path, extra_args):
    """A one-drive server with the KV store under `tmp_path/tarn`, for a
    pytest fixture to `yield from`: stopped by its PID afterwards, and no
    unexpected error in its log."""
    root = tmp_path / "tarn"
    root.mkdir()
    s = Server(str(root), drives=1, extra_args=list(extra_args))
    yield s
    s.stop()
    assert not s.unexpected_errors()


def admin(server, *args, check=True):
    """`tarn admin` against `server` with the root token."""
    tls = ["--ca-bundle", server.ca] if server.ca else []
    r = subprocess.run(
        [BIN, "admin", "--endpoint", server.admin, "--token", SECRET_KEY, *tls, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert r.returncode == 0, f"tarn admin {args}: {r.stderr}"
    return r


def add_user(server, name):
    """A new user: {"user", "access_key", "secret_key"}."""
    return json.loads(admin(server, "user", "add", name, "--json").stdout)


def wait_for(what, cond, timeout=30):
    """Polls `cond` until it gives something true, which is returned."""
    deadline = time.time() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def metric(proc, name, drive=None, op=None):
    """The sum of metric `name` on a server's (or cluster node's) /metrics,
    over the lines of one drive or one S3 operation when given; an error
    when it has none."""
    req = urllib.request.Request(proc.admin + "/metrics", headers={"Authorization": f"Bearer {getattr(proc, 'secret_key', SECRET_KEY)}"})
    ca = getattr(proc, "ca", None)
    ctx = ssl.create_default_context(cafile=ca) if ca else None
    text = urllib.request.urlopen(req, timeout=10, context=ctx).read().decode()
    found, total = False, 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        labels = (m.group(1) or "") if m else ""
        if m and (drive is None or f'drive="{drive}"' in labels) and (op is None or f'op="{op}"' in labels):
            found = True
            total += float(m.group(2))
    if not found:
        raise AssertionError(f"no metric {name}")
    return total
