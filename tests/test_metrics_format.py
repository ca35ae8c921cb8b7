"""/metrics is valid Prometheus text (every family with one HELP and one
TYPE, its samples together under them), carries the build, uptime and
per-drive capacity, and the Grafana dashboard in deploy/grafana uses only
series it exports."""

import json
import os
import re
import urllib.request

from tarnproc import SECRET_KEY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIXES = ("_bucket", "_sum", "_count")


def scrape(server):
    req = urllib.request.Request(server.admin + "/metrics", headers={"Authorization": f"Bearer {SECRET_KEY}"})
    return urllib.request.urlopen(req, timeout=10).read().decode()


def families(text):
    """{name: kind}, checking the text format on the way."""
    helps, types, current, seen_samples = set(), {}, None, set()
    for line in text.splitlines():
        if not line:
            continue
        m = re.match(r"^# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*) (.+)$", line)
        if m:
            kind, name, rest = m.groups()
            if kind == "HELP":
                assert name not in helps, f"a second HELP for {name}"
                assert rest.strip(), f"an empty HELP for {name}"
                helps.add(name)
            else:
                assert name not in types, f"a second TYPE for {name}"
                assert rest in ("counter", "gauge", "histogram", "summary", "untyped"), line
                assert name in helps, f"TYPE before HELP for {name}"
                types[name] = rest
                current = name
            continue
        assert not line.startswith("#"), line
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        assert m, f"not a sample line: {line!r}"
        name, _, value = m.groups()
        float(value)
        family = name
        if name not in types:
            family = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s) and name[: -len(s)] in types), name)
        assert family in types, f"a sample of {name} with no TYPE"
        assert family == current, f"{name}'s samples are not together under its TYPE (after {current})"
        seen_samples.add(family)
    assert helps == set(types), helps ^ set(types)
    return types


def test_metrics_text_and_the_dashboard(make_server):
    server = make_server(drives=2, extra_args=["--kv", "--kv-listen", "127.0.0.1:0", "--kv-memory", "64MiB"])
    s3 = server.client()
    s3.create_bucket(Bucket="metrics-format")
    s3.put_object(Bucket="metrics-format", Key="k", Body=b"x" * 1000)
    s3.get_object(Bucket="metrics-format", Key="k")["Body"].read()
    text = scrape(server)
    types = families(text)
    for name, kind in [("tarn_requests_total", "counter"), ("tarn_request_duration_seconds", "histogram"),
                       ("tarn_build_info", "gauge"), ("tarn_uptime_seconds", "gauge"),
                       ("tarn_drive_total_bytes", "gauge"), ("tarn_drive_free_bytes", "gauge"),
                       ("tarn_drive_used_bytes", "gauge"), ("tarn_kv_ram_used_bytes", "gauge"),
                       ("tarn_kv_evicted_dropped", "counter"), ("tarn_kv_namespace", "counter")]:
        assert types.get(name) == kind, (name, types.get(name))
    assert re.search(r'^tarn_build_info\{version="[^"]+"\} 1$', text, re.M)
    assert len(re.findall(r"^tarn_drive_total_bytes\{", text, re.M)) == 2
    # Bytes in and out by operation.
    put_in = int(re.search(r'^tarn_request_bytes_in_total\{op="PutObject"\} (\d+)$', text, re.M).group(1))
    get_out = int(re.search(r'^tarn_response_bytes_out_total\{op="GetObject"\} (\d+)$', text, re.M).group(1))
    assert put_in >= 1000 and get_out == 1000, (put_in, get_out)

    dash = json.load(open(os.path.join(ROOT, "deploy", "grafana", "tarn.json")))
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    used = set()
    for e in exprs:
        for name in re.findall(r"\btarn_[a-z0-9_]+", e):
            family = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s) and name[: -len(s)] in types), name)
            assert family in types, f"the dashboard uses {name}, which /metrics does not export"
            used.add(family)
    # It covers what an operator looks at first.
    assert {"tarn_requests_total", "tarn_request_duration_seconds", "tarn_drive_free_bytes",
            "tarn_under_replicated", "tarn_kv_namespace"} <= used
