"""The core: options and a model template in, per-rank workloads out.

options (GenerateOptions) -> symbolic (GraphBuilder: the forward graph over sympy shapes and
shardings; sharding chooses collectives) -> autodiff (backward, gradient reduction, optimizer)
-> plan and layout (parallel degrees, stages, rank placement, communicators) -> lowering
(bind sizes to integers once per rank class) -> workload (RankGraph per rank); pipeline runs
those steps in order. The core imports neither trace, perf, cli nor any built-in plugin.
"""
