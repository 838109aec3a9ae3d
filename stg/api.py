"""The public API for plugin authors: everything a model, emitter or predictor plugin needs.

Plugins import from here (or from the modules named here) and nothing else of stg's
internals, so that the core can change behind it::

    from stg.api import GraphBuilder, Model, Tensor, hookimpl
"""

from stg import __version__, hookimpl
from stg.errors import TraceError, UnknownNameError, UserError
from stg.layout import Layout
from stg.options import GenerateOptions, OptionError
from stg.precision import DTYPE_BYTES
from stg.records import Emitter, Kernel, Model, PipelineSchedule, Predictor, RecordError
from stg.sharding import Sharding
from stg.symbolic import Dim, GraphBuilder, Tensor
from stg.workload import (
    CollectiveType,
    Node,
    NodeTemplate,
    NodeType,
    RankClass,
    RankGraph,
    Workload,
)

__all__ = [
    "DTYPE_BYTES",
    "CollectiveType",
    "Dim",
    "Emitter",
    "GenerateOptions",
    "GraphBuilder",
    "Kernel",
    "Layout",
    "Model",
    "Node",
    "NodeTemplate",
    "NodeType",
    "OptionError",
    "PipelineSchedule",
    "Predictor",
    "RankClass",
    "RankGraph",
    "RecordError",
    "Sharding",
    "Tensor",
    "TraceError",
    "UnknownNameError",
    "UserError",
    "Workload",
    "__version__",
    "hookimpl",
]
