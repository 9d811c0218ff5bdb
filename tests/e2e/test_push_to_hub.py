"""`scaletune export RUN -o DIR --push-to-hub OWNER/NAME`, up to the network: the Hub cannot be
reached from here, so `HF_ENDPOINT` points at a listener on loopback that records what
huggingface_hub sends and answers as a failing Hub would (closing the connection, or 403). What
stays unverified: a real Hub's answers to create_repo and upload_folder (the commit URL)."""

from __future__ import annotations

import socket
import threading

import pytest

from tests.helpers import make_config, run_cli, train

TOKEN = "hf_scaletuneTEST0123456789abcdefghijkl"


class Listener:
    """A loopback TCP server that keeps each request's head and answers `reply` (b"": close)."""

    def __init__(self, reply: bytes) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply, self.requests = reply, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.requests.append(conn.recv(65536))
                if self.reply:
                    conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("push")
    cfg = make_config(tiny_model_dir, tmp / "run", training={"max_steps": 1, "save_every": 0})
    train(cfg, tmp)
    return tmp / "run"


def push(run, out, repo: str, env: dict):
    return run_cli(["export", str(run), "-o", str(out), "--push-to-hub", repo], env={"HF_HUB_OFFLINE": "0", **env})


def test_every_problem_before_anything_is_exported(run, tmp_path):
    proc = push(
        run, tmp_path / "out", "not a repo", {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    )
    assert proc.returncode == 2, proc.stderr
    for words in ("'not a repo': not a repo id", "HF_HUB_OFFLINE is set", "no Hugging Face token found"):
        assert words in proc.stderr, (words, proc.stderr)
    assert not (tmp_path / "out").exists()  # refused before the export


@pytest.mark.parametrize(
    "reply, said",
    [
        (b"", "could not be reached"),
        (b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", "HTTP 403"),
    ],
)
def test_the_token_goes_by_reference_to_the_hub_and_nowhere_else(run, tmp_path, reply, said):
    hub = Listener(reply)
    try:
        proc = push(run, tmp_path / "out", "team/tiny-run", {"HF_TOKEN": TOKEN, "HF_ENDPOINT": hub.url})
    finally:
        hub.close()
    assert proc.returncode == 1, proc.stderr
    assert said in proc.stderr and "team/tiny-run" in proc.stderr and hub.url in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert TOKEN not in proc.stdout + proc.stderr
    assert not any(TOKEN.encode() in f.read_bytes() for f in (tmp_path / "out").rglob("*") if f.is_file())
    # The request reached the boundary: huggingface_hub asked to create the repo, with the token
    # it read from HF_TOKEN in its Authorization header.
    heads = [r.split(b"\r\n\r\n")[0].decode().split("\r\n") for r in hub.requests]
    create = [h for h in heads if h[0].startswith("POST /api/repos/create ")]
    assert create, [h[0] for h in heads]
    auth = [v.strip() for k, _, v in (line.partition(":") for line in create[0][1:]) if k.lower() == "authorization"]
    assert auth == [f"Bearer {TOKEN}"], create[0]
    assert (tmp_path / "out" / "model.safetensors").is_file()  # the export is kept: nothing lost
