"""Count the aten ops eager PyTorch dispatches in one training step of `eager_step.py`'s models.

    python benchmarks/count_eager_ops.py [--device cuda] [--out counts.json]

A ``TorchDispatchMode`` sees every op below autograd and autocast, as the device runs it
(views and ``_unsafe_view`` left out: they launch nothing). One step (bf16 autocast forward,
backward, gradients set to None) of a small Llama and GPT of ``eager_step.build`` with one and
with two layers: the difference is one layer's ops, the rest is the embedding's and the head's.
``stg.perf.eager`` holds the same counts per stg node (tests/data/eager holds a GPU's count,
tests/test_eager_ops.py sets the table beside both). Needs PyTorch.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

from stg.bench import MissingDependencyError, require
from stg.errors import write_replacing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eager_step  # the models it times

# small widths: the op count does not depend on them
SHAPES = {"llama": (64, 4, 2, 128, 100), "gpt": (64, 4, 4, 128, 100)}
TOKENS = 16


def count_step(torch: Any, family: str, layers: int, device: str) -> collections.Counter[str]:
    """Ops (``name.overload``: count) of the second of two training steps of ``family``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    skipped = {torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default}

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if not func.is_view and func not in skipped:
                self.ops[f"{func.overloadpacket.__name__}.{func._overloadname}"] += 1
            return func(*args, **(kwargs or {}))

    d, heads, kv, ffn, vocab = SHAPES[family]
    torch.manual_seed(0)
    model = eager_step.build(torch, family, d, layers, heads, kv, ffn, vocab, TOKENS).to(device)
    data = torch.randint(0, vocab, (1, TOKENS + 1), device=device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        for p in model.parameters():
            p.grad = None

    step()
    counter = Count()
    with counter:
        step()
    return counter.ops


def count(torch: Any, family: str, device: str) -> dict[str, dict[str, int]]:
    """One layer's ops and those outside the layers (embedding, head, loss)."""
    one, two = count_step(torch, family, 1, device), count_step(torch, family, 2, device)
    layer = two - one
    return {"layer": dict(sorted(layer.items())), "outside": dict(sorted((one - layer).items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        torch = require("torch", "count_eager_ops.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"torch": torch.__version__, "device": args.device}
    if args.device == "cuda":
        result["device"] = torch.cuda.get_device_name(0)
    for family in SHAPES:
        counts = count(torch, family, args.device)
        result[family] = {
            "layer_total": sum(counts["layer"].values()),
            "outside_total": sum(counts["outside"].values()),
            **counts,
        }
    text = json.dumps(result, indent=1) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        write_replacing(args.out, lambda tmp: tmp.write_text(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
