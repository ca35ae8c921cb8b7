"""The Helm chart (deploy/helm/tarn) rendered by Helm's own engine
(helm-python-sdk: Helm v4 as a library, from PyPI) in both modes and with
TLS, KV and a ServiceMonitor, every manifest validated against the
Kubernetes schemas (kubernetes-validate) and checked for what the issue
asks: a PVC per drive, anti-affinity, a PDB, probes on /health/*, Secrets
for credentials and TLS, a non-root read-only container; and the values
Tarn would refuse, refused at render time."""

import os

import pytest
import yaml

helm = pytest.importorskip("helm_python.chart")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = os.path.join(os.path.dirname(__file__), "..", "deploy", "helm", "tarn")
KUBE = "1.30"


def render(values):
    out = helm.Chart.load(CHART).render(values, name="tarn", namespace="store", is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def validate(docs):
    for d in docs:
        if d["kind"] == "ServiceMonitor":
            continue  # a CRD: checked by hand below
        kubernetes_validate.validate(d, KUBE, strict=True)


def server(docs):
    (sts,) = [d for d in by_kind(docs, "StatefulSet") if d["metadata"]["name"] == "tarn"]
    return sts, sts["spec"]["template"]["spec"]["containers"][0]


def test_single_node_renders_and_validates():
    docs = render({})
    validate(docs)
    sts, c = server(docs)
    assert sts["spec"]["replicas"] == 1
    assert len(sts["spec"]["volumeClaimTemplates"]) == 4
    assert [a for a in c["args"] if a.startswith("--drive=")] == [f"--drive=/data/d{i}" for i in range(4)]
    assert "--allow-plain-http" in c["args"] and not any(a.startswith("--cluster") for a in c["args"])
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"
    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert not by_kind(docs, "PodDisruptionBudget") and not by_kind(docs, "Job")
    (secret,) = by_kind(docs, "Secret")
    assert set(secret["data"]) == {"access-key", "secret-key", "cluster-secret"}
    env = {e["name"]: e for e in c["env"]}
    assert env["TARN_SECRET_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "secret-key"


def test_cluster_with_tls_kv_and_a_service_monitor():
    docs = render({"mode": "cluster", "replicas": 5, "kv": {"enabled": True},
                   "tls": {"enabled": True, "existingSecret": "tarn-tls"},
                   "serviceMonitor": {"enabled": True}})  # fmt: skip
    validate(docs)
    sts, c = server(docs)
    assert sts["spec"]["replicas"] == 5
    args = c["args"]
    assert "--cluster=tarn" in args and "--node-id=$(POD_NAME)" in args
    assert any(a.startswith("--etcd=http://tarn-etcd-0.tarn-etcd:2379,") for a in args)
    assert "--tls-cert=/etc/tarn/tls/tls.crt" in args and "--allow-plain-http" not in args
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    pod = sts["spec"]["template"]["spec"]
    assert pod["volumes"][0]["secret"]["secretName"] == "tarn-tls"
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    names = {d["metadata"]["name"] for d in by_kind(docs, "Service")}
    assert {"tarn", "tarn-admin", "tarn-kv", "tarn-headless", "tarn-etcd"} <= names
    (job,) = by_kind(docs, "Job")
    assert "--parity-shards=2" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    (sm,) = by_kind(docs, "ServiceMonitor")
    ep = sm["spec"]["endpoints"][0]
    assert ep["path"] == "/metrics" and ep["scheme"] == "https"
    assert ep["bearerTokenSecret"] == {"name": "tarn-credentials", "key": "secret-key"}


def test_an_existing_etcd_and_secret_are_used():
    docs = render({"mode": "cluster", "etcd": {"deploy": False, "endpoints": "https://etcd.infra:2379"},
                   "credentials": {"existingSecret": "mine"}})  # fmt: skip
    validate(docs)
    _, c = server(docs)
    assert "--etcd=https://etcd.infra:2379" in c["args"]
    assert not by_kind(docs, "Secret") and not [d for d in by_kind(docs, "StatefulSet") if "etcd" in d["metadata"]["name"]]


def test_cosi_driver_and_the_kv_socket_on_the_host():
    docs = render({"mode": "cluster", "kv": {"enabled": True, "hostSocketDir": "/run/tarn-kv"},
                   "cosi": {"enabled": True, "sidecarImage": "registry.example.com/objectstorage-sidecar:v1"}})  # fmt: skip
    validate(docs)
    _, c = server(docs)
    assert "--kv-shm-dir=/run/tarn-kv" in c["args"]
    assert {"name": "kv-socket", "mountPath": "/run/tarn-kv"} in c["volumeMounts"]
    sts, _ = server(docs)
    (vol,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "kv-socket"]
    assert vol["hostPath"] == {"path": "/run/tarn-kv", "type": "Directory"}
    (dep,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "tarn-cosi"]
    pod = dep["spec"]["template"]["spec"]
    driver, sidecar = pod["containers"]
    assert driver["args"][0] == "cosi" and "--s3-endpoint=http://tarn.store.svc:9000" in driver["args"]
    assert "--admin-endpoint=http://tarn-admin.store.svc:9001" in driver["args"]
    assert {"name": "COSI_ENDPOINT", "value": "unix:///var/lib/cosi/cosi.sock"} in driver["env"]
    assert sidecar["image"] == "registry.example.com/objectstorage-sidecar:v1"
    assert all({"name": "socket", "mountPath": "/var/lib/cosi"} in x["volumeMounts"] for x in (driver, sidecar))
    assert pod["serviceAccountName"] == "tarn-cosi" and pod["securityContext"]["fsGroup"] == 65532
    (role,) = by_kind(docs, "ClusterRole")
    assert any("bucketaccesses" in r["resources"] for r in role["rules"])
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    assert binding["subjects"][0] == {"kind": "ServiceAccount", "name": "tarn-cosi", "namespace": "store"}


@pytest.mark.parametrize("values,why", [
    ({"mode": "both"}, "mode must be single or cluster"),
    ({"tls": {"enabled": True}}, "tls.existingSecret"),
    ({"tls": {"allowPlainHttp": False}}, "allowPlainHttp"),
    ({"mode": "cluster", "replicas": 3}, "cannot hold sets of 2+2"),
    ({"mode": "cluster", "etcd": {"deploy": False}}, "etcd.endpoints is required"),
    ({"kv": {"hostSocketDir": "/run/tarn-kv"}}, "set kv.enabled too"),
    ({"kv": {"enabled": True, "hostSocketDir": "run"}}, "absolute path"),
    ({"cosi": {"enabled": True}}, "cosi.sidecarImage"),
])  # fmt: skip
def test_values_tarn_would_refuse_fail_the_render(values, why):
    with pytest.raises(Exception) as e:
        render(values)
    assert why in str(e.value), e.value
