"""GET blocks verified in the page cache and sent as views of their files
(issue 44, `tarn_io::view`): on a plain connection a block that is all in
the page cache is checked there, through a small per-thread buffer, and
goes to the socket from its file with no copy kept in memory. The client
gets the same bytes as by any other path, whatever the geometry, size and
range; a block whose bytes in the page cache fail their checksum is read
the usual way and rebuilt from parity; an object overwritten or deleted
during a read still streams the version it started with; TLS and
`--no-sendfile` never use views."""

import random
import threading

import pytest

from conftest import data
from tarnproc import metric
from test_get_sendfile import bucket_of_sizes, check_gets, data_shard_files, flip_in_shard_0


@pytest.mark.parametrize("drives", [1, 4, 6, 12])
def test_warm_gets_go_as_views_and_read_right(make_server, drives):
    s = make_server(drives=drives)
    c, objs = bucket_of_sizes(s, f"views-{drives}")
    big = data(f"big-{drives}", 40 << 20)
    c.put_object(Bucket="bkt", Key="big", Body=big)
    objs["big"] = big
    rng = random.Random(drives)
    # The first pass brings the blocks into the page cache; the second
    # finds them there.
    check_gets(c, "bkt", objs, rng)
    before = metric(s, "tarn_get_file_view_bytes_total")
    check_gets(c, "bkt", objs, rng)
    viewed = metric(s, "tarn_get_file_view_bytes_total") - before
    whole = sum(len(v) for v in objs.values())
    if drives == 12:
        # More data blocks a stripe than half a GET's queue: whole stripes
        # go the usual way (copied, verified, sent from the files), only
        # ranges that touch a few blocks go as views.
        assert 0 < viewed < whole // 2, viewed
    else:
        # Whole reads of everything but the inline objects, at least.
        assert viewed >= whole // 2, viewed
    assert metric(s, "tarn_get_sendfile_fallbacks_total") == 0


def test_a_block_corrupt_in_the_page_cache_is_rebuilt(make_server):
    """A byte flipped through the page cache (so the cache holds it): the
    view's check fails, the usual read catches it too and rebuilds the block
    from parity; the client never sees the flipped byte."""
    s = make_server(drives=4, expected_errors=("failed its checksum", "corrupt", "reconstruct"))
    c = s.client()
    c.create_bucket(Bucket="bkt")
    body = data("warm-corrupt", 8 << 20)
    c.put_object(Bucket="bkt", Key="k", Body=body)
    assert c.get_object(Bucket="bkt", Key="k")["Body"].read() == body
    assert c.get_object(Bucket="bkt", Key="k")["Body"].read() == body
    assert metric(s, "tarn_get_file_view_bytes_total") >= len(body) // 2
    files = data_shard_files(s, 2)
    assert len(files) == 2, files
    misses = metric(s, "tarn_get_file_view_misses_total")
    flip_in_shard_0(files, (1 << 20) + 77, 0x5A)
    assert c.get_object(Bucket="bkt", Key="k")["Body"].read() == body
    got = c.get_object(Bucket="bkt", Key="k", Range="bytes=1000000-3000000")["Body"].read()
    assert got == body[1000000:3000001]
    assert metric(s, "tarn_get_file_view_misses_total") > misses
    assert metric(s, "tarn_shards_reconstructed_total") >= 1


def test_a_read_keeps_its_version_while_the_key_changes(make_server):
    """Views of a version's files outlive an overwrite and a delete of the
    key mid-read (its files are pinned, then unlinked, never changed): the
    reader gets the whole old body; the next read sees the new state."""
    s = make_server(drives=4)
    c = s.client()
    c.create_bucket(Bucket="bkt")
    old = data("old", 48 << 20)
    new = data("new", 48 << 20)
    c.put_object(Bucket="bkt", Key="k", Body=old)
    c.put_object(Bucket="bkt", Key="gone", Body=old)
    assert c.get_object(Bucket="bkt", Key="k")["Body"].read() == old  # warm
    for key, change in [("k", lambda: c.put_object(Bucket="bkt", Key="k", Body=new)),
                        ("gone", lambda: c.delete_object(Bucket="bkt", Key="gone"))]:  # fmt: skip
        viewed = metric(s, "tarn_get_file_view_bytes_total")
        body = c.get_object(Bucket="bkt", Key=key)["Body"]
        head = body.read(4 << 20)
        t = threading.Thread(target=change)
        t.start()
        t.join()
        rest = body.read()
        assert head + rest == old, key
        assert metric(s, "tarn_get_file_view_bytes_total") > viewed
    assert c.get_object(Bucket="bkt", Key="k")["Body"].read() == new
    with pytest.raises(c.exceptions.NoSuchKey):
        c.get_object(Bucket="bkt", Key="gone")


def test_no_sendfile_means_no_views(make_server):
    s = make_server(drives=4, extra_args=["--no-sendfile"])
    c, objs = bucket_of_sizes(s, "noviews")
    check_gets(c, "bkt", objs, random.Random(3))
    check_gets(c, "bkt", objs, random.Random(4))
    assert metric(s, "tarn_get_file_view_bytes_total") == 0
    assert metric(s, "tarn_get_sendfile_bytes_total") == 0
