"""A real cluster for tests: etcd (Debian's etcd-server) on a free loopback
port and `tarn` nodes on 127.0.0.N, each process stopped by its PID. Shared
by test_cluster.py, test_cluster_faults.py and scripts/bench-cluster-faults."""

import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time

from botocore.config import Config
import boto3

from tarnproc import ACCESS_KEY, BIN, SECRET_KEY

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
SECRET = "cluster-secret-for-tests-0123456789"
# The credentials of nodes on addresses other than loopback's.
LINK_KEYS = ("linkadmin", "linkadmin-secret-for-tests")


# Ports handed out by this test process, never handed out again: two picks
# for one node (or a node and etcd) made before either binds could otherwise
# be the same port (seen once in CI: a node found its own port taken).
_HANDED_OUT = set()


def free_port(ip):
    """A port free now on `ip`, below the kernel's ephemeral range: a port
    the kernel hands out (bind to 0) may be taken as the source port of an
    outgoing connection before the process it is meant for binds it (seen
    once: a node found its S3 port taken)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT or port + 1 in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free port on {ip} below {low}")


class Etcd:
    """etcd on `ip`; with `tls` (a dict of PEM paths: `cert`, `key`, and
    `ca` to require client certificates signed by it) its client URL is
    https:// and checks clients' certificates."""

    def __init__(self, root, ip="127.0.0.1", tls=None):
        self.root, self.ip, self.tls = root, ip, tls
        self.port = free_port(ip)
        self.peer = free_port(ip)
        self.url = f"{'https' if tls else 'http'}://{ip}:{self.port}"
        self.start()

    def start(self):
        self.log = open(os.path.join(self.root, "etcd.log"), "a")
        peer = f"http://{self.ip}:{self.peer}"
        tls = []
        if self.tls:
            tls = ["--cert-file", self.tls["cert"], "--key-file", self.tls["key"]]
            if "ca" in self.tls:
                tls += ["--trusted-ca-file", self.tls["ca"], "--client-cert-auth"]
        self.proc = subprocess.Popen(
            [ETCD, "--data-dir", os.path.join(self.root, "etcd"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"default={peer}", *tls],
            stdout=self.log, stderr=self.log)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                socket.create_connection((self.ip, self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("etcd did not start")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.log.close()


class Node:
    """`tarn server` as node n<i>, on 127.0.0.<i> unless `ip` is given; run
    inside network namespace `netns` when given (`ip netns exec`, which
    execs: the PID is the server's). With `kv` (a list of further KV
    flags) it also runs the KV store, at `kv_endpoint`."""

    def __init__(self, root, i, etcd_url, drives=2, extra=(), ip=None, netns=None, keys=None, kv=None, secret=None,
                 tls=None, advertise_host=None):
        self.i = i
        # With `tls` (PEM paths `cert`, `key`, `ca`) every listener is TLS.
        self.ca = tls["ca"] if tls else None
        self.cluster_secret = secret or SECRET
        # Off loopback, a server refuses the built-in default credentials.
        self.access_key, self.secret_key = keys or (ACCESS_KEY, SECRET_KEY)
        self.ip = ip or f"127.0.0.{i}"
        self.root = os.path.join(root, f"n{i}")
        os.makedirs(self.root, exist_ok=True)
        # A new namespace has every port free (and its address is not the
        # host's to bind).
        if netns:
            base = random.randrange(20000, 30000)
            self.s3_port, self.admin_port, self.rpc_port = base, base + 1, base + 2
        else:
            self.s3_port, self.admin_port, self.rpc_port = (free_port(self.ip) for _ in range(3))
        scheme = "https" if tls else "http"
        self.endpoint = f"{scheme}://{self.ip}:{self.s3_port}"
        self.admin = f"{scheme}://{self.ip}:{self.admin_port}"
        self.args = ["ip", "netns", "exec", netns] if netns else []
        self.args += [BIN, "server", "--cluster", "test", "--etcd", etcd_url, "--node-id", f"n{i}",
                     "--advertise", f"{advertise_host or self.ip}:{self.rpc_port}",
                     "--listen", f"{self.ip}:{self.s3_port}", "--admin-listen", f"{self.ip}:{self.admin_port}",
                     "--cores", "1"]
        if tls:
            self.args += ["--tls-cert", tls["cert"], "--tls-key", tls["key"], "--tls-ca", tls["ca"]]
        elif not ipaddress.ip_address(self.ip).is_loopback or advertise_host:
            # Beyond loopback a node without TLS must be told plain is meant
            # (an advertised name has the RPC listener on every address).
            self.args.append("--allow-plain-http")
        self.kv_endpoint = None
        if kv is not None:
            kv_port = self.rpc_port + 1 if netns else free_port(self.ip)
            self.kv_endpoint = f"{self.ip}:{kv_port}"
            self.args += ["--kv", "--kv-listen", self.kv_endpoint, *kv]
        for d in range(drives):
            self.args += ["--drive", os.path.join(self.root, f"d{d}")]
        if drives == 0:
            self.args.append("--no-drives")
        self.args += list(extra)
        self.logs = []
        self.start()

    def start(self):
        env = dict(os.environ, TARN_ACCESS_KEY=self.access_key, TARN_SECRET_KEY=self.secret_key,
                   TARN_CLUSTER_SECRET=self.cluster_secret, TARN_LOG="info", NO_COLOR="1")
        path = os.path.join(self.root, f"server-{len(self.logs)}.log")
        self.logs.append(path)
        self.log = open(path, "w")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     cwd=self.root, env=env)
        line = self.proc.stdout.readline()
        if not line.startswith("Cluster "):
            raise RuntimeError(f"node {self.i}: {line!r} {open(path).read()}")

    def wait_serving(self):
        deadline = time.time() + 60
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("S3 endpoint:"):
                return
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"node {self.i} exited: {open(self.logs[-1]).read()}")
        raise RuntimeError(f"node {self.i} did not start serving")

    def client(self, **cfg):
        """A boto3 client of this node: by default one retry (botocore's
        `max_attempts` counts retries); history checkers pass
        `retries=ONE_ATTEMPT`."""
        cfg.setdefault("retries", {"max_attempts": 1})
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1", verify=self.ca,
                            config=Config(s3={"addressing_style": "path"}, connect_timeout=5, read_timeout=30, **cfg))

    def admin_cmd(self, *args, check=True):
        tls = ["--ca-bundle", self.ca] if self.ca else []
        r = subprocess.run([BIN, "admin", "--endpoint", self.admin, "--token", self.secret_key, *tls, *args],
                           capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise AssertionError(f"tarn admin {args}: {r.stderr}")
        return r

    def signal(self, sig):
        os.kill(self.proc.pid, sig)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def errors(self):
        out = []
        for p in self.logs:
            out += [line for line in open(p) if " ERROR " in line]
        return out


def form(root, count=4, drives=2, data_shards=2, parity_shards=2, first=1, extra=(), link=None, kv=None):
    """etcd and `count` nodes on 127.0.0.first…, formed into one pool of
    data+parity sets and serving; with a `Link`, etcd and every node but
    the last on its host addresses, the last inside its namespace. The
    caller stops them (`stop_all`)."""
    last = first + count - 1
    etcd = Etcd(root, ip=link.host_ip(250) if link else "127.0.0.1")
    nodes = []
    try:
        for i in range(first, last + 1):
            place = {}
            if link:
                place = dict(ip=link.ns_ip, netns=link.ns) if i == last else dict(ip=link.host_ip(i))
                place["keys"] = LINK_KEYS
            nodes.append(Node(root, i, etcd.url, drives=drives, extra=extra, kv=kv, **place))
        init_and_serve(nodes, data_shards, parity_shards)
    except BaseException:
        stop_all(etcd, nodes)
        raise
    return etcd, nodes


def init_and_serve(nodes, data_shards, parity_shards):
    """Forms the cluster of `nodes` and waits until each serves."""
    out = nodes[0].admin_cmd("cluster", "init", "--data-shards", str(data_shards),
                             "--parity-shards", str(parity_shards)).stdout
    assert "cluster formed" in out, out
    for n in nodes:
        n.wait_serving()


def stop_all(etcd, nodes):
    for n in nodes:
        n.stop()
    etcd.stop()


def shard_files(path):
    """Shard files on one drive (`<drive>/data/<aa>/<id>`)."""
    return sum(len(files) for _, _, files in os.walk(os.path.join(path, "data")))


def node_shard_files(node):
    """Shard files on all of a node's drives."""
    return sum(shard_files(os.path.join(node.root, d)) for d in os.listdir(node.root))


def status(node):
    """`tarn admin cluster status --json` through a node."""
    return json.loads(node.admin_cmd("cluster", "status", "--json").stdout)


def wait_repaired(node, timeout=60):
    """Until `node` reports repair done; on a timeout the error says what
    it still saw (drives not online, under-replicated objects, jobs)."""
    from tarnproc import wait_for
    try:
        wait_for(f"repair done as n{node.i} sees it", lambda: status(node)["repair_done"], timeout=timeout)
    except AssertionError as e:
        st = status(node)
        behind = [d for d in st["drives_seen_from_here"] if not d["online"] or d["rebuilding"] or d["syncing"]]
        raise AssertionError(f"{e}: under_replicated={st['under_replicated']} jobs={st['jobs']} "
                             f"drives not online={behind}") from None


class Link:
    """A network namespace joined to the host by a veth pair, to cut a node
    off by taking the link down: its end, inside the namespace, so that the
    host's end stays up and sends into a dead link (the node goes silent;
    nothing is refused). The host's processes listen on addresses added to
    `lo` (reachable through the veth, which 127.0.0.0/8 is not). `create`
    answers None where the machine does not allow it (not root, no `ip`,
    no namespaces); `remove` undoes everything."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.net = f"10.{100 + os.getpid() % 150}"
        self.ns, self.host_if, self.ns_if = f"tarncut{tag}", f"tch{tag}", f"tcn{tag}"
        self.ns_ip = f"{self.net}.0.2"
        self.lo_addrs = []

    def host_ip(self, i):
        addr = f"{self.net}.1.{i}"
        if addr not in self.lo_addrs:
            ip("addr", "add", f"{addr}/32", "dev", "lo")
            self.lo_addrs.append(addr)
        return addr

    @classmethod
    def create(cls):
        if os.geteuid() != 0 or not shutil.which("ip"):
            return None
        link = cls()
        try:
            ip("netns", "add", link.ns)
            ip("link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if)
            ip("link", "set", link.ns_if, "netns", link.ns)
            ip("addr", "add", f"{link.net}.0.1/30", "dev", link.host_if)
            ip("link", "set", link.host_if, "up")
            ip("-n", link.ns, "addr", "add", f"{link.ns_ip}/30", "dev", link.ns_if)
            ip("-n", link.ns, "link", "set", link.ns_if, "up")
            ip("-n", link.ns, "link", "set", "lo", "up")
            ip("-n", link.ns, "route", "add", "default", "via", f"{link.net}.0.1")
        except (OSError, subprocess.CalledProcessError):
            link.remove()
            return None
        return link

    def cut(self):
        ip("-n", self.ns, "link", "set", self.ns_if, "down")

    def restore(self):
        ip("-n", self.ns, "link", "set", self.ns_if, "up")
        # The link going down took the namespace's default route with it.
        ip("-n", self.ns, "route", "replace", "default", "via", f"{self.net}.0.1")

    def remove(self):
        for args in [("link", "del", self.host_if), ("netns", "del", self.ns)] + \
                [("addr", "del", f"{a}/32", "dev", "lo") for a in self.lo_addrs]:
            subprocess.run(["ip", *args], capture_output=True)


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Fabric:
    """Hosts for a cluster's nodes: a network namespace per node with two
    links to the host, one for data (the other nodes and the clients, all
    through the host, which forwards between links) and one for etcd
    alone, so that a test cuts a node off entirely, or from etcd only, or
    gives a node back its data link while its etcd link stays cut. A link
    is cut at its end inside the namespace: the host keeps sending into it
    and the node goes silent, refusing nothing. etcd and the clients stay
    on the host. `create` answers None where the machine does not allow it
    (not root, no `ip`, no namespaces or veth); `remove` undoes it all."""

    def __init__(self, count):
        tag = os.getpid() % 10000
        self.net = f"172.{16 + os.getpid() % 16}"
        self.count = count
        self.ns = [f"tarnf{tag}n{i}" for i in range(1, count + 1)]
        self.etcd_ip = f"{self.net}.200.1"
        self.made = []
        self.forward = None

    def data_ip(self, i):
        return f"{self.net}.{i}.2"

    def _ifs(self, i, kind):
        tag = os.getpid() % 10000
        return f"tf{kind}h{tag}{i}", f"tf{kind}n{tag}{i}"

    @classmethod
    def create(cls, count=4):
        if os.geteuid() != 0 or not shutil.which("ip"):
            return None
        f = cls(count)
        try:
            with open("/proc/sys/net/ipv4/ip_forward") as fh:
                f.forward = fh.read().strip()
            with open("/proc/sys/net/ipv4/ip_forward", "w") as fh:
                fh.write("1")
            ip("addr", "add", f"{f.etcd_ip}/32", "dev", "lo")
            f.made.append(("addr", "del", f"{f.etcd_ip}/32", "dev", "lo"))
            for i in range(1, count + 1):
                ns = f.ns[i - 1]
                ip("netns", "add", ns)
                f.made.append(("netns", "del", ns))
                ip("-n", ns, "link", "set", "lo", "up")
                for kind, sub in (("d", i), ("e", 100 + i)):
                    host_if, ns_if = f._ifs(i, kind)
                    ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
                    f.made.append(("link", "del", host_if))
                    ip("link", "set", ns_if, "netns", ns)
                    ip("addr", "add", f"{f.net}.{sub}.1/30", "dev", host_if)
                    ip("link", "set", host_if, "up")
                    ip("-n", ns, "addr", "add", f"{f.net}.{sub}.2/30", "dev", ns_if)
                    ip("-n", ns, "link", "set", ns_if, "up")
                f._routes(i)
        except (OSError, subprocess.CalledProcessError):
            f.remove()
            return None
        return f

    def _routes(self, i, kinds="de"):
        ns = self.ns[i - 1]
        if "d" in kinds:
            ip("-n", ns, "route", "replace", "default", "via", f"{self.net}.{i}.1")
        if "e" in kinds:
            ip("-n", ns, "route", "replace", f"{self.etcd_ip}/32", "via", f"{self.net}.{100 + i}.1")

    def _set(self, i, kind, state):
        _, ns_if = self._ifs(i, kind)
        ip("-n", self.ns[i - 1], "link", "set", ns_if, state)
        if state == "up":
            # A link going down takes its routes with it.
            self._routes(i, kind)
        elif kind == "e":
            # Without its own route, etcd's address would be reached over
            # the data link (the default route, forwarded by the host): a
            # node "cut from etcd" with its data link up still reached it.
            # Its packets are dropped instead, as a partition drops them.
            ip("-n", self.ns[i - 1], "route", "replace", "blackhole", f"{self.etcd_ip}/32")

    def cut(self, i):
        """Node i hears and reaches nobody."""
        self._set(i, "d", "down")
        self._set(i, "e", "down")

    def cut_etcd(self, i):
        self._set(i, "e", "down")

    def restore_data(self, i):
        self._set(i, "d", "up")

    def restore_etcd(self, i):
        self._set(i, "e", "up")

    def restore(self, i):
        self._set(i, "d", "up")
        self._set(i, "e", "up")

    def remove(self):
        for args in reversed(self.made):
            subprocess.run(["ip", *args], capture_output=True)
        self.made = []
        if self.forward is not None:
            with open("/proc/sys/net/ipv4/ip_forward", "w") as fh:
                fh.write(self.forward)
            self.forward = None


def form_fabric(root, fabric, drives=2, data_shards=2, parity_shards=2, extra=()):
    """etcd on the host and one node per namespace of `fabric`, formed into
    one pool of data+parity sets and serving (`stop_all` stops them)."""
    etcd = Etcd(root, ip=fabric.etcd_ip)
    nodes = []
    try:
        for i in range(1, fabric.count + 1):
            nodes.append(Node(root, i, etcd.url, drives=drives, extra=extra, ip=fabric.data_ip(i),
                              netns=fabric.ns[i - 1], keys=LINK_KEYS))
        init_and_serve(nodes, data_shards, parity_shards)
    except BaseException:
        stop_all(etcd, nodes)
        raise
    return etcd, nodes
