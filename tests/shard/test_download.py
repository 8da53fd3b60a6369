"""Model resolution: local directories as is; hub ids through huggingface_hub.snapshot_download
against a local HF cache laid out like a real one (blobs, refs, snapshot symlinks), offline."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shard.tools.download import model_sha, resolve_model

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo_id: str, model_dir: Path) -> Path:
    """Lays model_dir out as HF_HUB_CACHE/models--org--name with blobs + symlinked snapshot."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in model_dir.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_local_directory_is_used_as_is(tiny_models, tmp_path):
    assert resolve_model(str(tiny_models["gpt2"])) == tiny_models["gpt2"].resolve()
    assert model_sha(tiny_models["gpt2"]) is None
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.slow
def test_hub_id_resolves_from_the_offline_cache(tiny_models, tmp_path):
    snapshot = hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny_models["llama"])
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), PYTHONPATH=str(REPO),
        HF_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1",
    )
    out = subprocess.run(
        [sys.executable, "-m", "service.app.cli", "download", "tiny-org/tiny-llama", "--revision",
         "main"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == snapshot
    # A shard started with the hub id loads from that snapshot and reports its commit.
    code = (
        "from shard.server.loader import Shard, ShardConfig; from shard.distributed.groups import Dist; "
        "s = Shard(ShardConfig(model_id='tiny-org/tiny-llama', revision='main'), Dist()); "
        "print(s.info.model_sha, s.info.model_type)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [COMMIT, "llama"]
    missing = subprocess.run(
        [sys.executable, "-m", "service.app.cli", "download", "tiny-org/absent"], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert missing.returncode != 0
