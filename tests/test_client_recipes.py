"""The client recipes of docs/clients.md, run as written (the server's
ephemeral endpoint in place of 127.0.0.1:9000): the aws CLI, boto3, s3cmd
and rclone each copy a directory up (one file large enough for their
multipart upload), list it and copy it back, byte for byte."""

import filecmp
import os
import shutil
import subprocess
import sys

import pytest

from conftest import data
from tarnproc import ACCESS_KEY, SECRET_KEY


def tree(root, big):
    """A directory with small files, a nested one and one of `big` bytes."""
    os.makedirs(os.path.join(root, "sub"))
    for i in range(5):
        with open(os.path.join(root, f"f{i}.bin"), "wb") as f:
            f.write(data(i, 1000 + 37 * i))
    with open(os.path.join(root, "sub", "nested.txt"), "wb") as f:
        f.write(b"nested\n")
    with open(os.path.join(root, "big.safetensors"), "wb") as f:
        f.write(data("big", big))
    return root


def same_tree(a, b):
    cmp = filecmp.dircmp(a, b)
    assert not cmp.left_only and not cmp.right_only and not cmp.diff_files, (cmp.left_only, cmp.right_only, cmp.diff_files)
    for sub in cmp.common_dirs:
        same_tree(os.path.join(a, sub), os.path.join(b, sub))
    # filecmp compares contents only where stat signatures differ: force it.
    for name in cmp.common_files:
        assert filecmp.cmp(os.path.join(a, name), os.path.join(b, name), shallow=False), name


def sh(cmd, env):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"
    return r.stdout


def clean_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))}
    env["HOME"] = str(tmp_path / "home")
    os.makedirs(env["HOME"], exist_ok=True)
    return env


def test_aws_cli_recipe(server, tmp_path):
    src = tree(str(tmp_path / "llama-3-8b"), 20 << 20)
    env = clean_env(tmp_path)
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=server.endpoint)
    aws = os.path.join(os.path.dirname(sys.executable), "aws")
    sh([aws, "s3", "mb", "s3://models"], env)
    sh([aws, "s3", "cp", "--recursive", src, "s3://models/llama-3-8b/"], env)
    listing = sh([aws, "s3", "ls", "--recursive", "s3://models/llama-3-8b/"], env)
    assert "llama-3-8b/big.safetensors" in listing and "llama-3-8b/sub/nested.txt" in listing
    sh([aws, "s3", "sync", "s3://models/llama-3-8b/", str(tmp_path / "copy")], env)
    same_tree(src, str(tmp_path / "copy"))
    # The profile form: endpoint_url in ~/.aws/config.
    os.makedirs(os.path.join(env["HOME"], ".aws"))
    with open(os.path.join(env["HOME"], ".aws", "config"), "w") as f:
        f.write(f"[profile tarn]\nregion = us-east-1\nendpoint_url = {server.endpoint}\n")
    with open(os.path.join(env["HOME"], ".aws", "credentials"), "w") as f:
        f.write(f"[tarn]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL"):
        env.pop(k)
    assert "big.safetensors" in sh([aws, "--profile", "tarn", "s3", "ls", "s3://models/llama-3-8b/"], env)


def test_boto3_recipe(server, tmp_path):
    import boto3

    path = tmp_path / "shard-0000.tar"
    path.write_bytes(data("shard", 12 << 20))
    s3 = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket="datasets")
    s3.upload_file(str(path), "datasets", "train/shard-0000.tar")
    # Above 8 MiB boto3 uploads in parts: the ETag says so.
    assert s3.head_object(Bucket="datasets", Key="train/shard-0000.tar")["ETag"].endswith('-2"')
    s3.download_file("datasets", "train/shard-0000.tar", str(tmp_path / "back.tar"))
    assert (tmp_path / "back.tar").read_bytes() == path.read_bytes()


def test_s3cmd_recipe(server, tmp_path):
    src = tree(str(tmp_path / "run-17"), 20 << 20)
    env = clean_env(tmp_path)
    host = server.endpoint.removeprefix("http://")
    cfg = tmp_path / "s3cfg"
    cfg.write_text(f"[default]\naccess_key = {ACCESS_KEY}\nsecret_key = {SECRET_KEY}\n"
                   f"host_base = {host}\nhost_bucket = {host}\nuse_https = False\n")
    s3cmd = ["s3cmd", "-c", str(cfg)]
    sh(s3cmd + ["mb", "s3://logs"], env)
    sh(s3cmd + ["put", "--recursive", src + "/", "s3://logs/run-17/"], env)
    # The 20 MiB file went in 15 MiB parts.
    assert server.client().head_object(Bucket="logs", Key="run-17/big.safetensors")["ETag"].endswith('-2"')
    listing = sh(s3cmd + ["ls", "--recursive", "s3://logs/run-17/"], env)
    assert "run-17/big.safetensors" in listing and "run-17/sub/nested.txt" in listing
    os.makedirs(tmp_path / "back")
    sh(s3cmd + ["sync", "s3://logs/run-17/", str(tmp_path / "back") + "/"], env)
    same_tree(src, str(tmp_path / "back"))


@pytest.mark.skipif(shutil.which("rclone") is None, reason="rclone not installed (scripts/test installs it)")
def test_rclone_recipe(server, tmp_path):
    src = tree(str(tmp_path / "step-1000"), 20 << 20)
    env = clean_env(tmp_path)
    conf = tmp_path / "home" / ".config" / "rclone"
    conf.mkdir(parents=True)
    (conf / "rclone.conf").write_text(
        f"[tarn]\ntype = s3\nprovider = Other\nendpoint = {server.endpoint}\n"
        f"access_key_id = {ACCESS_KEY}\nsecret_access_key = {SECRET_KEY}\nregion = us-east-1\n")
    sh(["rclone", "mkdir", "tarn:checkpoints"], env)
    sh(["rclone", "copy", src, "tarn:checkpoints/run1/step-1000"], env)
    # Sizes and MD5s agree (rclone hashes the local side, reads the remote's).
    sh(["rclone", "check", src, "tarn:checkpoints/run1/step-1000"], env)
    sh(["rclone", "sync", "tarn:checkpoints/run1/step-1000", str(tmp_path / "restored")], env)
    same_tree(src, str(tmp_path / "restored"))
    # Its multipart upload too (a cutoff below the big file's size), and
    # the environment-variable form of the same remote.
    env2 = clean_env(tmp_path)
    env2.update(RCLONE_CONFIG_ENV_TYPE="s3", RCLONE_CONFIG_ENV_PROVIDER="Other",
                RCLONE_CONFIG_ENV_ENDPOINT=server.endpoint, RCLONE_CONFIG_ENV_ACCESS_KEY_ID=ACCESS_KEY,
                RCLONE_CONFIG_ENV_SECRET_ACCESS_KEY=SECRET_KEY, RCLONE_CONFIG_ENV_REGION="us-east-1")
    sh(["rclone", "copy", "--s3-upload-cutoff", "5M", "--s3-chunk-size", "5M", src, "env:checkpoints/parts"], env2)
    assert server.client().head_object(Bucket="checkpoints", Key="parts/big.safetensors")["ETag"].endswith('-4"')
    sh(["rclone", "check", src, "env:checkpoints/parts"], env2)
