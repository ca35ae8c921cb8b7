"""The history checker's pieces shared by the cluster history tests
(test_cluster_history.py, test_cluster_partitions.py): a thread-safe
history of operations with their invocation and completion times, and what
a read may return given the writes around it (per key, as a register). A
write that failed or timed out is indeterminate: it may take effect at any
time after its invocation, so its end is infinity."""

import threading

INF = float("inf")

# A history's clients make one attempt per operation. botocore's
# `max_attempts` counts retries: with it, a write whose first attempt timed
# out (its node paused) was sent again, and the first attempt, still queued
# on the node, could take effect after the retry had been answered and
# recorded, after later writes too (an old value read again, counted
# stale); a create's retry answered 412 to its own first attempt (recorded
# as a refusal, its value then read as one no write wrote).
ONE_ATTEMPT = {"total_max_attempts": 1}


class History:
    def __init__(self):
        self.ops = []
        self.lock = threading.Lock()

    def add(self, **op):
        with self.lock:
            self.ops.append(op)


def writes_of(history, key):
    """The key's writes: the initial absence (completed before anything),
    then every PUT and DELETE, indeterminate ones ending at infinity."""
    out = [{"value": None, "start": -INF, "end": -INF}]
    out += [o for o in history if o["kind"] in ("put", "delete") and o["key"] == key]
    return out


def possible(writes, start, end):
    """The values a read invoked at `start` and completed at `end` may
    return: each write invoked before `end` that no write invoked after it
    completed and completed before `start` supersedes."""
    # A write is superseded when it completed before some write began that
    # completed before the read began: before the latest such beginning.
    latest = max((o["start"] for o in writes if o["end"] < start), default=-INF)
    return [w["value"] for w in writes if w["start"] <= end and not w["end"] < latest]


def name_of(value):
    """A value by its name (key/writer/sequence, the head the tests' values
    start with), None for an absent key."""
    return b"/".join(value.split(b"/")[:3]).decode() if value else None


def around(writes, op):
    """The writes near an operation the checker refused, for the message."""
    near = [w for w in writes if w["end"] >= op["start"] - 2 and w["start"] <= op["end"] + 1]
    return " (its writes near it: " + ", ".join(
        f"{'put ' + name_of(w['value']) if w['value'] else 'delete'}"
        f" {w['start']:.3f}..{w['end']:.3f}" for w in near) + f"; it ended {op['end']:.3f}" + (f", via n{op['via']})" if "via" in op else ")")


class Register:
    """`possible` for many reads of one key at once: the writes sorted by
    completion with the latest beginning so far, so that what a read may
    return is found by bisection instead of a pass over every write."""

    def __init__(self, writes):
        import bisect

        self._bisect = bisect
        done = sorted(writes, key=lambda w: w["end"])
        self.ends = [w["end"] for w in done]
        self.latest_start = []
        m = -INF
        for w in done:
            m = max(m, w["start"])
            self.latest_start.append(m)
        self.by_value = {}
        for w in writes:
            self.by_value.setdefault(w["value"], []).append(w)
        # Writes of a value by beginning, for "any present value" queries.
        self.present = sorted((w for w in writes if w["value"] is not None), key=lambda w: w["start"])
        self.present_starts = [w["start"] for w in self.present]
        # The latest completion among present writes beginning before t.
        self.present_end_max = []
        m = -INF
        for w in self.present:
            m = max(m, w["end"])
            self.present_end_max.append(m)

    def _latest(self, start):
        i = self._bisect.bisect_left(self.ends, start)
        return self.latest_start[i - 1] if i else -INF

    def allows(self, value, start, end):
        """Whether a read invoked at `start`, completed at `end`, may
        return `value` (as `possible` says)."""
        latest = self._latest(start)
        return any(w["start"] <= end and not w["end"] < latest for w in self.by_value.get(value, ()))

    def allows_present(self, start, end):
        """Whether such a read may find the key present (any value)."""
        latest = self._latest(start)
        i = self._bisect.bisect_right(self.present_starts, end)
        return i > 0 and not self.present_end_max[i - 1] < latest
