"""Models from the Hugging Face hub: what a hub name means (`org/name[@revision][:QUANT]`), downloading
the files brisk needs into the HF cache (`brisk pull`), and finding them there again.

Downloads go through huggingface_hub, so its cache layout, progress bars and retries apply. Two
things are added here: the weights (the hub's LFS files) are downloaded through a partial file that
outlives an interrupted pull (huggingface_hub deletes its own), and every file is checked against
the checksum the hub lists for it (huggingface_hub's plain HTTP download checks only the size).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import FileError

HUB_NAME = re.compile(r"^(?P<repo>\w[\w.-]*/\w[\w.-]*)(?:@(?P<revision>[\w./-]+))?(?::(?P<quant>[\w.-]+))?$")
# what brisk reads from an HF checkpoint; never pickles (*.bin, *.pt), ONNX or other formats
HF_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
# a GGUF's quant type as its file name carries it: Q4_K_M, IQ3_XXS, Q8_0, BF16, MXFP4_MOE, ...
_QUANT_IN_NAME = re.compile(r"(?i)(?:^|[-_.])((?:UD-)?(?:I?Q\d+(?:_[A-Z0-9]+)*|T?Q\d_\d|B?F16|F32|MXFP4(?:_MOE)?))$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")


class NotCached(FileError):
    """A hub model that was never downloaded into the local cache."""


class NotOnHub(FileError):
    """A hub model the hub did not list: not there, not reachable, or private."""


@dataclass
class HubName:
    repo: str
    revision: str | None  # None: the default branch
    quant: str | None  # a GGUF quant type, as typed

    @property
    def text(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.quant}" if self.quant else "")


def parse(name: str) -> HubName | None:
    """`org/name[@revision][:QUANT]` as a HubName; None for anything else (a path, a file name)."""
    m = HUB_NAME.match(name)
    return HubName(m["repo"], m["revision"], m["quant"]) if m else None


def quant_of(filename: str) -> str | None:
    """The quant type a GGUF file's name carries (upper case), None if it names none."""
    stem = _SPLIT.sub("", Path(filename).name.removesuffix(".gguf"))
    m = _QUANT_IN_NAME.search(stem)
    return m[1].upper() if m else None


def pick_gguf(files: list[str], quant: str, repo: str) -> list[str]:
    """The GGUF file of a quant type among a repo's files, all parts of a split one, matched as
    llama.cpp's `-hf` and ollama's `hf.co/` names are, case-insensitively: a file whose quant is that
    type, else one whose name holds it. None or several: a FileError listing the repo's GGUF types."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    found = _matching(ggufs, quant)
    models = {_SPLIT.sub("", f.removesuffix(".gguf")) for f in found}
    if len(models) == 1:
        return found
    have = sorted({quant_of(f) or Path(f).name for f in ggufs})
    if not found:
        listed = f"its GGUF files: {', '.join(have)}" if have else "it holds no GGUF file"
        raise FileError(f"no GGUF file of type {quant} ({listed})", repo)
    raise FileError(f"{len(models)} GGUF files match {quant}: {', '.join(sorted(models))} (name the type "
                    f"in full; its GGUF files: {', '.join(have)})", repo)


def _matching(ggufs: list[str], quant: str) -> list[str]:
    want = quant.upper()
    return [f for f in ggufs if quant_of(f) == want] or [f for f in ggufs if want in Path(f).name.upper()]


@dataclass
class PullResult:
    repo: str
    revision: str  # the commit
    path: str  # the snapshot folder, or the GGUF file brisk loads
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    downloaded: int = 0  # of `files`, how many were fetched now (the rest were in the cache)

    def to_dict(self) -> dict:
        return asdict(self)


def pull(name: str, revision: str | None = None, progress: bool = True) -> PullResult:
    """Download what brisk needs of a hub model into the HF cache and check it against the hub's
    checksums. name: `org/name[@revision][:QUANT]`; revision: overrides the name's; progress:
    huggingface_hub's progress bars on stderr."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hub = _parse_or_fail(name)
    rev = revision or hub.revision
    try:
        info = HfApi().model_info(hub.repo, revision=rev or "main", files_metadata=True)
    except Exception as e:
        raise NotOnHub(f"could not be listed on the hub ({_reason(e)})", hub.text) from None
    siblings = {s.rfilename: s for s in info.siblings or []}
    files = _wanted(list(siblings), hub, rev)
    folder = _snapshot_folder(hub.repo, info.sha)
    cached = {f for f in files if folder is not None and (folder / f).exists()}
    quiet = not progress and not are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        # the weights first, each into its blob under its sha256, resumable: snapshot_download then
        # links them and fetches the small files
        refused = {f: w for f in files if f not in cached and siblings[f].lfs is not None
                   and (w := _fetch_lfs(hub.repo, info.sha, f, siblings[f].lfs.sha256.lower(), siblings[f].lfs.size))}
        snapshot = Path(snapshot_download(hub.repo, revision=rev or "main",
                                          allow_patterns=[f for f in files if f not in refused]))
    except Exception as e:
        raise FileError(f"download failed ({_reason(e)})", hub.text) from None
    finally:
        if quiet:
            enable_progress_bars()
    # every new file is checked before any error: one left unchecked would pass as cached next time
    wrong = list(refused.values()) + [w for f in files if f not in cached and siblings[f].lfs is None
                                      and (w := _mismatch(snapshot / f, siblings[f].blob_id))]
    if wrong:
        raise FileError(f"{'; '.join(wrong)} (a corrupted download: deleted, pull again)", hub.text)
    path = snapshot / files[0] if hub.quant else snapshot
    return PullResult(hub.repo, snapshot.name, str(path), files,
                      sum((snapshot / f).stat().st_size for f in files), len(files) - len(cached))


def cached(name: str) -> Path:
    """A hub name's local path from the HF cache alone (no request): the snapshot folder, or for
    `:QUANT` the GGUF file. NotCached if it was never downloaded."""
    hub = _parse_or_fail(name)
    snapshot = _snapshot_folder(hub.repo, _cached_commit(hub.repo, hub.revision))
    if snapshot is None or not snapshot.is_dir():
        raise NotCached("not in the local Hugging Face cache (`brisk pull` downloads it)", name)
    if not hub.quant:
        if not _complete(snapshot):  # (a pull of one of its GGUFs only, or a pull cut off)
            raise NotCached("not whole in the local Hugging Face cache (`brisk pull` downloads it)", name)
        return snapshot
    ggufs = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf")]
    if not _matching(ggufs, hub.quant):
        raise NotCached(f"no {hub.quant} GGUF of it in the local Hugging Face cache (`brisk pull` downloads it)", name)
    parts = pick_gguf(ggufs, hub.quant, name)
    if len(parts) > 1:
        raise FileError(f"a GGUF split in {len(parts)} parts: brisk loads single-file GGUFs (llama.cpp's "
                        "llama-gguf-split --merge joins them)", name)
    return snapshot / parts[0]


def fetch(name: str) -> Path:
    """A hub name's local path: from the cache when it is there, else pulled first."""
    try:
        return cached(name)
    except NotCached:
        pass
    try:
        pull(name)
    except NotOnHub as e:
        raise FileError(f"not in the local Hugging Face cache and {e.problem}", name) from None
    return cached(name)


def _complete(snapshot: Path) -> bool:
    """Whether a snapshot holds a whole checkpoint: its config and its weights, every shard that
    its index names (a pull cut off leaves some out)."""
    import json

    if not (snapshot / "config.json").is_file():
        return False
    index = snapshot / "model.safetensors.index.json"
    if not index.is_file():
        return any(snapshot.glob("*.safetensors"))
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True  # the loader says what is wrong with it
    return all((snapshot / str(s)).is_file() for s in shards)


def _parse_or_fail(name: str) -> HubName:
    hub = parse(name)
    if hub is None:
        raise FileError("not a hub name (org/name, org/name@revision, org/name:QUANT)", name)
    return hub


def _wanted(files: list[str], hub: HubName, revision: str | None) -> list[str]:
    """The files of the repo a pull downloads."""
    if hub.quant:
        return pick_gguf(files, hub.quant, hub.repo)
    from fnmatch import fnmatch

    wanted = sorted(f for f in files if any(fnmatch(Path(f).name, p) for p in HF_FILES) and "/" not in f)
    if not any(f.endswith(".safetensors") for f in wanted):
        quants = sorted({q for f in files if f.lower().endswith(".gguf") and (q := quant_of(f))})
        holds = f"GGUF files only: pull one with {hub.repo}:{quants[0]} (its types: {', '.join(quants)})" \
            if quants else "no *.safetensors weights (brisk does not load *.bin/*.pt/ONNX from the hub)"
        raise FileError(holds, hub.repo + (f"@{revision}" if revision else ""))
    return wanted


def _repo_folder(repo: str) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")


def _snapshot_folder(repo: str, commit: str | None) -> Path | None:
    return _repo_folder(repo) / "snapshots" / commit if commit else None


def _cached_commit(repo: str, revision: str | None) -> str | None:
    """The commit a revision (a branch, tag or commit) is in the cache, None if unknown there."""
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    ref = _repo_folder(repo) / "refs" / (revision or "main")
    return ref.read_text().strip() if ref.is_file() else None


def _fetch_lfs(repo: str, commit: str, filename: str, sha256: str, size: int) -> str | None:
    """Download an LFS file into the cache's blob of its sha256, through `<sha256>.incomplete`, which
    an interrupted pull leaves for the next one to resume from (huggingface_hub's own download
    deletes its partial file). The bytes are checked before they become the blob: None if they are
    the hub's, else what differs (the partial file deleted)."""
    from huggingface_hub.file_download import hf_hub_url, http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    folder = _repo_folder(repo)
    blob = folder / "blobs" / sha256
    part = blob.with_name(f"{sha256}.incomplete")
    part.parent.mkdir(parents=True, exist_ok=True)
    lock = folder.parent / ".locks" / folder.name / f"{sha256}.lock"  # the lock huggingface_hub takes for this blob
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):  # two pulls at once would append to one partial file
        if blob.exists():
            return None
        if part.exists() and part.stat().st_size > size:  # not a prefix of this file: start again
            part.unlink()
        with open(part, "ab") as f:
            http_get(hf_hub_url(repo, filename, revision=commit), f, resume_size=f.tell(),
                     headers=build_hf_headers(), expected_size=size, displayed_filename=Path(filename).name)
        return _checked_into(part, blob, filename, sha256)


def _checked_into(part: Path, blob: Path, filename: str, sha256: str) -> str | None:
    """A downloaded weight becomes its blob if its sha256 is the hub's; else it is deleted and the
    difference told."""
    actual = _sha256(part)
    if actual != sha256:
        part.unlink()
        return f"{filename}: sha256 {actual[:12]}… is not the hub's {sha256[:12]}…"
    part.replace(blob)
    return None


def _mismatch(path: Path, blob_id: str | None) -> str | None:
    """None where a plain (non-LFS) file's git blob id is the hub's, or the hub gave none; else what
    differs, and the file is deleted from the cache so that the next pull fetches it again."""
    if not blob_id:
        return None
    actual = _git_blob_id(path)
    if actual == blob_id.lower():
        return None
    blob = path.resolve()
    path.unlink(missing_ok=True)
    if blob != path:
        blob.unlink(missing_ok=True)
    return f"{path.name}: git blob id {actual[:12]}… is not the hub's {blob_id.lower()[:12]}…"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_id(path: Path) -> str:
    """git's id of a file's bytes (sha1 of "blob SIZE\\0" + bytes): the hub's checksum of a non-LFS file."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _reason(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
