"""`tarn mount` on a real FUSE mount (docs/mount.md): directories and stat
from the bucket's listings, reads equal to the objects at every offset and
size and through mmap, an open file keeping the version it opened, files
written sequentially from 0 B to 100 MiB and visible when closed, refused
operations with their errnos, a server killed under the mount, and the
tools that read files (safetensors, transformers) loading from it.
Skipped with the reason where /dev/fuse or fusermount3 is missing."""

import errno
import hashlib
import mmap
import os
import random
import shutil
import signal
import subprocess
import time

import pytest

from conftest import data
from tarnproc import ACCESS_KEY, BIN, SECRET_KEY, wait_for

MIB = 1 << 20

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse on this machine"),
    pytest.mark.skipif(shutil.which("fusermount3") is None, reason="no fusermount3 (Debian's fuse3)"),
]


def mounted(path):
    """Whether a `tarn mount` is at `path`: its mountinfo line (type
    "fuse" or "fuse.tarn", source "tarn:BUCKET/PREFIX")."""
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split(" ")
            rest = fields[fields.index("-") + 1 :]
            if fields[4] == path and rest[0].startswith("fuse") and rest[1].startswith("tarn:"):
                return True
    return False


class Mount:
    """`tarn mount --foreground` of s3://BUCKET[/PREFIX] at a fresh
    directory, stopped by `tarn umount` (and its PID) at the end."""

    def __init__(self, server, tmp_path, source, *args, env=None):
        self.path = str(tmp_path / f"mnt{random.randrange(1 << 30)}")
        os.mkdir(self.path)
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                   AWS_REGION="us-east-1", TARN_LOG="info", **(env or {}))
        self.log = open(str(tmp_path / f"mount{random.randrange(1 << 30)}.log"), "w+")
        self.proc = subprocess.Popen(
            [BIN, "mount", source, self.path, "--endpoint", server.endpoint, "--foreground", *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )
        try:
            wait_for("the mount", lambda: mounted(self.path) or self.proc.poll() is not None, timeout=30)
        except BaseException:
            self.stop()
            raise
        if self.proc.poll() is not None:
            raise AssertionError(f"tarn mount exited {self.proc.returncode}: {self.output()}")

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def p(self, *names):
        return os.path.join(self.path, *names)

    def stop(self):
        if mounted(self.path):
            subprocess.run([BIN, "umount", self.path], capture_output=True, timeout=60)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            subprocess.run(["fusermount3", "-u", "-z", self.path], capture_output=True)
        assert not mounted(self.path)


@pytest.fixture
def mount(make_server, tmp_path):
    made = []

    def make(source="s3://mnt", *args, server=None, bucket="mnt", env=None):
        server = server or make_server()
        s3 = server.client()
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        m = Mount(server, tmp_path, source, *args, env=env)
        m.server, m.s3 = server, s3
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()


def put(s3, key, body, bucket="mnt"):
    s3.put_object(Bucket=bucket, Key=key, Body=body)


def get(s3, key, bucket="mnt"):
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


def test_directories_and_stat_from_the_bucket(mount):
    m = mount()
    put(m.s3, "a.txt", b"hello")
    put(m.s3, "dir/b.bin", data("b", 300_000))
    put(m.s3, "dir/sub/c", b"c")
    put(m.s3, "empty/", b"")  # a directory marker
    put(m.s3, "both", b"file")  # a name that is a file and a directory:
    put(m.s3, "both/inner", b"x")  # the directory wins
    put(m.s3, "zero", b"")
    assert sorted(os.listdir(m.path)) == ["a.txt", "both", "dir", "empty", "zero"]
    assert sorted(os.listdir(m.p("dir"))) == ["b.bin", "sub"]
    assert os.listdir(m.p("empty")) == []
    assert os.path.isdir(m.p("both")) and os.listdir(m.p("both")) == ["inner"]
    st = os.stat(m.p("dir", "b.bin"))
    assert st.st_size == 300_000 and not os.path.isdir(m.p("dir", "b.bin"))
    head = m.s3.head_object(Bucket="mnt", Key="dir/b.bin")
    assert abs(st.st_mtime - head["LastModified"].timestamp()) < 2
    assert os.stat(m.p("zero")).st_size == 0 and open(m.p("zero"), "rb").read() == b""
    assert oct(st.st_mode & 0o777) == "0o644" and oct(os.stat(m.p("dir")).st_mode & 0o777) == "0o755"
    assert st.st_uid == os.getuid()
    with pytest.raises(FileNotFoundError):
        os.stat(m.p("nope"))
    # A name looked up before it was written shows once the TTL allows.
    with pytest.raises(FileNotFoundError):
        os.stat(m.p("later"))
    put(m.s3, "later", b"now")
    time.sleep(1.2)
    assert open(m.p("later"), "rb").read() == b"now"
    # A listing of many entries (several pages).
    for i in range(1100):
        put(m.s3, f"many/{i:05d}", b"")
    assert len(os.listdir(m.p("many"))) == 1100


@pytest.mark.parametrize("flags", [(), ("--direct-io",)])
def test_reads_equal_the_object_at_every_offset_and_through_mmap(mount, flags):
    m = mount("s3://mnt", *flags)
    body = data("r", 21 * MIB + 12345)
    put(m.s3, "big", body)
    assert open(m.p("big"), "rb").read() == body
    rng = random.Random(7)
    fd = os.open(m.p("big"), os.O_RDONLY)
    try:
        pieces = [(0, 1), (len(body) - 1, 1), (8 * MIB - 3, 7), (16 * MIB - 1, MIB + 2), (len(body) - 5, 100)]
        pieces += [(rng.randrange(len(body)), rng.randrange(1, 2 * MIB)) for _ in range(30)]
        for off, n in pieces:
            assert os.pread(fd, n, off) == body[off : off + n], (off, n)
        # Backwards, in small steps (no read-ahead to waste).
        for off in range(len(body) - 4096, len(body) - 40 * 4096, -4096 * 3):
            assert os.pread(fd, 4096, off) == body[off : off + 4096]
    finally:
        os.close(fd)
    with open(m.p("big"), "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            for off, n in pieces:
                assert mm[off : off + n] == body[off : off + n]
            assert hashlib.sha256(mm).digest() == hashlib.sha256(body).digest()
        finally:
            mm.close()


def test_an_open_file_keeps_its_version(mount):
    m = mount("s3://mnt", "--metadata-ttl", "1")
    put(m.s3, "v", b"old" * 1000)
    f = open(m.p("v"), "rb")
    put(m.s3, "v", b"new!" * 2000)
    # The open handle reads the version it opened.
    assert f.read() == b"old" * 1000
    f.seek(0)
    assert f.read(3) == b"old"
    assert os.fstat(f.fileno()).st_size == 3000
    time.sleep(1.2)
    # A reopen after the TTL sees the new one; the old handle still reads
    # its own.
    with open(m.p("v"), "rb") as g:
        assert g.read() == b"new!" * 2000
    f.seek(0)
    assert f.read() == b"old" * 1000
    f.close()


def test_an_overwrite_through_the_mount_leaves_no_old_bytes_cached(mount):
    """A file open for reading here and overwritten through the mount (the
    same inode: the kernel opens it with O_TRUNC): the old handle reads what
    was written or fails with EIO, and never puts the old version's bytes
    into the page cache the new version's readers share."""
    m = mount("s3://mnt", "--metadata-ttl", "60")
    put(m.s3, "f", b"o" * 10000)
    path = m.p("f")
    old = os.open(path, os.O_RDONLY)
    try:
        with open(path, "wb") as w:
            w.write(b"n" * 100)
            w.flush()
            try:
                got = os.pread(old, 200, 0)
                assert got == b"n" * 100, got[:16]
            except OSError as e:
                assert e.errno == errno.EIO, e
    finally:
        os.close(old)
    assert get(m.s3, "f") == b"n" * 100
    with open(path, "rb") as g:
        assert g.read() == b"n" * 100


@pytest.mark.parametrize("local_reads", ["1", "0"])
def test_a_large_file_replaced_while_open_never_mixes_versions(mount, local_reads):
    # What the handle read stays right. Of the rest, a short-circuit read
    # may still get the old version's bytes (its pin keeps that version's
    # shards); over HTTP the read fails with EIO and the log says why. Never
    # the new version's bytes.
    m = mount("s3://mnt", env={"TARN_LOCAL_READS": local_reads})
    big = data("kb", 40 * MIB)
    put(m.s3, "big", big)
    f = open(m.p("big"), "rb", buffering=0)
    assert f.read(MIB) == big[:MIB]
    put(m.s3, "big", data("kb2", 40 * MIB))
    # Past what was read and what the read-ahead had reached.
    f.seek(33 * MIB)
    try:
        got = f.read(MIB)
    except OSError as e:
        assert e.errno == errno.EIO
        assert "replaced while open" in m.output()
    else:
        assert local_reads == "1", "over HTTP a replaced version cannot be read"
        assert got == big[33 * MIB : 34 * MIB]
    f.close()
    # A new open (the TTL passed) reads the new version.
    time.sleep(1.2)
    assert open(m.p("big"), "rb").read() == data("kb2", 40 * MIB)


@pytest.mark.parametrize("size", [0, 1, 4095, 5 * MIB + 1, 17 * MIB + 3, 100 * MIB])
def test_sequential_writes_appear_when_closed(mount, size):
    m = mount()
    body = data(f"w{size}", size)
    path = m.p("out.bin")
    with open(path, "wb") as f:
        for a in range(0, size, 1 * MIB + 7):
            f.write(body[a : a + 1 * MIB + 7])
        if size == 0:
            f.write(b"")
    assert get(m.s3, "out.bin") == body
    assert os.stat(path).st_size == size
    assert open(path, "rb").read() == body
    # A whole-file overwrite (O_TRUNC).
    with open(path, "wb") as f:
        f.write(b"again")
    assert get(m.s3, "out.bin") == b"again"


def test_files_in_new_directories_unlink_rename(mount):
    m = mount()
    os.mkdir(m.p("newdir"))
    assert os.path.isdir(m.p("newdir")) and os.listdir(m.p("newdir")) == []
    with pytest.raises(FileExistsError):
        os.mkdir(m.p("newdir"))
    with open(m.p("newdir", "f"), "wb") as f:
        f.write(b"inside")
    assert get(m.s3, "newdir/f") == b"inside"
    with pytest.raises(OSError) as e:
        os.rmdir(m.p("newdir"))
    assert e.value.errno == errno.ENOTEMPTY
    os.rename(m.p("newdir", "f"), m.p("moved"))
    assert get(m.s3, "moved") == b"inside"
    with pytest.raises(m.s3.exceptions.NoSuchKey):
        m.s3.get_object(Bucket="mnt", Key="newdir/f")
    assert not os.path.exists(m.p("newdir", "f")) and open(m.p("moved"), "rb").read() == b"inside"
    os.unlink(m.p("moved"))
    with pytest.raises(m.s3.exceptions.NoSuchKey):
        m.s3.get_object(Bucket="mnt", Key="moved")
    with pytest.raises(FileNotFoundError):
        os.unlink(m.p("moved"))
    os.rmdir(m.p("newdir"))
    assert not os.path.exists(m.p("newdir"))


def test_refused_operations_have_their_errnos(mount):
    m = mount()
    put(m.s3, "f", b"0123456789")
    put(m.s3, "d/x", b"x")

    def errno_of(fn):
        with pytest.raises(OSError) as e:
            fn()
        return e.value.errno

    # Changing an existing file in place, appending, random writes.
    assert errno_of(lambda: os.open(m.p("f"), os.O_WRONLY)) == errno.EPERM
    assert errno_of(lambda: os.open(m.p("f"), os.O_WRONLY | os.O_APPEND)) == errno.EOPNOTSUPP
    fd = os.open(m.p("new"), os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"abc")
    assert errno_of(lambda: os.pwrite(fd, b"x", 0)) == errno.EINVAL
    os.close(fd)
    assert get(m.s3, "new") == b"abc"
    # Links, modes, owners, sizes, times.
    assert errno_of(lambda: os.link(m.p("f"), m.p("g"))) == errno.EPERM
    assert errno_of(lambda: os.symlink("f", m.p("s"))) == errno.EPERM
    assert errno_of(lambda: os.chmod(m.p("f"), 0o600)) == errno.EPERM
    assert errno_of(lambda: os.chown(m.p("f"), 12345, 12345)) == errno.EPERM
    assert errno_of(lambda: os.truncate(m.p("f"), 3)) == errno.EPERM
    assert errno_of(lambda: os.utime(m.p("f"), (1, 1))) == errno.EPERM
    assert errno_of(lambda: os.mknod(m.p("fifo"), 0o600 | 0o010000)) == errno.EPERM
    # Directories.
    assert errno_of(lambda: os.unlink(m.p("d"))) == errno.EISDIR
    assert errno_of(lambda: os.rmdir(m.p("d"))) == errno.ENOTEMPTY
    assert errno_of(lambda: os.rmdir(m.p("f"))) == errno.ENOTDIR
    assert errno_of(lambda: os.rename(m.p("d"), m.p("d2"))) == errno.EXDEV
    assert errno_of(lambda: open(m.p("d"), "rb")) == errno.EISDIR
    # Nothing above changed the bucket.
    assert get(m.s3, "f") == b"0123456789" and get(m.s3, "d/x") == b"x"
    # A read-only mount refuses every change.
    ro = mount("s3://mnt", "--read-only", server=m.server)
    assert open(ro.p("f"), "rb").read() == b"0123456789"
    assert errno_of(lambda: open(ro.p("n"), "wb")) == errno.EROFS
    assert errno_of(lambda: os.unlink(ro.p("f"))) == errno.EROFS
    assert errno_of(lambda: os.mkdir(ro.p("m"))) == errno.EROFS


def test_a_prefix_is_the_root(mount, make_server):
    server = make_server()
    s3 = server.client()
    s3.create_bucket(Bucket="mnt")
    put(s3, "models/llama/config.json", b"{}")
    put(s3, "models/llama/w/a", b"a")
    put(s3, "other", b"o")
    m = mount("s3://mnt/models/llama", server=server)
    assert sorted(os.listdir(m.path)) == ["config.json", "w"]
    with open(m.p("w", "b"), "wb") as f:
        f.write(b"b")
    assert get(s3, "models/llama/w/b") == b"b"


def test_a_killed_server_fails_calls_and_never_hangs_the_mount(mount):
    m = mount("s3://mnt", "--timeout", "2", "--metadata-ttl", "0")
    put(m.s3, "f", b"x" * 100)
    assert open(m.p("f"), "rb").read() == b"x" * 100
    m.server.kill()
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        os.stat(m.p("g"))
    assert e.value.errno in (errno.EIO, errno.ETIMEDOUT, errno.ECONNREFUSED), e.value
    with pytest.raises(OSError):
        open(m.p("f"), "rb").read()
    assert time.monotonic() - t0 < 60
    # Unmounting still works.
    subprocess.run([BIN, "umount", m.path], check=True, timeout=60)
    m.proc.wait(timeout=30)
    assert not mounted(m.path)


def test_unmount_while_a_file_is_open_is_clean(mount):
    m = mount()
    put(m.s3, "f", data("o", 3 * MIB))
    f = open(m.p("f"), "rb")
    assert f.read(10) == data("o", 10)
    subprocess.run([BIN, "umount", m.path], check=True, timeout=60)
    assert not mounted(m.path)
    # The open file still reads until it is closed; then the mount ends.
    assert f.read(MIB) == data("o", 3 * MIB)[10 : 10 + MIB]
    f.close()
    m.proc.wait(timeout=30)
    assert m.proc.returncode == 0, m.output()


def test_background_mount_and_sigterm(make_server, tmp_path):
    server = make_server()
    server.client().create_bucket(Bucket="mnt")
    put(server.client(), "f", b"bg")
    path = str(tmp_path / "bg")
    os.mkdir(path)
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
               XDG_STATE_HOME=str(tmp_path / "state"))
    r = subprocess.run([BIN, "mount", "s3://mnt", path, "--endpoint", server.endpoint],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    try:
        assert mounted(path) and open(os.path.join(path, "f"), "rb").read() == b"bg"
        pid = int(subprocess.run(["pgrep", "-f", f"tarn mount s3://mnt {path}"], capture_output=True,
                                 text=True).stdout.split()[0])
        os.kill(pid, signal.SIGTERM)
        wait_for("the unmount", lambda: not mounted(path), timeout=30)
    finally:
        if mounted(path):
            subprocess.run([BIN, "umount", path], timeout=60)
    # A mount that cannot start says why, and mounts nothing.
    r = subprocess.run([BIN, "mount", "s3://no-such-bucket", path, "--endpoint", server.endpoint],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no-such-bucket" in r.stderr and not mounted(path)
    # Options out of range are refused before anything is mounted.
    for bad in (["--timeout", "0"], ["--metadata-ttl=-1"], ["--timeout", "nan"]):
        r = subprocess.run([BIN, "mount", "s3://mnt", path, "--endpoint", server.endpoint, *bad],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and bad[0].split("=")[0] in r.stderr and not mounted(path), (bad, r.stderr)


def cache_files(d):
    return [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if len(f) == 24]


def test_the_cache_directory_keeps_checks_and_bounds_what_was_read(mount, make_server, tmp_path):
    server = make_server()
    s3 = server.client()
    s3.create_bucket(Bucket="mnt")
    body = data("c", 20 * MIB + 77)
    put(s3, "f", body)
    cache = str(tmp_path / "cache")
    m = mount("s3://mnt", "--cache-dir", cache, "--cache-size", "64MiB", server=server)
    assert open(m.p("f"), "rb").read() == body
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"
    files = cache_files(cache)
    assert len(files) == 3 and all(oct(os.stat(f).st_mode & 0o777) == "0o600" for f in files)
    # One mount per cache directory.
    other = str(tmp_path / "other")
    os.mkdir(other)
    r = subprocess.run([BIN, "mount", "s3://mnt", other, "--endpoint", server.endpoint, "--foreground",
                        "--cache-dir", cache, "--cache-size", "64MiB"],
                       env=dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "another tarn mount is using it" in r.stderr and not mounted(other)
    m.stop()
    # A later mount reads from it; a damaged file is removed and read from
    # the bucket, never served.
    with open(files[1], "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"XXXXX")
    m = mount("s3://mnt", "--cache-dir", cache, "--cache-size", "64MiB", server=server)
    assert open(m.p("f"), "rb").read() == body
    fd = os.open(m.p("f"), os.O_RDONLY)
    assert os.pread(fd, 100, 17 * MIB) == body[17 * MIB : 17 * MIB + 100]
    os.close(fd)
    m.stop()
    out = m.output()
    assert "data checksum mismatch: removed" in out, out
    assert "2 segment reads from it" in out or "3 segment reads from it" in out, out
    # A replaced object is not served from it.
    put(s3, "f", b"new")
    m = mount("s3://mnt", "--cache-dir", cache, "--cache-size", "64MiB", server=server)
    assert open(m.p("f"), "rb").read() == b"new"
    m.stop()
    # Bounded: a 40 MiB file through a 20 MiB cache keeps at most 20 MiB.
    put(s3, "g", data("g", 40 * MIB))
    m = mount("s3://mnt", "--cache-dir", cache, "--cache-size", "20MiB", server=server)
    assert open(m.p("g"), "rb").read() == data("g", 40 * MIB)
    assert sum(os.stat(f).st_size for f in cache_files(cache)) <= 20 * MIB


@pytest.mark.parametrize("flags", [(), ("--direct-io",)])
def test_safetensors_and_transformers_load_from_the_mount(mount, tmp_path, flags):
    import safetensors.torch as st
    import torch

    m = mount("s3://mnt", *flags)
    tensors = {"a": torch.randn(300, 200), "b": torch.arange(1000, dtype=torch.int64)}
    st.save_file(tensors, str(tmp_path / "m.safetensors"))
    put(m.s3, "st/m.safetensors", (tmp_path / "m.safetensors").read_bytes())
    got = st.load_file(m.p("st", "m.safetensors"))
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)

    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    local = tmp_path / "tiny"
    model.save_pretrained(str(local))
    for name in os.listdir(local):
        put(m.s3, f"tiny/{name}", (local / name).read_bytes())
    loaded = transformers.LlamaForCausalLM.from_pretrained(m.p("tiny"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
