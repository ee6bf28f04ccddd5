"""The engine-side client against the real sidecar: map a rank, inject it, release exactly its own lease."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch

from gdsload.loader import SidecarClient
from gdsload.loader.prepare.synthetic import make_checkpoint
from sidecar_proc import TOKEN, Server


def test_engine_maps_a_rank_from_the_real_sidecar_and_releases_its_lease(tmp_path: Path):
    model = make_checkpoint(tmp_path / "m", "tiny", tp=2)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    server = Server(
        [str(model), "--device-map", "cpu", "--token-file", str(token_file), "--allow-root", str(tmp_path)],
        tmp_path / "serve.log",
    )
    try:
        server.poll_ready()
        client = SidecarClient(server.url, token=TOKEN)
        first, second = client.map_rank(1), client.map_rank(1)  # two engines of one rank
        ref = safetensors.torch.load_file(str(model / "model-rank-1-part-0.safetensors"))
        assert set(first.tensors) == set(ref)
        for name, t in ref.items():
            assert torch.equal(first.tensors[name].view(torch.int16), t.view(torch.int16)), name
        assert first.lease and second.lease and first.lease != second.lease
        assert server.status()["ranks"]["1"]["leases"] == 2
        first.release()
        assert server.status()["ranks"]["1"]["leases"] == 1  # the other engine keeps its mapping
        second.release()
        assert server.status()["ranks"]["1"]["leases"] == 0
    finally:
        server.close()
