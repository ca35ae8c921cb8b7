"""The local-read protocol by hand (docs/local-reads.md), standard library
only: what tests/test_local_reads.py uses to say what a hostile process can
and cannot get, also from a process of another user."""

import hashlib
import hmac
import os
import socket
import struct


def proof(secret, server_nonce, nonce, access_key):
    return hmac.new(secret.encode(), b"tarn-local-read-v1 client" + server_nonce + nonce + access_key.encode(),
                    hashlib.sha256).digest()


class Raw:
    """One connection to a node's local-read socket."""

    def __init__(self, name):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(10)
        self.s.connect("\0" + name)

    def send(self, typ, body=b""):
        self.s.sendall(struct.pack("<IB", len(body) + 1, typ) + body)

    def recv(self):
        """(type, body, fds); (None, b"", []) when the server closed."""
        fds = []
        head = b""
        while len(head) < 4:
            msg, anc, _, _ = socket.recv_fds(self.s, 4 - len(head), 64)
            if not msg:
                return None, b"", fds
            head += msg
            fds += anc
        (n,) = struct.unpack("<I", head)
        body = b""
        while len(body) < n:
            chunk = self.s.recv(n - len(body))
            if not chunk:
                return None, b"", fds
            body += chunk
        return body[0], body[1:], fds

    @staticmethod
    def s16(s):
        b = s.encode()
        return struct.pack("<H", len(b)) + b

    def hello(self):
        self.send(1, b"TRNL" + struct.pack("<HH", 1, 1))
        typ, body, _ = self.recv()
        assert typ == 2, (typ, body)
        return body[2:34]

    def auth(self, ak, sk, server_nonce=None, given=None):
        server_nonce = server_nonce if server_nonce is not None else self.hello()
        nonce = os.urandom(32)
        self.send(3, self.s16(ak) + nonce + (given if given is not None else proof(sk, server_nonce, nonce, ak)))
        return self.recv()

    def layout(self, bucket, key, start, end, version="", if_match="", rid=5):
        body = struct.pack("<I", rid) + self.s16(bucket) + self.s16(key) + self.s16(version) + self.s16(if_match)
        self.send(5, body + struct.pack("<QQ", start, end))
        return self.recv()
