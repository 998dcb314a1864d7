"""A real S3 endpoint on 127.0.0.1 for the bucket tests (moto's server, as s3fs's own tests use it)."""

import contextlib
import os
import socket

import pytest

from lab import remote

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A real S3 endpoint on 127.0.0.1 and the environment that points s3fs at it (a bucket `runs`)."""
    with start_s3() as env:
        yield env


@contextlib.contextmanager
def start_s3():
    """moto's S3 server on a free port of 127.0.0.1, the environment pointing at it, and a bucket `runs`; skips the
    test, naming the packages, where s3fs or moto's server is not installed."""
    pytest.importorskip("s3fs", reason="the bucket tests need s3fs (pip install s3fs)")
    moto_server = pytest.importorskip("moto.server", reason="the bucket tests run moto's S3 server (pip install "
                                                            "'moto[server]')")

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()
    if not s3fs.S3FileSystem().exists("runs"):  # moto's buckets live in this process: another module's server made it
        s3fs.S3FileSystem().mkdir("runs")
    try:
        yield env
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        s3fs.S3FileSystem.clear_instance_cache()


def bucket_steps(url):
    fs, root = remote.filesystem(url)
    return sorted(remote.complete_checkpoints(fs, root))
