"""`gdsload shard --compress ans` on a CUDA host (`pytest -m gpu`): built on the GPU without torch, checked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from gpu_cases import _check
from gdsload.loader import load_rank
from gdsload.loader.prepare.compress import compress_dir

pytestmark = pytest.mark.gpu


def _hf_llama(root: Path, shape) -> Path:
    """A Llama checkpoint as Hugging Face writes it: config.json and two files the safetensors library wrote.
    The first file also holds a 12-byte ``rotary_emb.inv_freq`` buffer (which sharding skips), written
    first, so the weights after it lie at offsets that are not 16-byte aligned."""
    import json

    from gdsload.loader.prepare.synthetic import tensor_shapes

    root.mkdir()
    (root / "config.json").write_text(json.dumps(shape.config_json()))
    g = torch.Generator().manual_seed(11)
    tensors = {
        name: (0.02 * torch.randn(dims, generator=g)).to(torch.bfloat16) for name, dims, _ in tensor_shapes(shape)
    }
    names = sorted(tensors, key=lambda n: (n != "model.norm.weight", n))
    half = len(names) // 2
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.tensor([1.0, 0.5, 0.25])}
    for i, part in enumerate((names[:half], names[half:])):
        safetensors.torch.save_file(
            {**(extra if i == 0 else {}), **{n: tensors[n] for n in part}},
            str(root / f"model-0000{i + 1}-of-00002.safetensors"),
        )
    return root


@pytest.mark.parametrize("tp,layout", [(2, "vllm"), (4, "hf")])
def test_shard_compress_ans_builds_on_the_gpu_without_torch_what_shard_then_compress_writes(tmp_path, tp, layout):
    """`gdsload shard --compress ans` on a GPU imports no torch and writes no uncompressed shard: it writes,
    byte for byte, the files and manifest of sharding (through torch) and then `compress_dir`. Fused q/k/v and
    gate/up, column splits of o/down, KV heads replicated over ranks (tp 4 > 2 KV heads), the vocabulary padded
    to 64 rows, vLLM's constant tensors. Where the torch-free path cannot run (a backend it cannot use), the
    command shards through torch and compresses with the torch encoder: the same tensors load from both."""
    import json
    import subprocess
    import sys

    from gdsload.loader import read_header
    from gdsload.loader.format.compression import parse_compression
    from gdsload.loader.prepare.shard import ShardOptions, execute_plan, plan_shard
    from gdsload.loader.prepare.synthetic import LlamaShape

    src = _hf_llama(
        tmp_path / "src", LlamaShape(hidden=512, intermediate=1024, heads=8, kv_heads=2, vocab=1000, layers=2)
    )
    cmd = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "gdsload.server.cli",
        "shard",
        str(src),
        "",
        "--tp",
        str(tp),
        "--layout",
        layout,
        "--compress",
        "ans",
        "--json",
    ]
    runs = {}
    for name, env in (("gpu", {}), ("fallback", {"GDSLOAD_BACKEND": "pinned"})):
        cmd[7] = str(tmp_path / name)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **env})
        assert done.returncode == 0, done.stderr[-3000:]
        imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
        runs[name] = (json.loads(done.stdout), "torch" in imported)
    (doc, torch_imported), (fallback_doc, fallback_torch) = runs["gpu"], runs["fallback"]
    assert (torch_imported, fallback_torch) == (False, True)
    assert doc["compression"]["gpu_without_torch"] and not fallback_doc["compression"]["gpu_without_torch"]
    assert doc["compression"]["ratio"] > 1.2
    assert not (tmp_path / ".gpu.uncompressed").exists()

    plan = plan_shard(src, ShardOptions(tp=tp, layout=layout, compress="ans"))
    execute_plan(plan, tmp_path / "plain")
    stats = compress_dir(tmp_path / "plain", tmp_path / "ref", codec="ans")
    gpu, ref = tmp_path / "gpu", tmp_path / "ref"
    assert doc["compression"]["ratio"] == stats.ratio
    assert sorted(p.name for p in gpu.iterdir()) == sorted(p.name for p in ref.iterdir())
    files = sorted(gpu.glob("*.safetensors"))
    assert len(files) == tp
    for f in files:
        assert f.read_bytes() == (ref / f.name).read_bytes(), f.name
        assert parse_compression(read_header(f)), f.name
    assert json.loads((gpu / "gdsload.json").read_text()) == json.loads((ref / "gdsload.json").read_text())
    assert (gpu / "config.json").read_bytes() == (ref / "config.json").read_bytes()
    for rank in range(tp):
        res = load_rank(gpu, rank, device="cuda", verify=True)
        assert res.report.verified
        _check(res, dict(load_rank(tmp_path / "fallback", rank, device="cuda", backend="pinned").tensors))
        _check(res, dict(load_rank(tmp_path / "plain", rank, device="cuda", backend="pinned").tensors))
    # sha256 digests when asked for: the same files, each digest as hashlib computes it.
    import hashlib

    cmd[7] = str(tmp_path / "sha")
    done = subprocess.run([*cmd, "--digest-algorithm", "sha256"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and json.loads(done.stdout)["compression"]["gpu_without_torch"], done.stderr[-2000:]
    from gdsload.loader.format.manifest import Manifest

    listed = [m for ms in Manifest.read(tmp_path / "sha").ranks.values() for m in ms]
    assert len(listed) == tp
    for m in listed:
        data = (tmp_path / "sha" / m.path).read_bytes()
        assert m.digest == "sha256:" + hashlib.sha256(data).hexdigest() and data == (gpu / m.path).read_bytes()
    # The same command again finds its output complete.
    cmd[7] = str(gpu)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and json.loads(again.stdout)["already_complete"], again.stderr[-2000:]
