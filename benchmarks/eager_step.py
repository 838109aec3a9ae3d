"""Time one-GPU training steps of plain eager PyTorch models, to test `--profile eager`.

    python benchmarks/eager_step.py --out steps.jsonl [--models llama-1b] [--tokens 1024,8192]

Each model is the computation stg's built-in model of the same name generates, written as an
eager PyTorch module the way a training script without Megatron would: bf16 autocast over
fp32 weights, AdamW (PyTorch's default foreach implementation), fused SDPA attention (causal;
grouped-query heads through ``enable_gqa``), RMSNorm/LayerNorm, rotary positions or learned
ones, an untied LM head and cross-entropy. One sequence per step. For each model and token
count it writes a JSON line with the median step time of 5 steps (after 3 warm-up steps) and
the peak of ``torch.cuda.max_memory_allocated`` over them, with the ``stg predict`` options
that describe the same step (``stg_options``), so that ``benchmarks/compare_eager_steps.py``
can set the measurement beside the prediction. These are end-to-end measurements: they test
the predictors and are never used to set a constant of them. Needs PyTorch and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stg.bench import MissingDependencyError, require_cuda

# name: (family, dmodel, layers, heads, kv heads, ffn, vocab)
MODELS: dict[str, tuple[str, int, int, int, int, int, int]] = {
    "llama-1b": ("llama", 2048, 16, 32, 8, 8192, 128256),
    "llama-3b": ("llama", 3072, 28, 24, 8, 8192, 128256),
    "gpt-1.3b": ("gpt", 2048, 24, 16, 16, 8192, 50304),
    "gpt-2.7b": ("gpt", 2560, 32, 32, 32, 10240, 50304),
    # mixtures of experts (stg's ``moe`` template: Llama attention, routed SwiGLU experts),
    # a few layers of each published shape so that one GPU holds weights and AdamW states;
    # the expert FFN width is ``ffn``, experts and top-k in MOE below
    "qwen3-30b-a3b-4l": ("moe", 2048, 4, 32, 4, 768, 151936),
    "olmoe-1b-7b-8l": ("moe", 2048, 8, 16, 16, 1024, 50304),
    "mixtral-8x7b-2l": ("moe", 4096, 2, 32, 8, 14336, 32000),
}
GROUPED_MM = True
"""Run the experts with ``torch._grouped_mm`` (else a loop of one GEMM per expert)."""

MOE: dict[str, tuple[int, int, int]] = {
    # name: (experts, experts per token, head size); shapes from each model's config.json:
    # Qwen/Qwen3-30B-A3B, allenai/OLMoE-1B-7B-0924, mistralai/Mixtral-8x7B-v0.1
    "qwen3-30b-a3b-4l": (128, 8, 128),
    "olmoe-1b-7b-8l": (64, 8, 128),
    "mixtral-8x7b-2l": (8, 2, 128),
}


def build(
    torch: Any,
    family: str,
    d: int,
    layers: int,
    heads: int,
    kv: int,
    ffn: int,
    vocab: int,
    seq: int,
    moe: tuple[int, int, int] | None = None,
) -> Any:
    nn = torch.nn
    F = torch.nn.functional
    dh = d // heads if moe is None else moe[2]

    class Experts(nn.Module):
        """Token-choice top-k routing without dropping (softmax router, top-k renormalised),
        tokens sorted by expert and every expert's SwiGLU run by ``torch._grouped_mm`` over
        the stacked weights, outputs weighted and added back per token."""

        def __init__(self, experts: int, k: int) -> None:
            super().__init__()
            self.experts, self.k = experts, k
            self.router = nn.Linear(d, experts, bias=False)
            # stored [experts, out, in] and used transposed, as torchtitan's experts
            self.w13 = nn.Parameter(torch.randn(experts, 2 * ffn, d) * d**-0.5)
            self.w2 = nn.Parameter(torch.randn(experts, d, ffn) * ffn**-0.5)

        def forward(self, h: Any) -> Any:
            shape = h.shape
            x = h.reshape(-1, d).to(torch.bfloat16)
            probs = torch.softmax(self.router(x).float(), -1)
            weights, chosen = torch.topk(probs, self.k, -1)
            weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
            order = torch.argsort(chosen.view(-1), stable=True)
            token = order // self.k
            counts = torch.bincount(chosen.view(-1), minlength=self.experts)
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            routed = x.index_select(0, token)
            w13 = self.w13.to(x.dtype).transpose(-2, -1)
            w2 = self.w2.to(x.dtype).transpose(-2, -1)
            if GROUPED_MM:
                gate, up = torch._grouped_mm(routed, w13, offs=offsets).chunk(2, -1)
                y = torch._grouped_mm(F.silu(gate) * up, w2, offs=offsets)
            else:  # one GEMM per expert, as Hugging Face's eager MoE layers run them
                parts = []
                for e, rows in enumerate(routed.split(counts.tolist())):
                    gate, up = (rows @ w13[e]).chunk(2, -1)
                    parts.append((F.silu(gate) * up) @ w2[e])
                y = torch.cat(parts)
            y = y * weights.view(-1, 1).index_select(0, order)
            return torch.zeros_like(x).index_add_(0, token, y).view(shape)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            bias = family == "gpt"
            self.norm1 = nn.LayerNorm(d) if bias else nn.RMSNorm(d)
            self.norm2 = nn.LayerNorm(d) if bias else nn.RMSNorm(d)
            self.q = nn.Linear(d, heads * dh, bias=bias)
            self.k = nn.Linear(d, kv * dh, bias=bias)
            self.v = nn.Linear(d, kv * dh, bias=bias)
            self.o = nn.Linear(heads * dh, d, bias=bias)
            if family == "gpt":
                self.fc1 = nn.Linear(d, ffn)
                self.fc2 = nn.Linear(ffn, d)
            elif moe is not None:
                self.experts = Experts(moe[0], moe[1])
            else:
                self.gate = nn.Linear(d, ffn, bias=False)
                self.up = nn.Linear(d, ffn, bias=False)
                self.down = nn.Linear(ffn, d, bias=False)

        def forward(self, x: Any, cos: Any, sin: Any) -> Any:
            b, s, _ = x.shape
            h = self.norm1(x)
            q = self.q(h).view(b, s, heads, dh).transpose(1, 2)
            k = self.k(h).view(b, s, kv, dh).transpose(1, 2)
            v = self.v(h).view(b, s, kv, dh).transpose(1, 2)
            if cos is not None:  # rotary positions, rotate-half form

                def rope(t: Any) -> Any:
                    t1, t2 = t[..., : dh // 2], t[..., dh // 2 :]
                    return t * cos + torch.cat((-t2, t1), -1) * sin

                q, k = rope(q), rope(k)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, heads * dh))
            h = self.norm2(x)
            if family == "gpt":
                return x + self.fc2(F.gelu(self.fc1(h), approximate="tanh"))
            if moe is not None:
                return x + self.experts(h)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(seq, d) if family == "gpt" else None
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(d) if family == "gpt" else nn.RMSNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            if family in ("llama", "moe"):
                pos = torch.arange(seq, dtype=torch.float32)
                inv = 1.0 / (500000 ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
                angles = torch.outer(pos, inv)
                angles = torch.cat((angles, angles), -1)
                self.register_buffer("cos", angles.cos(), persistent=False)
                self.register_buffer("sin", angles.sin(), persistent=False)
            else:
                self.cos = self.sin = None

        def forward(self, tokens: Any, labels: Any) -> Any:
            x = self.wte(tokens)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))

    return Model()


def system_of(device: str) -> str:
    """The stg system preset of a CUDA device name."""
    return "h200-141g" if "H200" in device else "h100-80g"


WARMUP_STEPS = 3
TIMED_STEPS = 5


def training_step(torch: Any, name: str, tokens: int) -> tuple[Callable[[], None], int]:
    """One training step of ``name`` on one sequence of ``tokens`` (bf16 autocast over fp32
    weights, forward, backward, AdamW) as a callable, and the model's parameter count."""
    family, d, layers, heads, kv, ffn, vocab = MODELS[name]
    torch.manual_seed(0)
    moe = MOE.get(name)
    model = build(torch, family, d, layers, heads, kv, ffn, vocab, tokens, moe).cuda()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, vocab, (1, tokens + 1), device="cuda")
    inputs, labels = data[:, :-1], data[:, 1:]

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(inputs, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, params


def warm_up(torch: Any, step: Callable[[], None]) -> None:
    """:data:`WARMUP_STEPS` steps, then the GPU drained."""
    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()


def time_steps(torch: Any, step: Callable[[], None]) -> list[float]:
    """Wall seconds of each of :data:`TIMED_STEPS` steps, the GPU drained after each."""
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def measure(torch: Any, name: str, tokens: int) -> dict[str, Any]:
    family, d, layers, heads, kv, ffn, vocab = MODELS[name]
    moe = MOE.get(name)
    step, params = training_step(torch, name, tokens)
    warm_up(torch, step)
    torch.cuda.reset_peak_memory_stats()
    times = time_steps(torch, step)
    peak = torch.cuda.max_memory_allocated()
    options = [
        "--model",
        family,
        "--dmodel",
        str(d),
        "--num_stacks",
        str(layers),
        "--head",
        str(heads),
        "--kvhead",
        str(kv),
        "--dff",
        str(ffn),
        "--dvocal",
        str(vocab),
        "--seq",
        str(tokens),
        "--batch",
        "1",
        "--mixed_precision",
        "true",
        "--dtype",
        "bf16",
        "--profile",
        "eager",
        "--causal",
        "true",
        "--system",
        system_of(torch.cuda.get_device_name(0)),
    ]
    if moe is not None:
        experts, k, dhead = moe
        options += ["--experts", str(experts), "--kexperts", str(k), "--dhead", str(dhead)]
        options += ["--moe_routing", "dropless"]
    return {
        "model": name,
        "tokens": tokens,
        "parameters": params,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "peak_gib": peak / 2**30,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "stg_options": options,
        **({"experts_impl": "torch._grouped_mm" if GROUPED_MM else "loop"} if moe else {}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens", default="1024,2048,4096,8192")
    parser.add_argument(
        "--expert-loop",
        action="store_true",
        help="run a mixture's experts one GEMM each instead of torch._grouped_mm",
    )
    args = parser.parse_args()
    global GROUPED_MM
    GROUPED_MM = not args.expert_loop
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        print(f"unknown model {unknown[0]!r}; allowed: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    try:
        torch = require_cuda("eager_step.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with args.out.open("w") as out:
        for name in args.models.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                try:
                    row = measure(torch, name, tokens)
                except torch.OutOfMemoryError:
                    row = {"model": name, "tokens": tokens, "oom": True}
                    print(f"{name:<10}{tokens:>6} tokens  out of memory", flush=True)
                else:
                    print(
                        f"{name:<10}{tokens:>6} tokens  {row['step_s'] * 1e3:8.1f} ms  "
                        f"{row['peak_gib']:6.2f} GiB",
                        flush=True,
                    )
                torch.cuda.empty_cache()
                out.write(json.dumps(row) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
