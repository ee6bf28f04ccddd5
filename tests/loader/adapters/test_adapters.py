"""Engine adapters, torch/transformers half: a tiny Llama generates the same tokens and logits after its weights
went through the loader and an adapter as from the original checkpoint; plus the sidecar IPC hand-off.

Pipeline under test (``_checkpoint``): original model -> ``save_file`` -> [shard] -> [compress] -> ``load_rank``
-> inject. ``gdsload shard`` and compression are not in the tree yet: they slot in between ``_write_checkpoint``
and ``load_rank`` (see the ``prepared`` fixture), and every comparison below stays as it is.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ipc_sidecar import TOKEN, Sidecar

from gdsload.loader import BackendUnavailableError, ConfigError, load_rank, save_file
from gdsload.loader.adapters import (
    AdapterOptions,
    InjectError,
    ModuleInjector,
    collect_weights,
    describe_checkpoint,
    inject_module,
    meta_init,
    open_rank,
)
from gdsload.loader.handoff.ipc import export_rank
from gdsload.loader.pipeline.result import LoadResult
from gdsload.loader.handoff.sidecar_client import (
    SidecarAuthError,
    SidecarClient,
    SidecarNotReadyError,
    SidecarProtocolError,
    SidecarUnavailableError,
)

transformers = pytest.importorskip("transformers")

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.25,
    tie_word_embeddings=False,
)
PROMPT = [[3, 17, 42, 99, 7, 250, 12, 64]]
NEW_TOKENS = 12


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _reference(tie: bool = False, seed: int = 0) -> nn.Module:
    """The original model: random bf16 weights, built as transformers builds with torch_dtype=bfloat16."""
    torch.manual_seed(seed)
    with _default_dtype(torch.bfloat16):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, "tie_word_embeddings": tie}))
    return model.eval()


def _empty(tie: bool = False) -> nn.Module:
    with meta_init(dtype=torch.bfloat16):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, "tie_word_embeddings": tie}))
    return model.eval()


@torch.no_grad()
def _run(model: nn.Module, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the prompt and the greedy continuation."""
    ids = torch.tensor(PROMPT, device=device)
    logits = model(ids).logits.float().cpu()
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return logits, out.cpu()


def _write_checkpoint(model: nn.Module, out: Path, *, drop: tuple[str, ...] = ()) -> Path:
    """What HF's save_pretrained would store: the state dict (tied duplicates once), as aligned safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if k not in drop}
    save_file(state, out / "model.safetensors", {"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.config.to_dict()))
    return out


@pytest.fixture(scope="module")
def reference() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = _reference()
    logits, tokens = _run(model)
    assert tokens.shape[1] == len(PROMPT[0]) + NEW_TOKENS
    assert len(set(tokens[0, len(PROMPT[0]) :].tolist())) > 2, "degenerate reference; raise initializer_range"
    return model, logits, tokens


@pytest.fixture(scope="module")
def prepared(reference, tmp_path_factory) -> Path:
    """The checkpoint directory the tests load: the model's HF checkpoint, sharded (tp=1, hf layout),
    then compressed with Zstd (the codec a CPU host decodes) — shard -> compress -> load_rank -> inject."""
    from gdsload.loader import shard_checkpoint
    from gdsload.loader.prepare.compress import compress_dir

    root = tmp_path_factory.mktemp("tiny-llama")
    src = _write_checkpoint(reference[0], root / "hf")
    shard_checkpoint(src, root / "sharded", tp=1, layout="hf")
    stats = compress_dir(root / "sharded", root / "compressed", codec="zstd", device="cpu", min_tensor_bytes=4096)
    assert stats.compressed > 0 and stats.ratio > 1.05
    return root / "compressed"


def _arena_ptr(result: LoadResult) -> int:
    return result.arenas[0].untyped_storage().data_ptr()


# ------------------------------------------------------------------------------------------------- e2e on CPU


def test_zero_copy_inject_generates_identically(reference, prepared):
    _, want_logits, want_tokens = reference
    assert describe_checkpoint(prepared).layout == "hf"
    result = load_rank(prepared, 0)
    model = _empty()
    report = inject_module(model, result)
    assert report.ok and report.zero_copy == len(report.loaded) == len(model.state_dict())
    assert report.bytes == result.report.logical_bytes
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == {_arena_ptr(result)}
    logits, tokens = _run(model)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(logits, want_logits)


def test_copy_inject_into_a_built_model(reference, prepared):
    _, want_logits, want_tokens = reference
    model = _reference(seed=1)  # different random weights, then overwritten
    result = load_rank(prepared, 0)
    report = inject_module(model, result, assign=False)
    assert report.ok and report.zero_copy == 0
    assert not {p.untyped_storage().data_ptr() for p in model.parameters()} & {_arena_ptr(result)}
    logits, tokens = _run(model)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_tied_embeddings_stay_tied(tmp_path):
    ref = _reference(tie=True, seed=3)
    want_logits, want_tokens = _run(ref)
    ckpt = _write_checkpoint(ref, tmp_path, drop=("lm_head.weight",))  # HF stores tied weights once
    model = _empty(tie=True)
    report = inject_module(model, load_rank(ckpt, 0))
    assert report.ok and "lm_head.weight" not in report.loaded
    assert model.lm_head.weight is model.model.embed_tokens.weight
    logits, tokens = _run(model)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_stream_input_and_dtype_conversion(reference, prepared):
    result = load_rank(prepared, 0)
    with meta_init(dtype=torch.float32):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    report = inject_module(model, iter(result.tensors.items()))
    assert report.ok and report.zero_copy == 0  # bf16 -> fp32 is a copy per tensor
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, result.tensors[name].float()), name


def test_strict_lists_every_problem_and_writes_nothing(prepared):
    tensors = dict(load_rank(prepared, 0).tensors)
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:200]
    model = _empty()
    with pytest.raises(InjectError) as e:
        inject_module(model, tensors)
    msg = str(e.value)
    assert "'model.norm.weight'" in msg and "'model.layers.0.mlp.extra.weight'" in msg
    assert "'lm_head.weight' checkpoint [200, 64] vs model [256, 64]" in msg and "strict=False" in msg
    assert isinstance(e.value, ValueError)
    assert e.value.report.missing == ["model.norm.weight"]
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing was written

    report = inject_module(model, tensors, strict=False)
    assert not report.ok and len(report.loaded) == len(tensors) - 2
    assert model.model.norm.weight.device.type == "meta" and model.lm_head.weight.device.type == "meta"
    assert model.model.embed_tokens.weight.device.type == "cpu"


def test_duplicate_names_in_a_stream_are_an_error():
    with pytest.raises(InjectError, match="'w' appears twice"):
        collect_weights([("w", torch.ones(1)), ("w", torch.ones(1))])
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        collect_weights([("w", [1.0])])
    with pytest.raises(TypeError, match="weight 'w' is a list"):
        collect_weights({"w": [1.0]})


def test_meta_buffers_are_refused_with_the_fix(prepared):
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    with pytest.raises(InjectError, match=r"'model.rotary_emb.inv_freq'.*meta_init\(\)"):
        inject_module(model, load_rank(prepared, 0))
    with pytest.raises(InjectError, match="use assign=True"):
        ModuleInjector(_empty(), assign=False).inject({})


def test_meta_init_restores_torch_state():
    before = (torch.get_default_dtype(), nn.Module.register_parameter)
    with pytest.raises(RuntimeError, match="boom"), meta_init(dtype=torch.float16):
        layer = nn.Linear(8, 4)
        raise RuntimeError("boom")
    assert (torch.get_default_dtype(), nn.Module.register_parameter) == before
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float16
    assert nn.Linear(2, 2).weight.device.type == "cpu"
    with pytest.raises(TypeError), meta_init(dtype=torch.int32):  # not a floating dtype: refused, nothing patched
        pass
    assert (torch.get_default_dtype(), nn.Module.register_parameter) == before
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_open_rank_reads_storage_and_explicit_backend_fails_loudly(prepared):
    with open_rank(prepared, 0) as w:
        assert w.origin == "storage" and w.report is not None and "lm_head.weight" in w.tensors
    assert w.tensors == {}
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="'cuda'.*no CUDA device"):
            open_rank(prepared, 0, options=AdapterOptions(backend="cpu"), device="cuda")
        with open_rank(prepared, 0, device="cuda") as w:  # auto: falls back to host memory
            assert next(iter(w.tensors.values())).device.type == "cpu"


def test_options_name_the_key_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key \['sidecar'\].*accepts \['backend', 'sidecar_url'"):
        AdapterOptions.from_mapping({"sidecar": "http://x"})
    with pytest.raises(ConfigError, match="either token or token_file"):
        AdapterOptions(token="a", token_file="b")
    with pytest.raises(ConfigError, match="sidecar_url='127.0.0.1:8471' must be an http"):
        AdapterOptions(sidecar_url="127.0.0.1:8471")
    with pytest.raises(ConfigError, match="backend='nvme'"):
        AdapterOptions(backend="nvme")
    with pytest.raises(ConfigError, match="strict='yes'"):
        AdapterOptions.from_mapping({"strict": "yes"})
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    assert AdapterOptions(token_file=str(token_file)).sidecar_token() == TOKEN
    with pytest.raises(ConfigError, match="cannot be read"):
        AdapterOptions(token_file=str(tmp_path / "nope")).sidecar_token()


def test_importing_adapters_imports_no_engine():
    code = (
        "import sys, gdsload.loader.adapters, gdsload.loader.adapters.vllm, gdsload.loader.adapters.trtllm, "
        "gdsload.loader.adapters.sglang, gdsload.loader.handoff.sidecar_client; "
        "print([m for m in ('vllm', 'sglang', 'tensorrt_llm', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------- sidecar: a real loopback server


def test_sidecar_tensors_inject_and_generate(reference, prepared):
    _, want_logits, want_tokens = reference
    exported = load_rank(prepared, 0)
    with Sidecar({0: json.loads(json.dumps(export_rank(exported)))}) as sidecar:
        client = SidecarClient(sidecar.url, token=TOKEN)
        with client.map_rank(0, device="cpu") as mapped:
            model = _empty()
            report = inject_module(model, mapped.tensors)
            assert report.zero_copy == len(report.loaded)
            logits, tokens = _run(model)
        assert sidecar.released == [0] and mapped.tensors == {}
        assert all(auth == f"Bearer {TOKEN}" for _, _, auth in sidecar.requests)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_open_rank_maps_from_the_sidecar_and_releases(prepared, tmp_path):
    exported = load_rank(prepared, 0)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with Sidecar({0: json.loads(json.dumps(export_rank(exported)))}) as sidecar:
        options = AdapterOptions.from_mapping({"sidecar_url": sidecar.url, "token_file": str(token_file)})
        with open_rank(None, 0, options=options) as w:
            assert w.origin == "sidecar" and sidecar.released == []
            assert all(torch.equal(w.tensors[k], v) for k, v in exported.tensors.items())
        assert sidecar.released == [0]


def test_sidecar_errors_are_typed_and_name_the_fix(prepared):
    exported = load_rank(prepared, 0)  # the sidecar keeps its result alive while it serves the document
    doc = json.loads(json.dumps(export_rank(exported)))
    with Sidecar({0: doc, 1: doc}) as sidecar:
        with pytest.raises(SidecarAuthError, match="HTTP 401.*token was refused") as e:
            SidecarClient(sidecar.url, token="wrong").map_rank(0)
        assert isinstance(e.value, PermissionError)
        with pytest.raises(SidecarAuthError, match="no token was sent"):
            SidecarClient(sidecar.url).ipc_document(0)
        with pytest.raises(SidecarNotReadyError, match=r"HTTP 503 .*rank 2 is loading.*/readyz"):
            SidecarClient(sidecar.url, token=TOKEN).map_rank(2)
        with pytest.raises(SidecarProtocolError, match="asked the sidecar for rank 1 and got the document of rank 0"):
            SidecarClient(sidecar.url, token=TOKEN).map_rank(1)
        with pytest.raises(Exception, match="mapped on 'cpu' but the engine runs on 'cuda:0'"):
            SidecarClient(sidecar.url, token=TOKEN).map_rank(0, device="cuda:0")
        assert sidecar.released == [0]  # a failed mapping is released
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    with pytest.raises(SidecarUnavailableError, match="start `gdsload serve`") as e:
        SidecarClient(f"http://127.0.0.1:{free_port}", token=TOKEN, timeout=5).ipc_document(0)
    assert isinstance(e.value, ConnectionError)
    # Another service on the port, answering something that is not HTTP.
    with socket.socket() as banner:
        banner.bind(("127.0.0.1", 0))
        banner.listen(1)

        def answer() -> None:
            conn, _ = banner.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        with pytest.raises(SidecarProtocolError, match="the answer is not HTTP"):
            SidecarClient(f"http://127.0.0.1:{banner.getsockname()[1]}", token=TOKEN, timeout=5).ipc_document(0)
        t.join(5)


_CHILD = r"""
import gc, json, sys, torch, transformers
from gdsload.loader.adapters import inject_module, meta_init
from gdsload.loader.handoff.sidecar_client import SidecarClient
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
mapped = SidecarClient(a["url"], token=a["token"]).map_rank(a["rank"], device=a["device"])
with meta_init(dtype=torch.bfloat16):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**a["config"])).eval()
report = inject_module(model, mapped.tensors)
arena = {t.untyped_storage().data_ptr() for t in mapped.tensors.values() if t.numel()}
with torch.no_grad():
    ids = torch.tensor(a["prompt"], device=a["device"])
    logits = model(ids).logits.float().cpu()
    tokens = model.generate(ids, max_new_tokens=a["new_tokens"], do_sample=False, pad_token_id=0).cpu()
params = {p.untyped_storage().data_ptr() for p in model.parameters()}
torch.save({"logits": logits, "tokens": tokens, "zero_copy": report.zero_copy, "loaded": len(report.loaded),
            "shares_arena": params == arena, "device": str(next(model.parameters()).device)}, a["out"])
del model, params, arena
gc.collect()
mapped.release()  # drops the last references to the mapping, then tells the sidecar
"""


def _generate_in_child(url: str, device: str, out: Path) -> dict[str, Any]:
    args = dict(
        url=url,
        token=TOKEN,
        rank=0,
        device=device,
        config=CONFIG,
        prompt=PROMPT,
        new_tokens=NEW_TOKENS,
        threads=torch.get_num_threads(),
        out=str(out),
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)], capture_output=True, text=True, timeout=300, env=env
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return torch.load(out)


def test_another_process_maps_injects_and_generates(reference, prepared, tmp_path):
    _, want_logits, want_tokens = reference
    exported = load_rank(prepared, 0)
    with Sidecar({0: json.loads(json.dumps(export_rank(exported)))}) as sidecar:
        got = _generate_in_child(sidecar.url, "cpu", tmp_path / "out.pt")
        assert sidecar.released == [0]
    assert got["shares_arena"] and got["zero_copy"] == got["loaded"] > 0
    assert torch.equal(got["tokens"], want_tokens) and torch.equal(got["logits"], want_logits)


# ------------------------------------------------------------------------------------------------- on the GPU


def _load_to_cuda(path: Path) -> LoadResult:
    return load_rank(path, 0, device="cuda")


@pytest.mark.gpu
def test_gpu_zero_copy_inject_generates_identically(prepared):
    ref = _reference().to("cuda")
    want_logits, want_tokens = _run(ref, "cuda")
    del ref
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()  # after the first matmul: cuBLAS keeps its workspace
    result = _load_to_cuda(prepared)
    model = _empty()
    report = inject_module(model, result)
    assert report.zero_copy == len(report.loaded) == len(model.state_dict())
    assert model.model.rotary_emb.inv_freq.device.type == "cuda"  # buffers followed the weights
    logits, tokens = _run(model, "cuda")
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    del model, result, report
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == baseline


@pytest.mark.gpu
def test_gpu_another_process_maps_over_cuda_ipc_and_generates(prepared, tmp_path):
    ref = _reference().to("cuda")
    want_logits, want_tokens = _run(ref, "cuda")
    exported = _load_to_cuda(prepared)
    doc = json.loads(json.dumps(export_rank(exported)))
    assert doc["kind"] == "cuda"
    with Sidecar({0: doc}) as sidecar:
        got = _generate_in_child(sidecar.url, "cuda:0", tmp_path / "out.pt")
        assert sidecar.released == [0]
    assert got["device"] == "cuda:0" and got["shares_arena"] and got["zero_copy"] == got["loaded"] > 0
    assert torch.equal(got["tokens"], want_tokens) and torch.equal(got["logits"], want_logits)
