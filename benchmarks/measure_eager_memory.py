"""Measure what eager PyTorch keeps for the backward of one transformer layer, and the
cross-entropy backward's transient, to check the memory predictor's eager profile.

    python benchmarks/measure_eager_memory.py [--device cuda|cpu] [--out FILE] [--compare]

One GPT layer and one Llama layer are written op for op as stg's built-in models build them
(one PyTorch op per graph node: LayerNorm/RMSNorm, the q/k/v matmuls, bias adds, RoPE as
``q*cos + rotate_half(q)*sin``, SDPA or the unfused scores/softmax/dropout/context, the
projection, dropout, residual adds, GELU or ``silu(gate) * up``), in bf16, with dropout 0.1 in
GPT (``torch.native_dropout``, what ``F.dropout`` runs on CUDA). A
``torch.autograd.graph.saved_tensors_hooks`` pack hook sees every tensor autograd saves; the
bytes of their distinct storages, less the parameters and the RoPE tables, are what the layer
keeps (a broadcasting ``torch.matmul`` of a query group against one kv head, or Hugging
Face's ``repeat_kv``, would copy K and V to every query head: the graph's einsum does not).
The cross entropy (``F.cross_entropy`` on the fp32 copy of bf16 logits) is measured on
CUDA with the allocator's statistics: the peak during its backward above what was allocated
before it. Prints JSON lines; ``--compare`` (needs stg installed) adds
``stg.predictors.memory``'s figures for the same shapes. Needs PyTorch; run it on a CUDA GPU
(on the CPU, ``F.rms_norm`` is composite and saves fp32 copies, LayerNorm's statistics are
bf16, and SDPA with dropout takes the math path: not what a training step on a GPU keeps).

On an H100 with PyTorch 2.11 every layer's saved bytes equal the eager closed form of
``activation_bytes_per_layer`` (fused attention: 16 bytes more, the kernel's int64 RNG seed
and offset), and the cross entropy's backward peaks 8.0 bytes per logit above what was
allocated before it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

S, B, H, A, D = 256, 2, 512, 8, 64
F_GPT, F_LLAMA, KV, VOCAB = 4 * H, 1408, 2, 32000


def saved_bytes(torch: Any, run: Any, exclude: set[int]) -> tuple[int, list[str]]:
    """Bytes of the distinct storages autograd saves while ``run()`` runs, less ``exclude``
    (storage pointers), and a description of each."""
    storages: dict[int, tuple[int, str]] = {}

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in exclude:
            storages[pointer] = (storage.nbytes(), f"{str(t.dtype)[6:]}{list(t.shape)}")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(n for n, _ in storages.values()), sorted(d for _, d in storages.values())


def gpt_layer(torch: Any, device: str, attention: str) -> dict[str, Any]:
    F = torch.nn.functional
    bf16 = torch.bfloat16

    def p(*shape: int) -> Any:
        return (torch.randn(*shape, device=device, dtype=bf16) * 0.02).requires_grad_()

    w = {
        "ln1": p(H), "ln1b": p(H), "wq": p(H, A * D), "wk": p(H, A * D), "wv": p(H, A * D),
        "bq": p(A * D), "bk": p(A * D), "bv": p(A * D), "wo": p(A * D, H), "bo": p(H),
        "ln2": p(H), "ln2b": p(H), "w1": p(H, F_GPT), "b1": p(F_GPT), "w2": p(F_GPT, H),
        "b2": p(H),
    }  # fmt: skip
    x = torch.randn(B, S, H, device=device, dtype=bf16, requires_grad=True)

    def heads(t: Any) -> Any:
        return t.view(B, S, A, D).transpose(1, 2)

    def layer() -> Any:
        n = F.layer_norm(x, (H,), w["ln1"], w["ln1b"])
        q = heads(n @ w["wq"] + w["bq"])
        k = heads(n @ w["wk"] + w["bk"])
        v = heads(n @ w["wv"] + w["bv"])
        if attention == "fused":
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        else:
            probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
            ctx = torch.native_dropout(probs, 0.1, True)[0] @ v
        o = ctx.transpose(1, 2).reshape(B, S, A * D) @ w["wo"] + w["bo"]
        x1 = x + torch.native_dropout(o, 0.1, True)[0]
        n2 = F.layer_norm(x1, (H,), w["ln2"], w["ln2b"])
        u = F.gelu(n2 @ w["w1"] + w["b1"], approximate="tanh")
        d = u @ w["w2"] + w["b2"]
        return x1 + torch.native_dropout(d, 0.1, True)[0]

    exclude = {t.untyped_storage().data_ptr() for t in w.values()}
    total, tensors = saved_bytes(torch, layer, exclude)
    return {"model": "gpt", "attention": attention, "saved_bytes": total, "tensors": tensors}


def llama_layer(torch: Any, device: str, attention: str) -> dict[str, Any]:
    F = torch.nn.functional
    bf16 = torch.bfloat16

    def p(*shape: int) -> Any:
        return (torch.randn(*shape, device=device, dtype=bf16) * 0.02).requires_grad_()

    w = {
        "n1": p(H), "wq": p(H, A * D), "wk": p(H, KV * D), "wv": p(H, KV * D),
        "wo": p(A * D, H), "n2": p(H), "w1": p(H, F_LLAMA), "w3": p(H, F_LLAMA),
        "w2": p(F_LLAMA, H),
    }  # fmt: skip
    angles = torch.outer(torch.arange(S, device=device), torch.ones(D, device=device))
    cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
    x = torch.randn(B, S, H, device=device, dtype=bf16, requires_grad=True)

    def rope(t: Any) -> Any:
        half = t.shape[-1] // 2
        rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        return t * cos + rotated * sin

    def layer() -> Any:
        n = F.rms_norm(x, (H,), w["n1"])
        q = rope((n @ w["wq"]).view(B, S, A, D).transpose(1, 2))
        k = rope((n @ w["wk"]).view(B, S, KV, D).transpose(1, 2))
        v = (n @ w["wv"]).view(B, S, KV, D).transpose(1, 2)
        if attention == "fused":
            ctx = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:  # each kv head's query group as rows (the graph's einsum): K, V not repeated
            qg = q.reshape(B, KV, (A // KV) * S, D)
            probs = torch.softmax(qg @ k.transpose(-1, -2), dim=-1)
            ctx = (probs @ v).reshape(B, A, S, D)
        x1 = x + ctx.transpose(1, 2).reshape(B, S, A * D) @ w["wo"]
        n2 = F.rms_norm(x1, (H,), w["n2"])
        act = F.silu(n2 @ w["w1"]) * (n2 @ w["w3"])
        return x1 + act @ w["w2"]

    exclude = {t.untyped_storage().data_ptr() for t in (*w.values(), cos, sin)}
    total, tensors = saved_bytes(torch, layer, exclude)
    return {"model": "llama", "attention": attention, "saved_bytes": total, "tensors": tensors}


def cross_entropy_transient(torch: Any) -> dict[str, Any]:
    """Peak above the allocation before the backward of ``F.cross_entropy(logits.float())``,
    per logit (CUDA only)."""
    tokens = S * B
    logits = torch.randn(tokens, VOCAB, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, VOCAB, (tokens,), device="cuda")
    loss = torch.nn.functional.cross_entropy(logits.float(), target)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return {
        "measure": "cross_entropy_backward_transient",
        "tokens": tokens,
        "vocab": VOCAB,
        "bytes_per_logit": (peak - before) / (tokens * VOCAB),
    }


def predicted(model: str, attention: str) -> float:
    from stg.core.options import GenerateOptions
    from stg.predictors.memory import activation_bytes_per_layer

    gpt = dict(dff=F_GPT, kvhead=A, dropout=0.1)
    dims = gpt if model == "gpt" else dict(dff=F_LLAMA, kvhead=KV)
    o = GenerateOptions(
        model=model, dmodel=H, head=A, seq=S, batch=B, num_stacks=1, profile="eager",
        attention=attention, **dims,
    )  # fmt: skip
    return activation_bytes_per_layer(o)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if any)")
    parser.add_argument("--out", default=None, help="also write the JSON lines here")
    parser.add_argument("--compare", action="store_true", help="add stg's predictions")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("measure_eager_memory needs PyTorch (pip install 'symbolic-tensor-graph[bench]')")
        return 2
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    lines: list[dict[str, Any]] = [{"torch": torch.__version__, "device": args.device}]
    for build in (gpt_layer, llama_layer):
        for attention in ("fused", "unfused"):
            entry = build(torch, args.device, attention)
            if args.compare:
                entry["stg_eager_bytes"] = predicted(entry["model"], attention)
            lines.append(entry)
    if args.device == "cuda":
        lines.append(cross_entropy_transient(torch))
    text = "\n".join(json.dumps(line, sort_keys=True) for line in lines)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
