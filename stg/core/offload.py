"""CPU activation offload: which layers' saved activations go to host memory, and when.

Megatron-LM's ``--cpu-offloading-num-layers N`` (megatron-core 0.20.0, d98e8a6:
``TransformerBlock`` wraps each layer's forward in Transformer Engine's
``get_cpu_offload_context(enabled, N, num_layers, ...)``) runs Transformer Engine's default
offload schedule (TE v2.10, 769ed77, and later: ``transformer_engine/pytorch/cpu_offload.py``,
``DefaultOffloadSynchronizer``; the older double-buffered handler survives only behind
``NVTE_CPU_OFFLOAD_V1=1``, its ``double_buffering`` argument is deprecated). With ``L``
layers and ``N`` offloaded:

- the first ``N`` layers (0 .. N-1) are offloaded (``_init_offload_synchronization_dicts``);
- the device-to-host copy of layer ``i`` is queued on the offload stream when layer ``i + 1``'s
  forward begins (``fwd_step``), each copy waiting for the event recorded when its tensor was
  saved (``start_offload``): after layer ``i``'s forward;
- before the forward of layer ``L - N + i`` the compute stream waits for that copy to finish,
  and the layer's device copies are freed (``finish_offload_map``,
  ``release_activation_forward_gpu_memory``): at most ``L - N`` layers' activations are on
  the device;
- the host-to-device copy of layer ``i`` is queued when the backward of layer
  ``L - 1 - N + i`` begins, after the compute issued so far (``start_reload_map``,
  ``start_reload``: ``offload_stream.wait_stream(current_stream)``), into buffers allocated
  then; the backward reads each reloaded tensor after its copy (``pop_tensor`` waits for
  its event);
- offloads and reloads share one stream (``OffloadSynchronizer.offload_stream``).

What is copied: every tensor a layer saves for its backward (TE's saved-tensor hooks catch
each ``save_for_backward`` inside the layer's forward; ``torch.nn.Parameter`` weights are never
offloaded, weight offloading is deprecated in TE and does nothing; v2.10 has no size floor,
the 256 Ki-element one came in v2.12). stg copies the layer's saved bytes
(:func:`stg.core.pipeline.layer_saved_bytes`): what Megatron-LM's kernels keep, the bytes the
memory predictor frees per offloaded layer. A bias add and RoPE save nothing (TE's ``Linear``
adds the bias in its GEMM, ``FusedRoPEFunc`` saves only the frequencies), a softmax its
output, a column-parallel GEMM under sequence parallelism its local input.
Where the copies go: host memory over the GPU's host link, which the predictors price
(``stg.perf.system.host_link_bandwidth``): PCIe to an x86 host, or on GB200/GB300 NVL72 the
superchip's NVLink-C2C to its Grace's LPDDR5X, shared by its two GPUs (docs/systems.md). What
the host holds, the first N layers' saved bytes of the micro-batch in flight, is not checked
against its capacity.
Megatron-LM refuses CPU offloading with pipeline parallelism
and with activation recompute, and needs ``N < num_layers``
(``TransformerConfig.__post_init__``); stg refuses the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from stg.core.options import GenerateOptions, OptionError
from stg.core.plan import RECOMPUTE


def offload_finished_before(layer: int, layers: int, offloaded: int) -> int | None:
    """The offloaded layer whose device-to-host copy the forward of ``layer`` waits for
    (``L - N + i == layer``), or None."""
    i = layer - layers + offloaded
    return i if 0 <= i < offloaded else None


def reload_started_before(layer: int, layers: int, offloaded: int) -> int | None:
    """The offloaded layer whose host-to-device copy starts when the backward of ``layer``
    begins (``L - 1 - N + i == layer``), or None."""
    i = layer - layers + 1 + offloaded
    return i if 0 <= i < offloaded else None


def held_activation_peak(layer_bytes: Sequence[float], offloaded: int) -> float:
    """The most bytes of saved activations on the device at once, over one micro-batch's
    forward and backward, when the first ``offloaded`` of the layers whose saved bytes are
    ``layer_bytes`` (in layer order) are offloaded as above: (L - N) layers' when every
    layer keeps the same. A layer's copies count from its forward until its offload
    finishes, and again from its reload until its backward ends."""
    count = len(layer_bytes)
    prefix = [0.0]
    for size in layer_bytes:
        prefix.append(prefix[-1] + size)

    def total(first: int, last: int) -> float:  # layers first .. last
        return prefix[last + 1] - prefix[first] if last >= first else 0.0

    peak = 0.0
    for f in range(count):  # the forward of layer f: offloads finished so far are freed
        freed = min(offloaded, max(0, f - count + offloaded + 1))
        peak = max(peak, total(freed, f))
    for j in range(count):  # the backward of layer j: kept layers and reloads started
        reloaded_from = max(0, j - count + 1 + offloaded)
        kept = total(offloaded, j)
        back = total(reloaded_from, min(offloaded - 1, j))
        peak = max(peak, kept + back)
    return peak


def check_offload(
    o: GenerateOptions,
    layers: int | None = None,
    recompute: str | None = None,
    order: Sequence[tuple[str, int, int]] | None = None,
) -> None:
    """Refuse ``cpu_offloading_num_layers`` where Megatron-LM does (see the module doc) or
    where the schedule does not run each micro-batch's backward before the next forward;
    ``layers``: the layers of the stack (default ``num_stacks``), ``recompute``: the
    resolved recompute mode (default ``activation_recompute``), ``order``: the schedule's
    steps on the one stage (None: not checked)."""
    layers = o.num_stacks if layers is None else layers
    recompute = (
        RECOMPUTE.get(str(o.activation_recompute).lower()) if recompute is None else recompute
    )
    n = o.cpu_offloading_num_layers
    name = "cpu_offloading_num_layers"
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise OptionError(f"{name}={n} must be a non-negative integer (0: off)")
    if n == 0:
        return
    if o.inference:
        raise OptionError(
            f"{name}={n} is a training option; phase={o.phase} keeps no activations for a "
            "backward (leave it unset)"
        )
    if o.pp > 1 or o.virtual_stages > 1:
        raise OptionError(
            f"{name}={n}: Megatron-LM has no CPU offloading under pipeline parallelism "
            f"(pp={o.pp}, virtual_stages={o.virtual_stages}); allowed: pp=1, virtual_stages=1"
        )
    if recompute != "none":
        raise OptionError(
            f"{name}={n}: Megatron-LM's CPU offloading does not work with activation "
            f"recompute (activation_recompute={o.activation_recompute}); allowed: "
            "activation_recompute=none"
        )
    if layers < 2 or n >= layers:
        allowed = f"1 to {layers - 1}" if layers >= 2 else "0 (a stack of one layer)"
        raise OptionError(
            f"{name}={n}: the stack has {layers} layer(s) and at least one keeps its "
            f"activations on the GPU (Megatron-LM); allowed: {allowed}"
        )
    steps = [direction for direction, _, _ in order or ()]
    if steps != ["F", "B"] * (len(steps) // 2):
        raise OptionError(
            f"{name}={n}: pipeline_schedule={o.pipeline_schedule} runs several forwards before "
            "a backward, and Transformer Engine's offload schedule counts one micro-batch's "
            "layers at a time; allowed: a schedule that runs each micro-batch's backward "
            "before the next forward on one stage (1f1b)"
        )
