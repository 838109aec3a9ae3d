"""The public API for plugin authors: everything a model, emitter or predictor plugin needs.

Plugins import from here (and ``stg.errors``; ``stg.testing`` in their tests) and nothing
else of stg's internals, so that the packages behind it can change::

    from stg.api import GraphBuilder, Model, Tensor, hookimpl

What is here, by the stage of the pipeline it belongs to:

- models: :class:`GraphBuilder`, :class:`Tensor`, :class:`Dim`, :class:`Sharding`, and the
  options a model is built from (:class:`GenerateOptions`); :func:`build_workload` runs the
  whole pipeline (what a plugin's tests call);
- workloads: :class:`Workload`, :class:`RankGraph`, :class:`RankClass`, :class:`Node`,
  :class:`NodeTemplate`, :class:`NodeType`, :class:`CollectiveType`, :class:`Layout`; what a
  node is for, from its typed attributes (:data:`NODE_SEMANTICS`, :class:`Phase`,
  :class:`Role`, :func:`node_phase`, :func:`node_role`, :func:`node_micro_batch`,
  :func:`node_part`, :func:`node_op`);
- emitters: the shared per-rank write loop :func:`write_rank_files`, file naming
  (:func:`output_paths`, :func:`write_comm_groups`), record framing (:func:`frame`), the
  GlobalMetadata of a generated rank file (:func:`generator_metadata`), and the encoders of
  the built-in formats (modules :mod:`chakra_v004`, :mod:`chakra_v001`, :mod:`json_trace`);
- predictors: systems (:class:`System`, :func:`load_system`, :func:`op_class`,
  :func:`normalize_dtype`; hybrid clusters: :class:`HybridSystem`, :func:`is_hybrid`,
  :func:`device_of`, :func:`group_of_rank`), the kernel time models (:func:`gemm_time`,
  :func:`attention_time`, :func:`memory_bound_time`), the cost of one node shared by the
  time predictors (:func:`compute_time`, :func:`collective_time`, :func:`send_time`,
  :func:`group_shape`, :func:`link_dimension`), the replay engine that times a multi-rank
  graph (:func:`replay` of a :class:`Problem` built by :func:`problem_from_workload`,
  :func:`problem_from_trace` or :func:`problem_from_nodes`; the module
  :mod:`replay_engine` for its analyses and models; :func:`replay_periodic`: a pipeline's
  steady state replayed once and extrapolated where it is checked to repeat), kernels
  (:class:`KernelTable`, :func:`kernel_table`, :func:`is_cast`; :func:`native_fp8`: whether
  a GPU runs fp8 GEMMs natively), dtype sizes and precision plans (:data:`DTYPE_BYTES`,
  :func:`precision_of`);
- calibration tables of measured kernel times (:class:`Calibration`,
  :func:`load_calibration`, :func:`calibrated_time`; ``stg bench calibrate`` writes them);
- records that hooks register: :class:`Model`, :class:`PipelineSchedule`, :class:`Kernel`,
  :class:`Emitter`, :class:`Predictor`, :class:`BenchOp`, :class:`Preset` (named
  configurations of a model: ``--model llama3-8b``).
"""

from stg import __version__, hookimpl
from stg.core.layout import Layout
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload
from stg.core.precision import DTYPE_BYTES, precision_of
from stg.core.sharding import Sharding
from stg.core.symbolic import Dim, GraphBuilder, Tensor
from stg.core.workload import (
    COMM_TYPES,
    NODE_SEMANTICS,
    CollectiveType,
    Node,
    NodeTemplate,
    NodeType,
    Phase,
    RankClass,
    RankGraph,
    Role,
    Workload,
    node_micro_batch,
    node_op,
    node_part,
    node_phase,
    node_role,
)
from stg.errors import TraceError, UnknownNameError, UserError
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
from stg.perf import comm_time
from stg.perf import replay as replay_engine
from stg.perf.calibration import Calibration, calibrated_time, load_calibration
from stg.perf.casts import CastModel, default_cast_model
from stg.perf.costs import (
    EAGER_OP_HOST_S,
    attention_impl,
    collective_phases,
    collective_time,
    compute_time,
    group_shape,
    link_dimension,
    native_fp8,
    send_phases,
    send_time,
    tree_all_reduce_time,
)
from stg.perf.hybrid import HybridSystem, device_of, group_of_rank, is_hybrid
from stg.perf.kernel_time import attention_time, gemm_time, memory_bound_time, memory_kind
from stg.perf.kernels import KernelTable, is_cast, kernel_name, kernel_table
from stg.perf.periodic import replay_periodic
from stg.perf.replay import (
    Problem,
    Replay,
    problem_from_nodes,
    problem_from_trace,
    problem_from_workload,
    replay,
)
from stg.perf.system import System, load_system, normalize_dtype, op_class
from stg.trace import chakra_v001, chakra_v004, json_trace
from stg.trace.writer import (
    frame,
    generator_metadata,
    output_paths,
    write_comm_groups,
    write_rank_files,
)

__all__ = [
    "COMM_TYPES",
    "DTYPE_BYTES",
    "EAGER_OP_HOST_S",
    "NODE_SEMANTICS",
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
    "build_workload",
    "calibrated_time",
    "chakra_v001",
    "chakra_v004",
    "collective_phases",
    "collective_time",
    "comm_time",
    "compute_time",
    "default_cast_model",
    "device_of",
    "frame",
    "gemm_time",
    "generator_metadata",
    "group_of_rank",
    "group_shape",
    "hookimpl",
    "is_cast",
    "is_hybrid",
    "json_trace",
    "kernel_name",
    "kernel_table",
    "link_dimension",
    "load_calibration",
    "load_system",
    "memory_bound_time",
    "memory_kind",
    "native_fp8",
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
    "replay",
    "replay_engine",
    "replay_periodic",
    "send_phases",
    "send_time",
    "tree_all_reduce_time",
    "write_comm_groups",
    "write_rank_files",
]
