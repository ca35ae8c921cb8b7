"""The Python package `tarn` (crates/tarn-py + python/tarn) against a live
`tarn server --kv`: batched calls over shared memory and TCP, buffers of
every kind, errors, threads, asyncio and a server restart."""

import asyncio
import builtins
import mmap
import socket
import threading

import numpy as np
import pytest

import tarn
import tarn.kv as kv
from tarn.kv import Status

KV_ARGS = ["--kv", "--kv-listen", "127.0.0.1:0", "--kv-memory", "64MiB", "--kv-value-max", "1MiB"]


@pytest.fixture
def kv_server(make_server):
    return make_server(drives=1, extra_args=KV_ARGS, name="kv")


@pytest.fixture(params=["shm", "tcp"])
def client(request, kv_server):
    c = kv.Client(kv_server.kv_endpoint, namespace="test", transport=request.param)
    assert c.transport == request.param
    yield c
    c.close()


def keys(n, tag="k"):
    return [kv.key(tag, i) for i in range(n)]


def payload(i, n):
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def test_put_get_every_buffer_kind(client):
    ks = keys(5)
    values = [payload(i, 1000 + 4096 * i) for i in range(5)]
    # bytes, bytearray, memoryview, numpy, mmap: anything with the buffer protocol
    srcs = [values[0].tobytes(), bytearray(values[1].tobytes()), memoryview(values[2]), values[3]]
    m = mmap.mmap(-1, len(values[4]))
    m[:] = values[4].tobytes()
    srcs.append(m)
    assert client.put_from(ks, srcs) == [Status.OK] * 5
    assert client.put_from(ks[:1], srcs[:1]) == [Status.ALREADY_EXISTS]
    assert all(s.stored for s in client.put_from(ks, srcs))

    dsts = [bytearray(len(values[0])), np.zeros(len(values[1]), np.uint8)]
    dsts.append(memoryview(bytearray(len(values[2]) + 100)))  # larger than the value
    dsts.append(np.zeros(len(values[3]) // 4, np.float32))  # any dtype: raw bytes
    dsts.append(mmap.mmap(-1, len(values[4])))
    got = client.get_into(ks, dsts)
    assert got == [len(v) for v in values]
    assert bytes(dsts[0]) == values[0].tobytes()
    assert np.array_equal(dsts[1], values[1])
    assert bytes(dsts[2][: len(values[2])]) == values[2].tobytes()
    assert dsts[3].tobytes() == values[3].tobytes()
    assert dsts[4][:] == values[4].tobytes()
    m.close()
    dsts[4].close()


def test_partial_misses_are_results(client):
    ks = keys(6)
    client.put_from(ks[::2], [bytes([i]) * 512 for i in range(3)])
    assert client.exists(ks) == [True, False, True, False, True, False]
    assert client.prefix_hits(ks) == 1
    assert client.prefix_hits(ks[::2]) == 3
    bufs = [bytearray(512) for _ in ks]
    assert client.get_into(ks, bufs) == [512, None, 512, None, 512, None]
    assert bufs[2] == bytes([1]) * 512
    assert bufs[1] == bytes(512), "a miss leaves its buffer alone"
    assert client.exists([]) == [] and client.get_into([], []) == []


def test_namespaces_are_separate(kv_server):
    a = kv.Client(kv_server.kv_endpoint, namespace="model-a")
    b = kv.Client(kv_server.kv_endpoint, namespace=b"model-b")
    k = keys(1)
    a.put_from(k, [b"a" * 100])
    assert b.exists(k) == [False]
    b.put_from(k, [b"b" * 100])
    buf = bytearray(100)
    a.get_into(k, [buf])
    assert buf == b"a" * 100
    assert a.namespace == b"model-a" and b.namespace == b"model-b"
    stats = a.stats()
    assert stats["namespace.puts_stored"] == 1 and stats["blocks"] == 2


def test_touch_pin_unpin_delete(client):
    ks = keys(3)
    client.put_from(ks[:2], [b"x" * 10, b"y" * 10])
    assert client.touch(ks) == [True, True, False]
    assert client.pin(ks, lease=30) == [True, True, False]
    assert client.unpin(ks) == [True, True, False]
    assert client.delete(ks) == [True, True, False]
    assert client.exists(ks) == [False, False, False]
    assert client.delete(ks[:1]) == [False]
    with pytest.raises(ValueError, match="lease"):
        client.pin(ks, lease=0)


def test_bad_input_is_a_clear_error(client):
    k = keys(2)
    client.put_from(k[:1], [b"v" * 64])
    with pytest.raises(ValueError, match="32-byte"):
        client.exists([b"short"])
    with pytest.raises(TypeError, match="str"):
        client.exists(["a" * 32])
    with pytest.raises(TypeError, match="buffer 0"):
        client.put_from(k[:1], [12345])
    with pytest.raises(BufferError, match="writable"):
        client.get_into(k[:1], [b"\0" * 64])
    with pytest.raises(BufferError, match="contiguous"):
        client.get_into(k[:1], [np.zeros((16, 16), np.uint8)[:, :4]])
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        client.put_from(k, [b"x"])
    shared = bytearray(128)
    with pytest.raises(ValueError, match="overlap"):
        client.get_into(k, [memoryview(shared)[:80], memoryview(shared)[64:]])
    with pytest.raises(ValueError, match="holds 10 bytes but key 0's value is 64 bytes"):
        client.get_into(k[:1], [bytearray(10)])
    with pytest.raises(ValueError, match="exceeds the server's maximum"):
        client.put_from(k[1:], [bytes(client.value_max_bytes + 1)])
    # none of that disturbed what is stored, or the connection
    buf = bytearray(64)
    assert client.get_into(k, [buf, bytearray(1)]) == [64, None]
    assert buf == b"v" * 64


def test_connection_errors(kv_server):
    with pytest.raises(kv.KvConnectionError, match="cannot connect") as e:
        kv.Client("127.0.0.1:1")
    assert isinstance(e.value, builtins.ConnectionError) and isinstance(e.value, tarn.TarnError)
    with pytest.raises(ValueError, match="host:port"):
        kv.Client("nonsense")
    with pytest.raises(ValueError, match="transport"):
        kv.Client(kv_server.kv_endpoint, transport="carrier-pigeon")
    with pytest.raises(ValueError, match="namespace"):
        kv.Client(kv_server.kv_endpoint, namespace="n" * 513)
    c = kv.Client(kv_server.kv_endpoint)
    c.close()
    with pytest.raises(kv.KvConnectionError, match="closed"):
        c.exists(keys(1))


def test_gil_is_released_while_waiting():
    """A call blocked on a server that does not answer leaves other Python
    threads running: the main thread runs Python code while the call waits."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    endpoint = "127.0.0.1:%d" % listener.getsockname()[1]
    result = {}

    def connect():
        try:
            kv.Client(endpoint, connect_timeout=60)
        except Exception as e:  # noqa: BLE001 - recorded for the assertion below
            result["error"] = e

    t = threading.Thread(target=connect)
    t.start()
    conn, _ = listener.accept()  # the client is now waiting for HELLO's answer
    spins = 0
    while spins < 200_000:
        spins += 1
    assert t.is_alive(), "the native call should still be waiting"
    conn.close()
    listener.close()
    t.join(30)
    assert not t.is_alive()
    assert isinstance(result.get("error"), kv.KvConnectionError)


def test_threads_share_a_client_and_use_their_own(kv_server):
    shared = kv.Client(kv_server.kv_endpoint, namespace="mt", max_connections=4)
    errors = []

    def work(tid, c):
        try:
            ks = keys(32, f"t{tid}")
            vals = [payload(tid * 100 + i, 8192) for i in range(32)]
            for round_ in range(5):
                assert all(s.stored for s in c.put_from(ks, vals))
                bufs = [np.empty(8192, np.uint8) for _ in ks]
                assert c.get_into(ks, bufs) == [8192] * 32
                for v, b in zip(vals, bufs):
                    assert np.array_equal(v, b)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    own = [kv.Client(kv_server.kv_endpoint, namespace="mt") for _ in range(4)]
    threads = [threading.Thread(target=work, args=(i, shared)) for i in range(8)]
    threads += [threading.Thread(target=work, args=(100 + i, own[i])) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert shared.stats()["namespace.blocks"] == 12 * 32


def test_asyncio_client(kv_server):
    async def main():
        async with await kv.AsyncClient.connect(kv_server.kv_endpoint, namespace="aio") as c:
            assert c.transport == "shm"
            ks = keys(64, "aio")
            vals = [payload(i, 4096) for i in range(64)]
            puts = await asyncio.gather(*(c.put_from(ks[i : i + 8], vals[i : i + 8]) for i in range(0, 64, 8)))
            assert all(s == Status.OK for batch in puts for s in batch)
            bufs = [bytearray(4096) for _ in ks]
            got = await asyncio.gather(*(c.get_into(ks[i : i + 8], bufs[i : i + 8]) for i in range(0, 64, 8)))
            assert [n for batch in got for n in batch] == [4096] * 64
            assert all(bytes(b) == v.tobytes() for b, v in zip(bufs, vals))
            assert await c.prefix_hits(ks) == 64
            assert (await c.exists([kv.key("nope")])) == [False]
            assert await c.delete(ks[:1]) == [True]
            assert (await c.stats())["namespace.blocks"] == 63
            # a cancelled call finishes in the background; the client stays usable
            task = asyncio.ensure_future(c.get_into(ks[1:], [bytearray(4096) for _ in ks[1:]]))
            await asyncio.sleep(0)
            task.cancel()
            assert await c.exists(ks[1:2]) == [True]

    asyncio.run(main())


def test_server_restart(kv_server):
    c = kv.Client(kv_server.kv_endpoint, namespace="restart", max_connections=2)
    ks = keys(4, "before")
    c.put_from(ks, [b"x" * 4096] * 4)
    kv_server.restart()
    # The pooled connection died with the old server: the call reconnects.
    # The RAM tier does not outlive the process, so the blocks are misses.
    assert c.exists(ks) == [False] * 4
    assert c.get_into(ks, [bytearray(4096) for _ in ks]) == [None] * 4
    new = keys(4, "after")
    assert c.put_from(new, [b"y" * 4096] * 4) == [Status.OK] * 4
    assert c.prefix_hits(new) == 4
    kv_server.stop()
    with pytest.raises(kv.KvConnectionError):
        c.exists(new)
    kv_server.start()
    assert c.exists(new) == [False] * 4


def test_a_clean_restart_keeps_the_store_with_an_nvme_tier(make_server, tmp_path):
    """SIGTERM writes the blocks held only in RAM to the NVMe tier: the
    next start serves them. A kill -9 loses what only RAM held."""
    disk = tmp_path / "kv-nvme"
    disk.mkdir()
    s = make_server(drives=1, extra_args=KV_ARGS + ["--kv-disk", str(disk), "--kv-disk-size", "256MiB"],
                    name="kv-nvme")  # fmt: skip
    c = kv.Client(s.kv_endpoint, namespace="keep")
    ks = keys(6, "keep")
    vals = [payload(i, 4096 * (i + 1) + i).tobytes() for i in range(6)]
    assert c.put_from(ks, vals) == [Status.OK] * 6
    s.restart()
    bufs = [bytearray(len(v)) for v in vals]
    assert c.get_into(ks, bufs) == [len(v) for v in vals]
    assert bufs == vals
    c.delete(ks[:1])
    s.restart()
    assert c.exists(ks) == [False] + [True] * 5
    late = keys(2, "late")
    assert c.put_from(late, [b"z" * 8192] * 2) == [Status.OK] * 2
    s.kill()
    s.start()
    assert c.exists(late) == [False, False]
    assert c.exists(ks[1:]) == [True] * 5


def test_forked_child_opens_its_own_connections(kv_server):
    import os

    c = kv.Client(kv_server.kv_endpoint, namespace="fork")
    ks = keys(2, "fork")
    c.put_from(ks[:1], [b"p" * 100])
    pid = os.fork()
    if pid == 0:  # child: the parent's connections are not touched
        code = 1
        try:
            buf = bytearray(100)
            if c.get_into(ks, [buf, bytearray(1)]) == [100, None] and buf == b"p" * 100:
                c.put_from(ks[1:], [b"c" * 10])
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # and the parent's connection still works, seeing the child's put
    assert c.exists(ks) == [True, True]


def test_batches_beyond_the_server_limit(client):
    # The server takes 1024 keys per request; the client splits.
    ks = keys(2500, "big")
    vals = [i.to_bytes(4, "little") * 16 for i in range(2500)]
    assert all(s.stored for s in client.put_from(ks, vals))
    assert client.prefix_hits(ks) == 2500
    bufs = [bytearray(64) for _ in ks]
    assert client.get_into(ks, bufs) == [64] * 2500
    assert bufs == [bytearray(v) for v in vals]
    assert client.delete(ks) == [True] * 2500


def test_empty_values(client):
    k = keys(1, "empty")
    assert client.put_from(k, [np.empty(0, np.uint8)]) == [Status.OK]
    assert client.get_into(k, [bytearray()]) == [0]
    assert client.get_into(k, [np.empty(0, np.float32)]) == [0]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_server_that_stops_answering_times_out(kv_server, transport):
    import os
    import signal

    c = kv.Client(kv_server.kv_endpoint, namespace="hang", transport=transport, timeout=1.0)
    ks = keys(2, "hang")
    c.put_from(ks, [b"h" * 64] * 2)
    pid = kv_server.proc.pid
    os.kill(pid, signal.SIGSTOP)  # alive, listening, silent
    try:
        # the signal lands asynchronously: wait until every thread is stopped
        while any(
            open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] != "T"
            for t in os.listdir(f"/proc/{pid}/task")
        ):
            pass
        with pytest.raises(kv.KvConnectionError, match="no answer from the KV server within"):
            c.exists(ks)
    finally:
        os.kill(pid, signal.SIGCONT)
    # the stuck connection was dropped; the next call uses a new one
    assert c.exists(ks) == [True, True]
    with pytest.raises(ValueError, match="timeout"):
        kv.Client(kv_server.kv_endpoint, timeout=0)


def test_gets_straight_from_the_arena_into_tensors(kv_server):
    """The path CUDA tensors take (tested here with CPU tensors): blocks
    located in the server's arena without a copy, copied from this
    process's read-only mapping of it into the tensors, checked against
    their checksums in the arena and their slots after the copy."""
    import torch

    c = kv.Client(kv_server.kv_endpoint, "arena", transport="shm")
    ks = keys(6, "arena")
    vals = [torch.randn(4096) for _ in ks]
    assert all(s.stored for s in c.put_from(ks[:5], vals[:5]))
    out = [torch.zeros(4096) for _ in ks]
    assert c._get_into_via_arena(ks, out) == [16384] * 5 + [None]
    for v, o in zip(vals[:5], out):
        assert torch.equal(v, o)
    assert not out[5].any()
    # A block whose slot is reused after it was located is not the copy's.
    located = c._locate(ks[:2])
    assert [e[1] for e in located.entries] == [16384, 16384]
    assert c.delete(ks[:1]) == [True]
    assert c._verify(located, False) == [False, True]
    assert c._verify(located, True) == [False, True]
    with pytest.raises(ValueError, match="holds"):
        c._get_into_via_arena(ks[1:2], [torch.zeros(10)])
    # A reader dropped (as after its server went away) is opened anew.
    c._drop_reader()
    again = [torch.zeros(4096)]
    assert c._get_into_via_arena(ks[1:2], again) == [16384]
    assert torch.equal(again[0], vals[1])
    c.close()
    # Over TCP there is no arena to copy from.
    t = kv.Client(kv_server.kv_endpoint, "arena", transport="tcp")
    assert t._reader_arena() is None
    with pytest.raises(ValueError, match="no arena"):
        t._get_into_via_arena(ks, out)
    t.close()


def test_device_path_says_whether_gets_copy_from_the_arena_and_why_not(kv_server, monkeypatch, caplog):
    """get_into into GPU memory falls back to pinned staging when the CUDA
    driver refuses to register the arena mapping (a device without
    read-only host registration) or there is no mapping (TCP). The fallback
    used to be silent: a benchmark could not tell a slow arena path from a
    staged one. device_path names the path and the reason, and a refusal
    is logged once."""
    import torch

    c = kv.Client(kv_server.kv_endpoint, "arena", transport="shm")
    assert c.device_path("cpu") == ("arena", None)
    calls = []

    def refuse(base, size):
        calls.append((base, size))
        return "the CUDA driver refused to register the arena mapping (for the test)"

    monkeypatch.setattr(kv, "_register_with_cuda", refuse)
    with caplog.at_level("WARNING", logger="tarn.kv"):
        assert c.device_path("cuda") == ("staged", "the CUDA driver refused to register the arena mapping (for the test)")
        assert c.device_path(torch.device("cuda")) == c.device_path("cuda")
    assert len(calls) == 1 and calls[0][1] > 0  # asked once, with the whole mapping
    assert sum("pinned host staging" in r.getMessage() for r in caplog.records) == 1
    # CPU copies need no registration: the mapping still serves them.
    assert c.device_path("cpu") == ("arena", None)
    # A registration that succeeds is made once and kept.
    c._drop_reader()
    monkeypatch.setattr(kv, "_register_with_cuda", lambda base, size: calls.append(base))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: type("rt", (), {"cudaHostUnregister": staticmethod(calls.append)}))
    assert c.device_path("cuda") == ("arena", None) == c.device_path("cuda")
    assert len(calls) == 2
    c._drop_reader()
    assert len(calls) == 3  # unregistered with the reader
    c.close()
    t = kv.Client(kv_server.kv_endpoint, "arena", transport="tcp")
    path, why = t.device_path("cuda")
    assert path == "staged" and "TCP" in why
    t.close()
