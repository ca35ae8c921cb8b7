"""A TCP proxy in front of a real server that misbehaves on cue, for the
clients' fault tests: each new connection takes the next scripted action
(or the standing one): pass bytes through, answer the first request with an
error status, reset the connection after some bytes of the answer, or stall
the answer for a while. Threads only; stopped by `close()`."""

import socket
import struct
import threading
import time


class FaultProxy:
    def __init__(self, target_host, target_port):
        self.target = (target_host, target_port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.actions = []
        self.standing = ("pass",)
        self.connections = 0
        self.lock = threading.Lock()
        self.closed = False
        self.open = []
        threading.Thread(target=self._accept, daemon=True).start()

    def script(self, *actions):
        """Actions for the next connections, in order: ("pass",),
        ("status", 503), ("reset", nbytes), ("stall", nbytes, seconds)."""
        with self.lock:
            self.actions.extend(actions)

    def limit(self, bytes_per_second):
        """Caps the answers of every connection together at this rate (a
        slow upstream); None lifts it."""
        with self.lock:
            self.rate = bytes_per_second
            self.rate_next = time.monotonic()

    def _pace(self, n):
        with self.lock:
            rate = getattr(self, "rate", None)
            if not rate:
                return
            now = time.monotonic()
            start = max(now, self.rate_next)
            self.rate_next = start + n / rate
        if start > now:
            time.sleep(start - now)

    def always(self, action):
        with self.lock:
            self.standing = action

    def drop_all(self):
        """Closes every connection open now (pooled clients must connect
        again, and take the next action)."""
        for s in list(self.open):
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def close(self):
        self.closed = True
        self.sock.close()
        for s in list(self.open):
            try:
                s.close()
            except OSError:
                pass

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                action = self.actions.pop(0) if self.actions else self.standing
                self.connections += 1
            self.open.append(c)
            threading.Thread(target=self._serve, args=(c, action), daemon=True).start()

    def _serve(self, c, action):
        if action[0] == "status":
            # Read the request head, answer with an S3 error, close.
            buf = b""
            while b"\r\n\r\n" not in buf:
                got = c.recv(65536)
                if not got:
                    break
                buf += got
            body = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
            c.sendall(
                b"HTTP/1.1 %d Injected\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (action[1], len(body), body)
            )
            c.close()
            return
        try:
            u = socket.create_connection(self.target)
        except OSError:
            c.close()
            return
        self.open.append(u)
        threading.Thread(target=self._pipe, args=(c, u, None), daemon=True).start()
        self._pipe(u, c, action)

    def _pipe(self, src, dst, action):
        """Copies src to dst; on the answer side, applies the action."""
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if action and action[0] == "reset" and sent + len(data) >= action[1]:
                    dst.sendall(data[: max(0, action[1] - sent)])
                    dst.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    # Wake the thread reading the request side first: a
                    # socket closed while another thread is blocked in its
                    # recv() is not torn down (no RST) until that returns.
                    try:
                        dst.shutdown(socket.SHUT_RD)
                    except OSError:
                        pass
                    dst.close()
                    src.close()
                    return
                if action and action[0] == "stall" and sent < action[1] <= sent + len(data):
                    cut = action[1] - sent
                    dst.sendall(data[:cut])
                    time.sleep(action[2])
                    data = data[cut:]
                    sent += cut
                if action is not None:
                    self._pace(len(data))
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
