"""How well training state compresses, by part: weights, AdamW's first moments, its second moments.

Trains a small Llama (dense) and a small Mixtral (mixture of experts) from ``transformers`` with AdamW for a few
hundred steps on text made by a fixed random Markov chain over a Zipf-distributed vocabulary, then stores each part
of the fp32 state the way the checkpoint files do (:func:`gdsload.loader.checkpoints.encode.encode`: per tensor,
tensors under 64 KiB raw, no gain under 2 % raw) with each codec and reports logical / stored bytes:

- ``zstd``: Zstd on the CPU, level 1;
- ``zstd+planes``: the same after the byte-plane split of fp32 (the default for CPU tensors);
- ``zstd3+planes``: level 3 after the split;
- ``ans``: nvCOMP ANS with the float32 ``data_type`` on the GPU (the default for CUDA tensors; needs nvCOMP).

    python -m gdsload.bench.ckpt_ratio --steps 300 --out ratios.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from ..loader.checkpoints.encode import encode

CODECS = {
    "zstd": ("zstd", False, 1),
    "zstd+planes": ("zstd", True, 1),
    "zstd3+planes": ("zstd", True, 3),
    "ans": ("ans", False, 1),
}


def _model(kind: str, scale: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(
        vocab_size=8192,
        hidden_size=128 * scale,
        intermediate_size=344 * scale,
        num_hidden_layers=4,
        num_attention_heads=4 * scale,
        num_key_value_heads=2 * scale,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if kind == "dense":
        return LlamaForCausalLM(LlamaConfig(**common))
    common["intermediate_size"] = 172 * scale
    return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2))


def _corpus(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed Markov chain: a Zipf unigram, each token followed by one of 8 likely successors."""
    g = torch.Generator().manual_seed(seed)
    unigram = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    successors = torch.multinomial(unigram.expand(vocab, -1), 8, generator=g)
    return unigram / unigram.sum(), successors


def _batch(step: int, unigram: torch.Tensor, successors: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.empty(batch, seq, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(unigram, batch, replacement=True, generator=g)
    for i in range(1, seq):
        pick = torch.randint(0, 8, (batch,), generator=g)
        jump = torch.rand(batch, generator=g) < 0.1
        nxt = successors[tokens[:, i - 1], pick]
        tokens[:, i] = torch.where(jump, torch.multinomial(unigram, batch, replacement=True, generator=g), nxt)
    return tokens


def train(kind: str, steps: int, scale: int, log_every: int = 50) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _model(kind, scale)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    unigram, successors = _corpus(model.config.vocab_size)
    t0 = time.perf_counter()
    for step in range(steps):
        x = _batch(step, unigram, successors, 8, 128)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"{kind} step {step} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return model, opt


def parts(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {"weights": [], "exp_avg": [], "exp_avg_sq": []}
    for p in model.parameters():
        out["weights"].append(p.detach())
        state = opt.state[p]
        out["exp_avg"].append(state["exp_avg"])
        out["exp_avg_sq"].append(state["exp_avg_sq"])
    return out


def ratios(tensors: dict[str, list[torch.Tensor]], codecs: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in codecs:
        codec, planes, level = CODECS[name]
        row: dict[str, Any] = {}
        for part, ts in tensors.items():
            logical = stored = 0
            t0 = time.perf_counter()
            for i, t in enumerate(ts):
                src = t.cuda() if codec == "ans" else t
                s = encode(src, codec, name=f"{part}/{i}", planes=planes, level=level)
                logical += s.nbytes
                stored += s.data.nbytes
            row[part] = {
                "ratio": logical / stored,
                "logical_bytes": logical,
                "stored_bytes": stored,
                "encode_gbps": logical / (time.perf_counter() - t0) / 1e9,
            }
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--scale", type=int, default=2, help="width multiplier (2: hidden 256)")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--codecs", default=None, help="default: every one that runs here")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from ..loader.codecs import nvcomp_available

    codecs = args.codecs.split(",") if args.codecs else [c for c in CODECS if c != "ans" or nvcomp_available() is None]
    doc: dict[str, Any] = {"steps": args.steps, "scale": args.scale, "torch": torch.__version__, "models": {}}
    for kind in args.models.split(","):
        model, opt = train(kind, args.steps, args.scale)
        tensors = parts(model, opt)
        n = sum(t.numel() for t in tensors["weights"])
        doc["models"][kind] = {"params": n, "ratios": ratios(tensors, codecs)}
        for codec, row in doc["models"][kind]["ratios"].items():
            print(
                f"{kind} ({n / 1e6:.1f} M params) {codec}: "
                + ", ".join(f"{part} {r['ratio']:.3f}" for part, r in row.items()),
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
