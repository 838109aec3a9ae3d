"""The public API for plugin authors: everything a model, emitter or predictor plugin needs.

Plugins import from here (and ``stg.errors``; ``stg.testing`` in their tests) and nothing
else of stg's internals, so that the packages behind it can change::

    from stg.api import GraphBuilder, Model, Tensor, hookimpl

What is here, by the stage of the pipeline it belongs to:

- models: :class:`GraphBuilder`, :class:`Tensor`, :class:`Dim`, :class:`AttentionSpan`,
  :class:`Sharding`, and the
  options a model is built from (:class:`GenerateOptions`; :func:`chunk_layer_counts`: the
  layers of each pipeline model chunk; :func:`layout_of`: the placement of its mesh;
  :func:`expert_zero_degree`: how many ways ZeRO shards a routed expert);
  :func:`build_workload` runs the whole pipeline (what a plugin's tests call);
- workloads: :class:`Workload`, :class:`RankGraph`, :class:`RankClass`, :class:`Node`,
  :class:`NodeTemplate`, :class:`NodeType`, :class:`CollectiveType`, :class:`Layout`; what a
  node is for, from its typed attributes (:data:`NODE_SEMANTICS`; :class:`Phase`,
  :class:`Role` and :class:`PartCode`, whose values are the int64 codes traces carry;
  :func:`node_phase`, :func:`node_role`, :func:`node_micro_batch`, :func:`node_part`,
  :func:`node_chunk`, :func:`node_op`);
- emitters: the shared per-rank write loop :func:`write_rank_files`, file naming
  (:func:`output_paths`, :func:`write_comm_groups`), record framing (:func:`frame`), the
  GlobalMetadata of a generated rank file (:func:`generator_metadata`), and the encoders of
  the built-in formats (modules :mod:`chakra_v004`, :mod:`chakra_v001`, :mod:`json_trace`);
- predictors: systems (:class:`System`, :func:`load_system`, :func:`op_class`,
  :func:`normalize_dtype`; hybrid clusters: :class:`HybridSystem`, :func:`is_hybrid`,
  :func:`device_of`, :func:`group_of_rank`), the kernel time models (:func:`gemm_time`,
  :func:`attention_time`, :func:`memory_bound_time`), the cost of one node shared by the
  time predictors (:func:`compute_time`, :func:`collective_time`, :func:`send_time`,
  :func:`expert_dispatch_time`: an expert dispatch that DeepEP or HybridEP runs, the
  routing it reads from a node's attributes, :func:`expert_route`,
  :func:`group_shape`, :func:`link_dimension`), the replay engine that times a multi-rank
  graph (:func:`replay` of a :class:`Problem` built by :func:`problem_from_workload`,
  :func:`problem_from_trace` or :func:`problem_from_nodes`; the module
  :mod:`replay_engine` for its analyses and models; :func:`replay_periodic`: a pipeline's
  steady state replayed once and extrapolated where it is checked to repeat), kernels
  (:class:`KernelTable`, :func:`kernel_table`, :func:`is_cast`; :func:`native_fp8`: whether
  a GPU runs fp8 GEMMs natively), dtype sizes and precision plans (:data:`DTYPE_BYTES`,
  :func:`precision_of`), low-precision training recipes (:data:`RECIPES`), how lowering
  writes context parallelism (:func:`lowered_cp_comm_type`, :data:`TORCH_ALL_GATHER`: PyTorch's
  own under torchtitan's profiles);
- calibration tables of measured kernel times (:class:`Calibration`,
  :func:`load_calibration`, :func:`calibrated_time`; ``stg bench calibrate`` writes them);
- records that hooks register: :class:`Model`, :class:`PipelineSchedule`, :class:`Kernel`,
  :class:`Emitter`, :class:`Predictor`, :class:`BenchOp`, :class:`Preset` (named
  configurations of a model: ``--model llama3-8b``; :func:`load_presets` reads them from a
  TOML file that a plugin ships).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stg import __version__, hookimpl
from stg.errors import TraceError, UnknownNameError, UserError
from stg.host.presetfile import load_presets
from stg.host.records import (
    BenchOp,
    Emitter,
    Kernel,
    Model,
    PipelineSchedule,
    Predictor,
    Preset,
    RecordError,
)

if TYPE_CHECKING:
    from stg.core.layout import PIPELINE_ENDS, Layout
    from stg.core.muon import SHARE_ATTR
    from stg.core.muon import part_parameters as muon_part_parameters
    from stg.core.offload import check_offload, held_activation_peak
    from stg.core.options import GenerateOptions, OptionError
    from stg.core.pipeline import build_workload, detached_parts, name_in_micro_batch
    from stg.core.plan import (
        chunk_layer_counts,
        expert_zero_degree,
        layout_of,
        recompute_units,
    )
    from stg.core.precision import DTYPE_BYTES, precision_of
    from stg.core.recipes import RECIPES, bf16_kind, cached_weight_bytes, model_kind
    from stg.core.routing import expert_capacity
    from stg.core.sharding import Sharding
    from stg.core.sizes import check_size, estimate_size
    from stg.core.symbolic import AttentionSpan, Dim, GraphBuilder, Tensor
    from stg.core.torch_context_parallel import TORCH_ALL_GATHER, lowered_cp_comm_type
    from stg.core.workload import (
        COMM_TYPES,
        NODE_SEMANTICS,
        CollectiveType,
        Node,
        NodeTemplate,
        NodeType,
        PartCode,
        Phase,
        RankClass,
        RankGraph,
        Role,
        Workload,
        node_chunk,
        node_micro_batch,
        node_op,
        node_part,
        node_phase,
        node_role,
    )
    from stg.perf import comm_time
    from stg.perf import replay as replay_engine
    from stg.perf.calibration import Calibration, calibrated_time, load_calibration
    from stg.perf.casts import CastModel, default_cast_model
    from stg.perf.costs import (
        EAGER_OP_HOST_S,
        attention_impl,
        check_runs_on,
        collective_phases,
        collective_time,
        compute_time,
        expert_dispatch_time,
        group_shape,
        link_dimension,
        native_fp8,
        send_phases,
        send_time,
        tree_all_reduce_time,
    )
    from stg.perf.ep_dispatch import routed as expert_route
    from stg.perf.hybrid import HybridSystem, device_of, group_of_rank, is_hybrid
    from stg.perf.kernel_time import attention_time, gemm_time, memory_bound_time, memory_kind
    from stg.perf.kernels import KernelTable, is_cast, kernel_name, kernel_table
    from stg.perf.periodic import first_keep, replay_periodic, state_keep, unit_flops
    from stg.perf.replay import (
        Problem,
        Replay,
        problem_from_nodes,
        problem_from_trace,
        problem_from_workload,
        replay,
    )
    from stg.perf.system import System, check_capacity, load_system, normalize_dtype, op_class
    from stg.trace import chakra_v001, chakra_v004, json_trace
    from stg.trace.writer import (
        frame,
        generator_metadata,
        output_paths,
        write_comm_groups,
        write_rank_files,
    )

_LAZY: dict[str, tuple[str, str | None]] = {
    "Layout": ("stg.core.layout", "Layout"),
    "PIPELINE_ENDS": ("stg.core.layout", "PIPELINE_ENDS"),
    "GenerateOptions": ("stg.core.options", "GenerateOptions"),
    "OptionError": ("stg.core.options", "OptionError"),
    "build_workload": ("stg.core.pipeline", "build_workload"),
    "detached_parts": ("stg.core.pipeline", "detached_parts"),
    "chunk_layer_counts": ("stg.core.plan", "chunk_layer_counts"),
    "layout_of": ("stg.core.plan", "layout_of"),
    "expert_zero_degree": ("stg.core.plan", "expert_zero_degree"),
    "check_size": ("stg.core.sizes", "check_size"),
    "estimate_size": ("stg.core.sizes", "estimate_size"),
    "name_in_micro_batch": ("stg.core.pipeline", "name_in_micro_batch"),
    "recompute_units": ("stg.core.plan", "recompute_units"),
    "held_activation_peak": ("stg.core.offload", "held_activation_peak"),
    "check_offload": ("stg.core.offload", "check_offload"),
    "DTYPE_BYTES": ("stg.core.precision", "DTYPE_BYTES"),
    "precision_of": ("stg.core.precision", "precision_of"),
    "lowered_cp_comm_type": ("stg.core.torch_context_parallel", "lowered_cp_comm_type"),
    "TORCH_ALL_GATHER": ("stg.core.torch_context_parallel", "TORCH_ALL_GATHER"),
    "RECIPES": ("stg.core.recipes", "RECIPES"),
    "bf16_kind": ("stg.core.recipes", "bf16_kind"),
    "cached_weight_bytes": ("stg.core.recipes", "cached_weight_bytes"),
    "model_kind": ("stg.core.recipes", "model_kind"),
    "expert_capacity": ("stg.core.routing", "expert_capacity"),
    "Sharding": ("stg.core.sharding", "Sharding"),
    "AttentionSpan": ("stg.core.symbolic", "AttentionSpan"),
    "Dim": ("stg.core.symbolic", "Dim"),
    "GraphBuilder": ("stg.core.symbolic", "GraphBuilder"),
    "Tensor": ("stg.core.symbolic", "Tensor"),
    "COMM_TYPES": ("stg.core.workload", "COMM_TYPES"),
    "NODE_SEMANTICS": ("stg.core.workload", "NODE_SEMANTICS"),
    "CollectiveType": ("stg.core.workload", "CollectiveType"),
    "Node": ("stg.core.workload", "Node"),
    "NodeTemplate": ("stg.core.workload", "NodeTemplate"),
    "NodeType": ("stg.core.workload", "NodeType"),
    "PartCode": ("stg.core.workload", "PartCode"),
    "Phase": ("stg.core.workload", "Phase"),
    "RankClass": ("stg.core.workload", "RankClass"),
    "RankGraph": ("stg.core.workload", "RankGraph"),
    "Role": ("stg.core.workload", "Role"),
    "Workload": ("stg.core.workload", "Workload"),
    "node_chunk": ("stg.core.workload", "node_chunk"),
    "node_micro_batch": ("stg.core.workload", "node_micro_batch"),
    "node_op": ("stg.core.workload", "node_op"),
    "node_part": ("stg.core.workload", "node_part"),
    "node_phase": ("stg.core.workload", "node_phase"),
    "node_role": ("stg.core.workload", "node_role"),
    "comm_time": ("stg.perf.comm_time", None),
    "replay_engine": ("stg.perf.replay", None),
    "Calibration": ("stg.perf.calibration", "Calibration"),
    "calibrated_time": ("stg.perf.calibration", "calibrated_time"),
    "load_calibration": ("stg.perf.calibration", "load_calibration"),
    "CastModel": ("stg.perf.casts", "CastModel"),
    "default_cast_model": ("stg.perf.casts", "default_cast_model"),
    "EAGER_OP_HOST_S": ("stg.perf.costs", "EAGER_OP_HOST_S"),
    "SHARE_ATTR": ("stg.core.muon", "SHARE_ATTR"),
    "muon_part_parameters": ("stg.core.muon", "part_parameters"),
    "attention_impl": ("stg.perf.costs", "attention_impl"),
    "check_runs_on": ("stg.perf.costs", "check_runs_on"),
    "collective_phases": ("stg.perf.costs", "collective_phases"),
    "collective_time": ("stg.perf.costs", "collective_time"),
    "compute_time": ("stg.perf.costs", "compute_time"),
    "expert_dispatch_time": ("stg.perf.costs", "expert_dispatch_time"),
    "expert_route": ("stg.perf.ep_dispatch", "routed"),
    "group_shape": ("stg.perf.costs", "group_shape"),
    "link_dimension": ("stg.perf.costs", "link_dimension"),
    "native_fp8": ("stg.perf.costs", "native_fp8"),
    "send_phases": ("stg.perf.costs", "send_phases"),
    "send_time": ("stg.perf.costs", "send_time"),
    "tree_all_reduce_time": ("stg.perf.costs", "tree_all_reduce_time"),
    "HybridSystem": ("stg.perf.hybrid", "HybridSystem"),
    "device_of": ("stg.perf.hybrid", "device_of"),
    "group_of_rank": ("stg.perf.hybrid", "group_of_rank"),
    "is_hybrid": ("stg.perf.hybrid", "is_hybrid"),
    "attention_time": ("stg.perf.kernel_time", "attention_time"),
    "gemm_time": ("stg.perf.kernel_time", "gemm_time"),
    "memory_bound_time": ("stg.perf.kernel_time", "memory_bound_time"),
    "memory_kind": ("stg.perf.kernel_time", "memory_kind"),
    "KernelTable": ("stg.perf.kernels", "KernelTable"),
    "is_cast": ("stg.perf.kernels", "is_cast"),
    "kernel_name": ("stg.perf.kernels", "kernel_name"),
    "kernel_table": ("stg.perf.kernels", "kernel_table"),
    "Problem": ("stg.perf.replay", "Problem"),
    "Replay": ("stg.perf.replay", "Replay"),
    "problem_from_nodes": ("stg.perf.replay", "problem_from_nodes"),
    "problem_from_trace": ("stg.perf.replay", "problem_from_trace"),
    "problem_from_workload": ("stg.perf.replay", "problem_from_workload"),
    "replay": ("stg.perf.replay", "replay"),
    "replay_periodic": ("stg.perf.periodic", "replay_periodic"),
    "first_keep": ("stg.perf.periodic", "first_keep"),
    "state_keep": ("stg.perf.periodic", "state_keep"),
    "unit_flops": ("stg.perf.periodic", "unit_flops"),
    "System": ("stg.perf.system", "System"),
    "load_system": ("stg.perf.system", "load_system"),
    "check_capacity": ("stg.perf.system", "check_capacity"),
    "normalize_dtype": ("stg.perf.system", "normalize_dtype"),
    "op_class": ("stg.perf.system", "op_class"),
    "chakra_v001": ("stg.trace.chakra_v001", None),
    "chakra_v004": ("stg.trace.chakra_v004", None),
    "json_trace": ("stg.trace.json_trace", None),
    "frame": ("stg.trace.writer", "frame"),
    "generator_metadata": ("stg.trace.writer", "generator_metadata"),
    "output_paths": ("stg.trace.writer", "output_paths"),
    "write_comm_groups": ("stg.trace.writer", "write_comm_groups"),
    "write_rank_files": ("stg.trace.writer", "write_rank_files"),
}
"""Where each name imported on first use lives: (module, attribute), or (module, None) for a
module. The records, the errors and ``hookimpl`` load with this module; the rest (the symbolic
core and sympy among them) when a plugin first touches them, so that registering a kernel or
a predictor costs no more than its record."""


def __getattr__(name: str) -> Any:
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "COMM_TYPES",
    "DTYPE_BYTES",
    "EAGER_OP_HOST_S",
    "NODE_SEMANTICS",
    "PIPELINE_ENDS",
    "RECIPES",
    "SHARE_ATTR",
    "TORCH_ALL_GATHER",
    "AttentionSpan",
    "BenchOp",
    "Calibration",
    "CastModel",
    "CollectiveType",
    "Dim",
    "Emitter",
    "GenerateOptions",
    "GraphBuilder",
    "HybridSystem",
    "Kernel",
    "KernelTable",
    "Layout",
    "Model",
    "Node",
    "NodeTemplate",
    "NodeType",
    "OptionError",
    "PartCode",
    "Phase",
    "PipelineSchedule",
    "Predictor",
    "Preset",
    "Problem",
    "RankClass",
    "RankGraph",
    "RecordError",
    "Replay",
    "Role",
    "Sharding",
    "System",
    "Tensor",
    "TraceError",
    "UnknownNameError",
    "UserError",
    "Workload",
    "__version__",
    "attention_impl",
    "attention_time",
    "bf16_kind",
    "build_workload",
    "cached_weight_bytes",
    "calibrated_time",
    "chakra_v001",
    "chakra_v004",
    "check_capacity",
    "check_offload",
    "check_runs_on",
    "check_size",
    "chunk_layer_counts",
    "collective_phases",
    "collective_time",
    "comm_time",
    "compute_time",
    "default_cast_model",
    "detached_parts",
    "device_of",
    "estimate_size",
    "expert_capacity",
    "expert_dispatch_time",
    "expert_route",
    "expert_zero_degree",
    "first_keep",
    "frame",
    "gemm_time",
    "generator_metadata",
    "group_of_rank",
    "group_shape",
    "held_activation_peak",
    "hookimpl",
    "is_cast",
    "is_hybrid",
    "json_trace",
    "kernel_name",
    "kernel_table",
    "layout_of",
    "link_dimension",
    "load_calibration",
    "load_presets",
    "load_system",
    "lowered_cp_comm_type",
    "memory_bound_time",
    "memory_kind",
    "model_kind",
    "muon_part_parameters",
    "name_in_micro_batch",
    "native_fp8",
    "node_chunk",
    "node_micro_batch",
    "node_op",
    "node_part",
    "node_phase",
    "node_role",
    "normalize_dtype",
    "op_class",
    "output_paths",
    "precision_of",
    "problem_from_nodes",
    "problem_from_trace",
    "problem_from_workload",
    "recompute_units",
    "replay",
    "replay_engine",
    "replay_periodic",
    "send_phases",
    "send_time",
    "state_keep",
    "tree_all_reduce_time",
    "unit_flops",
    "write_comm_groups",
    "write_rank_files",
]
