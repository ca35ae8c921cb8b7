"""Whole-process crash consistency: writers put self-describing bodies while the
server is SIGKILLed at random moments, again and again. After every restart each
key holds exactly its last acknowledged generation or the one that was in
flight, every byte verifies, and the listing shows exactly the readable keys."""

import hashlib
import random
import threading
import time

import botocore.exceptions
import pytest

from conftest import data

SIZES = [100, 200_000, 1_500_000]
WRITERS = 6
KEYS_PER_WRITER = 3


def body_for(key, gen):
    head = f"{key}|{gen}|".encode()
    size = SIZES[gen % len(SIZES)]
    seed = int.from_bytes(hashlib.sha256(head).digest()[:8], "little")
    return head + data(seed, size)


def parse(b):
    key, gen, _ = b.split(b"|", 2)
    return key.decode(), int(gen)


def test_random_kills_never_lose_or_tear(make_server):
    server = make_server(expected_errors=[r"shard write failed", r"metadata write failed"])
    s3 = server.client()
    s3.create_bucket(Bucket="kills")
    rng = random.Random(7)
    acked = {}  # key -> last acknowledged generation
    inflight = {}  # key -> generation being written when the server died
    gens = {}
    for round_ in range(6):
        stop = threading.Event()
        lock = threading.Lock()

        def writer(w):
            c = server.client()
            i = 0
            while not stop.is_set():
                key = f"w{w}-k{i % KEYS_PER_WRITER}"
                i += 1
                with lock:
                    gen = gens.get(key, 0) + 1
                    gens[key] = gen
                    inflight[key] = gen
                try:
                    c.put_object(Bucket="kills", Key=key, Body=body_for(key, gen))
                except Exception:
                    return  # the server is gone; this generation stays in flight
                with lock:
                    acked[key] = gen
                    inflight.pop(key, None)

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.3, 1.2))
        server.kill()
        stop.set()
        for t in threads:
            t.join()
        server.start()
        s3 = server.client()
        readable = set()
        for key in sorted(gens):
            try:
                b = s3.get_object(Bucket="kills", Key=key)["Body"].read()
            except botocore.exceptions.ClientError as e:
                assert e.response["Error"]["Code"] == "NoSuchKey"
                assert key not in acked, f"round {round_}: acknowledged {key} gen {acked[key]} was lost"
                continue
            k, gen = parse(b)
            assert k == key, f"round {round_}: {key} holds the body of {k}"
            assert b == body_for(key, gen), f"round {round_}: {key} gen {gen} is torn or corrupt"
            allowed = {acked.get(key), inflight.get(key)} - {None}
            assert gen in allowed, f"round {round_}: {key} holds gen {gen}, expected one of {allowed}"
            acked[key] = gen  # what survived is now the baseline
            inflight.pop(key, None)
            readable.add(key)
        listed = {o["Key"] for o in s3.list_objects_v2(Bucket="kills").get("Contents", [])}
        assert listed == readable, f"round {round_}: listing {sorted(listed)} != readable {sorted(readable)}"
    assert len(acked) == WRITERS * KEYS_PER_WRITER
