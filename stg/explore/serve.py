"""``stg serve``: a discrete-event simulation of an inference cluster over a request stream.

``replicas`` copies of one model replica (tensor parallel over ``tp`` GPUs) serve requests
routed to them on arrival. Each replica runs iterations back to back while it has work; an
iteration's time is the serving model's time for its exact batch
(:class:`stg.explore.serve_cost.IterationPricer`), plus a fixed scheduler time per iteration
where one is given. A request is tokenized before it reaches a replica (``prompt /
tokenize_rate`` seconds).

Every running sequence has ``computed`` tokens in the KV cache and ``prompt + generated``
tokens known; an iteration processes some of the difference and, where it closes the gap,
samples the next token (as vLLM's scheduler tracks ``num_computed_tokens``). A decoding
sequence's gap is its last token; a prefill's is its prompt; after a preemption by recompute
it is the prompt and every token generated so far.

Schedulers, each from its source:

- ``vllm``: vLLM's scheduler without chunked prefill (``vllm/core/scheduler.py`` of v0.6,
  ``_schedule_default``): a step runs new prompts whole, first come first served, while their
  tokens fit ``max_num_batched_tokens``, the running sequences ``max_num_seqs``, and their
  blocks the free blocks above a 1 % watermark (``BlockSpaceManager``'s ``watermark=0.01``);
  a step that admits any prompt runs only prompts. Otherwise every running sequence decodes
  one token; where blocks run out the newest running sequence is preempted (by recompute:
  its blocks freed, its tokens recomputed when it is admitted again, ahead of new ones).
- ``sarathi``: chunked prefill with decodes first, Sarathi-Serve (Agrawal et al., OSDI 2024)
  and vLLM's V1 scheduler (``vllm/v1/core/sched/scheduler.py``): running sequences first, in
  order, each taking its remaining tokens up to what is left of the token budget (a decode
  one), then waiting ones, chunked to the budget, while ``max_num_seqs`` allows; a running
  sequence whose blocks cannot be allocated preempts the newest running one (recompute).
- ``static``: request-level batching (the baseline of Orca, Yu et al., OSDI 2022): an idle
  replica takes up to ``max_num_seqs`` waiting requests whose whole sequences (prompt and
  output) fit in its blocks, prefills them in one step and decodes all of them until the
  longest is done (a finished sequence keeps its place and its cost); then the next batch.

Paged KV cache: a sequence holds ``ceil(tokens / block_size)`` blocks; a replica has the
blocks its GPUs' memory leaves after the weights and the activations of its largest
iteration (:func:`stg.explore.serve_cost.kv_blocks`). A prefix-cache hit rate ``h`` makes
the first ``h·prompt`` tokens (whole blocks, at least one token left) of every admission
cached: they are not computed, and their blocks are counted as the request's own.

Routing on arrival: ``round-robin``; ``least-outstanding`` (fewest requests in the replica);
``kv-aware`` (the fewest KV blocks held and wanted by its requests). A replica's state is read
at its first iteration boundary at or after the arrival.

Stretches of pure decoding (nothing waiting, every running sequence decoding) run without
touching the sequences step by step: their contexts all grow by one per step, so the step
times follow from the batch size and the mean context, up to the first sequence to finish,
the first block the cache cannot give, or the next arrival.
"""

from __future__ import annotations

import bisect
import heapq
import math
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stg.errors import UserError
from stg.explore.serve_cost import Batch, IterationPricer
from stg.explore.serve_requests import Stream, check_seed

SCHEDULERS = ("vllm", "sarathi", "static")
ROUTINGS = ("round-robin", "least-outstanding", "kv-aware")
PREEMPTIONS = ("recompute", "swap")
WATERMARK = 0.01
"""Free blocks vLLM's block manager keeps when admitting prompts (``watermark=0.01``)."""


@dataclass(frozen=True)
class EngineConfig:
    """A replica's scheduler and cache, and the cluster around it."""

    scheduler: str = "sarathi"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    blocks: int = 0
    replicas: int = 1
    routing: str = "round-robin"
    prefix_hit_rate: float = 0.0
    tokenize_rate: float = math.inf
    iteration_overhead_s: float = 0.0
    sample_interval_s: float = 1.0
    prefill_replicas: int = 0
    """> 0: disaggregated serving, this many prefill replicas beside ``replicas`` decode ones"""
    speculative_tokens: int = 0
    """> 0: speculative decoding, this many draft tokens verified per decoding sequence"""
    acceptance_rate: float = 0.0
    """probability that the target model accepts each draft token (independently)"""
    seed: int = 0
    """seed of the acceptance draws"""
    preemption: str = "recompute"
    """``recompute`` or ``swap`` (the victim's blocks copied to host memory and back)"""
    swap_bandwidth: float = 0.0
    """bytes/s one GPU moves to or from host memory (``swap``)"""
    num_scheduler_steps: int = 1
    """decode steps per scheduler call (vLLM's multi-step scheduling, ``vllm`` scheduler)"""
    stream_round_end: bool = False
    """multi-step: a round's tokens reach the client at its end (vLLM v0.6.0), not per step"""
    output_lag: bool = False
    """overlap scheduling: an iteration's first tokens and finishes reach the client at the
    end of the next iteration's first step (its outputs are processed while that one runs)"""

    def check(self, *, with_blocks: bool = True) -> None:
        """One error line for a value out of range (``with_blocks`` False: all but the
        blocks, which are known once the replica is priced)."""
        if self.scheduler not in SCHEDULERS:
            raise UserError(
                f"--scheduler {self.scheduler!r}: allowed values are {', '.join(SCHEDULERS)}"
            )
        if self.routing not in ROUTINGS:
            raise UserError(f"--routing {self.routing!r}: allowed values are {', '.join(ROUTINGS)}")
        for name, value in (
            ("max-num-seqs", self.max_num_seqs),
            ("max-num-batched-tokens", self.max_num_batched_tokens),
            ("block-size", self.block_size),
            ("replicas", self.replicas),
        ):
            if value < 1:
                raise UserError(f"--{name} {value}: must be a positive integer")
        if with_blocks and self.blocks < 1:
            raise UserError("the KV cache has no block left after the weights and activations")
        if not 0 <= self.prefix_hit_rate < 1:
            raise UserError(f"--prefix-hit-rate {self.prefix_hit_rate}: must be in [0, 1)")
        if self.prefill_replicas < 0:
            raise UserError(f"--prefill-replicas {self.prefill_replicas}: must be >= 0")
        if self.preemption not in PREEMPTIONS:
            raise UserError(
                f"--preemption {self.preemption!r}: allowed values are {', '.join(PREEMPTIONS)}"
            )
        if self.preemption == "swap" and not self.swap_bandwidth > 0:
            raise UserError(
                "--preemption swap needs the host link's bandwidth: --swap-bandwidth GB/s"
            )
        if self.speculative_tokens < 0:
            raise UserError(f"--speculative {self.speculative_tokens}: must be >= 0")
        if self.speculative_tokens >= self.max_num_batched_tokens:
            raise UserError(
                f"--speculative {self.speculative_tokens}: a decoding sequence verifies "
                f"{self.speculative_tokens + 1} tokens; --max-num-batched-tokens is "
                f"{self.max_num_batched_tokens}"
            )
        if not 0 <= self.acceptance_rate <= 1:
            raise UserError(f"--acceptance {self.acceptance_rate}: must be in [0, 1]")
        if self.prefill_replicas and self.scheduler == "static":
            raise UserError(
                "--prefill-replicas: disaggregated serving needs --scheduler sarathi or vllm"
            )
        if self.num_scheduler_steps < 1:
            raise UserError(
                f"--num-scheduler-steps {self.num_scheduler_steps}: must be a positive integer"
            )
        if self.num_scheduler_steps > 1 and self.scheduler != "vllm":
            raise UserError(
                f"--num-scheduler-steps {self.num_scheduler_steps}: multi-step scheduling is "
                "modelled for --scheduler vllm (whole prompts, single-step prefills)"
            )
        if self.num_scheduler_steps > 1 and (self.speculative_tokens or self.prefill_replicas):
            raise UserError(
                f"--num-scheduler-steps {self.num_scheduler_steps}: multi-step scheduling takes "
                "neither --speculative nor --prefill-replicas"
            )
        if self.iteration_overhead_s < 0:
            raise UserError(f"--iteration-overhead {self.iteration_overhead_s}: must be >= 0")
        if not self.tokenize_rate > 0:
            raise UserError(f"--tokenize-rate {self.tokenize_rate}: must be positive")
        check_seed(self.seed)


class Request:
    """One request's state and record."""

    __slots__ = (
        "arrival",
        "blocks",
        "computed",
        "finish",
        "first_token",
        "generated",
        "hit",
        "id",
        "last_emit",
        "output",
        "preemptions",
        "prompt",
        "ready",
        "replica",
    )

    def __init__(self, rid: int, arrival: float, prompt: int, output: int, ready: float) -> None:
        self.id = rid
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.ready = ready
        self.replica = -1
        self.computed = 0
        self.generated = 0
        self.blocks = 0
        self.hit = 0
        self.first_token = math.nan
        self.finish = math.nan
        self.last_emit = math.nan
        self.preemptions = 0

    @property
    def known(self) -> int:
        return self.prompt + self.generated

    @property
    def pending(self) -> int:
        return self.prompt + self.generated - self.computed


@dataclass
class Trace:
    """What the simulation records beside the requests."""

    itl_values: array = field(default_factory=lambda: array("d"))
    itl_weights: array = field(default_factory=lambda: array("q"))
    samples: list[tuple[float, int, int, int, int, int]] = field(default_factory=list)
    """(time, replica, blocks used, running, waiting, preemptions so far)"""
    iterations: int = 0
    area: float = 0.0
    """∫ requests in the system dt, from the replicas' queues"""
    swapped_blocks: int = 0
    """blocks copied to host memory and back (each way counts)"""
    swap_s: float = 0.0
    """seconds iterations spent on those copies"""
    verified: int = 0
    """sequence-steps of speculative verification"""
    accepted: int = 0
    """draft tokens accepted over them"""


class Replica:
    """One model replica: its queues, cache and clock."""

    def __init__(
        self,
        index: int,
        config: EngineConfig,
        pricer: IterationPricer,
        trace: Trace,
        role: str = "both",
        draft: IterationPricer | None = None,
    ) -> None:
        self.index = index
        self.draft = draft
        self.lookahead = config.speculative_tokens if draft is not None else 0
        self.steps = config.num_scheduler_steps
        self.late: list[tuple[Request, bool]] = []
        """(request, whether its finish, else its first token) stamped in the last iteration
        and delivered one iteration later (``output_lag``)"""
        self.rng = np.random.default_rng([config.seed, index])
        self.role = role
        """``both`` (aggregated), ``prefill`` (hands requests off after their first token) or
        ``decode`` (receives them with their KV cache)"""
        self.handoffs: list[tuple[float, Request]] = []
        self.config = config
        self.pricer = pricer
        self.trace = trace
        self.clock = 0.0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free = config.blocks
        self.preemptions = 0
        self.next_sample = 0.0
        self.static_batch: list[Request] = []
        self.swapped: list[Request] = []
        """preempted to host memory, in arrival order"""
        self.swap_s = 0.0  # the copies of the iteration being scheduled
        self.preempted_now = False
        draft_bytes = draft.kv_bytes_per_token if draft is not None else 0
        self.block_bytes = (pricer.kv_bytes_per_token + draft_bytes) * config.block_size

    # -- state that routing reads --------------------------------------------------------------

    def outstanding(self) -> int:
        """Requests waiting, running or swapped out."""
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def kv_load(self) -> int:
        """Blocks held, plus those its waiting and swapped requests want."""
        bs = self.config.block_size
        wanted = sum(-(-r.known // bs) for r in (*self.waiting, *self.swapped))
        return self.config.blocks - self.free + wanted

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- blocks ----------------------------------------------------------------------------------

    def _grow(self, r: Request, tokens: int) -> bool:
        """Give ``r`` the blocks for ``tokens`` tokens in the cache; False if there are none."""
        need = -(-tokens // self.config.block_size) - r.blocks
        if need <= 0:
            return True
        if need > self.free:
            return False
        self.free -= need
        r.blocks += need
        return True

    def _release(self, r: Request) -> None:
        self.free += r.blocks
        r.blocks = 0

    def _preempt(self, r: Request) -> None:
        """Preempt ``r``: by recompute (its cache dropped, it waits first in line) or by swap
        (its blocks copied to host memory in this iteration; it keeps its tokens)."""
        r.preemptions += 1
        self.preemptions += 1
        self.preempted_now = True
        self.running.remove(r)
        if self.config.preemption == "swap" and r.generated > 0:  # a prompt is recomputed
            self._copy(-(-r.computed // self.config.block_size))
            self._release(r)
            bisect.insort(self.swapped, r, key=lambda x: x.id)
            return
        self._release(r)
        r.computed = 0
        self.waiting.appendleft(r)

    def _copy(self, blocks: int) -> None:
        """Blocks copied between GPU and host memory in this iteration (every GPU its share,
        over its own link at once)."""
        seconds = blocks * self.block_bytes / self.config.swap_bandwidth
        self.swap_s += seconds
        self.trace.swap_s += seconds
        self.trace.swapped_blocks += blocks

    def _swap_in(self) -> list[tuple[Request, int]]:
        """Bring swapped sequences back, oldest first, while their blocks fit (none after a
        preemption in the same iteration, as vLLM's scheduler does)."""
        back: list[tuple[Request, int]] = []
        if self.preempted_now:
            return back
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            r = self.swapped[0]
            if not self._grow(r, r.computed + self.steps + self.lookahead):
                break
            self._copy(-(-r.computed // self.config.block_size))
            self.swapped.pop(0)
            self.running.append(r)
            back.append((r, 1))
        return back

    def _admit_hit(self, r: Request) -> None:
        if r.computed == 0 and self.config.prefix_hit_rate > 0:
            bs = self.config.block_size
            cached = int(self.config.prefix_hit_rate * r.prompt) // bs * bs
            r.hit = min(cached, (r.known - 1) // bs * bs)
            r.computed = r.hit

    # -- one iteration -----------------------------------------------------------------------

    def _schedule(self) -> list[tuple[Request, int]]:
        scheduler = self.config.scheduler
        if self.role == "decode":  # decodes only: chunks of one token, newest preempted
            return self._schedule_chunked()
        if scheduler == "static":
            return self._schedule_static()
        if scheduler == "vllm":
            return self._schedule_vllm()
        return self._schedule_chunked()

    def _schedule_vllm(self) -> list[tuple[Request, int]]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        watermark = int(WATERMARK * cfg.blocks)
        chosen: list[tuple[Request, int]] = []
        while not self.swapped and self.waiting and self.waiting[0].ready <= self.clock:
            r = self.waiting[0]
            if len(self.running) >= cfg.max_num_seqs:
                break
            self._admit_hit(r)
            n = r.pending
            if n > budget and chosen:
                break  # (a prompt longer than the whole budget runs alone)
            need = -(-r.known // cfg.block_size) - r.blocks
            if self.free - need < watermark:
                if not chosen and not self.running and need > cfg.blocks - watermark:
                    raise UserError(
                        f"request {r.id}: {r.known} tokens need {need} KV blocks; a replica has "
                        f"{cfg.blocks}"
                    )
                break
            self._grow(r, r.known)
            self.waiting.popleft()
            self.running.append(r)
            chosen.append((r, n))
            budget -= n
        if chosen:
            return chosen
        for r in list(self.running):  # decode every running sequence, newest preempted first
            if r not in self.running:
                continue
            while not self._grow(r, r.computed + self.steps + self.lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    break
        decoding = [(r, 1) for r in self.running]
        return decoding + self._swap_in()

    def _schedule_chunked(self) -> list[tuple[Request, int]]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.pending, budget)
            extra = self.lookahead if r.pending == 1 and r.generated > 0 else 0
            if n + extra > budget:
                break
            preempted_self = False
            while not self._grow(r, r.computed + n + extra):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    preempted_self = True
                    break
            if preempted_self:
                break
            chosen.append((r, n))
            budget -= n + extra
            i += 1
        if self.swapped and budget > 0:
            back = self._swap_in()
            chosen.extend(back)
            budget -= sum(n + self.lookahead for _, n in back)
        while (
            not self.swapped and self.waiting and budget > 0 and self.waiting[0].ready <= self.clock
        ):
            if len(self.running) >= cfg.max_num_seqs:
                break
            r = self.waiting[0]
            self._admit_hit(r)
            n = min(r.pending, budget)
            if not self._grow(r, r.computed + n):
                if not self.running and not chosen:
                    raise UserError(
                        f"request {r.id}: a chunk of {n} tokens finds no KV block free; a "
                        f"replica has {cfg.blocks}"
                    )
                break
            self.waiting.popleft()
            self.running.append(r)
            chosen.append((r, n))
            budget -= n
        return chosen

    def _schedule_static(self) -> list[tuple[Request, int]]:
        cfg = self.config
        if not self.static_batch:
            while (
                self.waiting
                and self.waiting[0].ready <= self.clock
                and len(self.static_batch) < cfg.max_num_seqs
            ):
                r = self.waiting[0]
                self._admit_hit(r)
                if not self._grow(r, r.prompt + r.output):
                    if not self.static_batch:
                        raise UserError(
                            f"request {r.id}: {r.prompt + r.output} tokens do not fit the "
                            f"{cfg.blocks} KV blocks of a replica"
                        )
                    break
                self.waiting.popleft()
                self.static_batch.append(r)
                self.running.append(r)
            return [(r, r.pending) for r in self.static_batch]
        # the whole batch decodes until its longest request is done
        return [(r, 1) for r in self.static_batch]

    def step(self) -> None:
        """Run one iteration from the clock (the replica has work)."""
        self.swap_s = 0.0
        self.preempted_now = False
        previous, self.late = self.late, []
        chosen = self._schedule()
        trace = self.trace
        if not chosen:
            raise UserError(
                f"replica {self.index} can schedule none of its {len(self.waiting)} waiting "
                f"requests with {self.free} of {self.config.blocks} KV blocks free"
            )
        if self.steps > 1 and all(n == 1 and r.generated > 0 for r, n in chosen):
            self._deliver(previous, self._round([r for r, _ in chosen]))
            return
        k = self.lookahead
        prefills = []
        decodes = []
        verified = []
        for r, n in chosen:
            if n == 1 and r.computed > 0 and 0 < r.generated < r.output and k:
                verified.append(r)
            elif n == 1 and r.computed > 0:
                decodes.append(r.computed + 1)
            else:
                prefills.append((n, r.computed + n))
        batch = Batch(
            tuple(prefills),
            tuple(decodes),
            tuple(r.computed + 1 + k for r in verified),
            k + 1 if verified else 0,
        )
        seconds = self.pricer.price(batch) + self.config.iteration_overhead_s + self.swap_s
        if self.draft is not None:
            seconds += self._draft_time(prefills, [r.computed for r in verified])
        start = self.clock
        end = start + seconds
        present = (
            len(self.waiting)
            + len(self.swapped)
            + sum(1 for r in self.running if r.generated < r.output)
        )
        trace.area += present * seconds
        trace.iterations += 1
        finished = []
        checked = {id(r) for r in verified}
        for r, n in chosen:
            if id(r) in checked:
                self._accept(r, end)
                if r.generated >= r.output:
                    finished.append(r)
                continue
            r.computed += n
            if self.config.scheduler == "static" and r.generated >= r.output:
                continue  # a finished member of a static batch: padding
            if r.computed == r.known:
                self._emit(r, end)
                if r.generated >= r.output:
                    finished.append(r)
                elif self.role == "prefill":
                    self.running.remove(r)
                    self._release(r)
                    self.handoffs.append((end, r))
        for r in finished:
            self._finish(r, end)
            if self.config.scheduler != "static" or self.role != "both":
                self.running.remove(r)
                self._release(r)
        if self.config.scheduler == "static" and all(
            r.generated >= r.output for r in self.static_batch
        ):
            for r in self.static_batch:
                self._release(r)
            self.running = []
            self.static_batch = []
        self.clock = end
        self._deliver(previous, end)
        self._sample()

    def _round(self, seqs: list[Request]) -> float:
        """A multi-step round (vLLM's ``--num-scheduler-steps``): one scheduler call, then
        ``steps`` decode steps of the same sequences, their blocks allocated up front (the
        lookahead slots); a sequence that reaches its last token mid-round still runs every
        step (its extra tokens are dropped). New requests wait for the round's end. Tokens are
        streamed per step, or all at the round's end (``stream_round_end``). Returns the end
        of its first step."""
        pricer = self.pricer
        d = len(seqs)
        total = sum(r.computed for r in seqs)
        positions = len({r.computed for r in seqs}) if pricer.uses_positions else 0
        start = self.clock
        ends = []
        t = start + self.config.iteration_overhead_s + self.swap_s
        for i in range(self.steps):
            t += pricer.decode_time(d, -(-(total + d * (i + 1)) // d), positions)
            ends.append(t)
        end = ends[-1]
        present = (
            len(self.waiting)
            + len(self.swapped)
            + sum(1 for r in self.running if r.generated < r.output)
        )
        self.trace.iterations += self.steps
        finished = []
        for r in seqs:
            emitted = min(self.steps, r.output - r.generated)
            r.computed += self.steps
            for i in range(emitted):
                self._emit(r, end if self.config.stream_round_end else ends[i])
            if r.generated >= r.output:  # it leaves with its last token
                self._finish(r, r.last_emit)
                finished.append(r)
        self.trace.area += (present - len(finished)) * (end - start) + sum(
            r.finish - start for r in finished
        )
        for r in finished:
            self.running.remove(r)
            self._release(r)
        self.clock = end
        self._sample()
        return ends[0]

    def _finish(self, r: Request, t: float) -> None:
        r.finish = t
        if self.config.output_lag:
            self.late.append((r, True))

    def _deliver(self, previous: list[tuple[Request, bool]], t: float) -> None:
        """The first tokens and finishes of the previous iteration reach the client at ``t``
        (overlap scheduling); a finish moved later keeps its request in the system."""
        for r, finish in previous:
            if finish:
                self.trace.area += t - r.finish
                r.finish = t
            else:
                r.first_token = t

    def _draft_time(self, prefills: list[tuple[int, int]], contexts: list[int]) -> float:
        """The draft model's share of an iteration: it prefills the same prompt chunks and
        proposes ``k`` tokens for each verified sequence, one decode step per token."""
        assert self.draft is not None
        seconds = self.draft.price(Batch(tuple(prefills), ()))
        if contexts:
            d = len(contexts)
            total = sum(contexts)
            for i in range(1, self.lookahead + 1):
                seconds += self.draft.decode_time(d, -(-(total + d * i) // d))
        return seconds

    def _accept(self, r: Request, t: float) -> None:
        """A verified sequence: the draft tokens accepted up to the first rejection, then one
        token sampled by the target model (Leviathan et al., ICML 2023), all streamed at
        ``t``; their KV cache is kept."""
        k = self.lookahead
        draws = self.rng.random(k)
        accepted = int(np.argmax(draws >= self.config.acceptance_rate)) if k else 0
        if k and draws[accepted] < self.config.acceptance_rate:
            accepted = k  # every draft token accepted
        emitted = min(accepted + 1, r.output - r.generated)
        for i in range(emitted):
            r.computed += 1
            if i == 0:
                self._emit(r, t)
            else:
                self.trace.itl_values.append(0.0)
                self.trace.itl_weights.append(1)
                r.generated += 1
        self.trace.accepted += accepted
        self.trace.verified += 1

    def _emit(self, r: Request, t: float) -> None:
        if r.generated == 0:
            r.first_token = t
            if self.config.output_lag:
                self.late.append((r, False))
        else:
            self.trace.itl_values.append(t - r.last_emit)
            self.trace.itl_weights.append(1)
        r.generated += 1
        r.last_emit = t

    def _sample(self) -> None:
        if self.clock >= self.next_sample:
            self.trace.samples.append(
                (
                    self.clock,
                    self.index,
                    self.config.blocks - self.free,
                    len(self.running),
                    len(self.waiting),
                    self.preemptions,
                )
            )
            interval = self.config.sample_interval_s
            self.next_sample = (math.floor(self.clock / interval) + 1) * interval

    # -- stretches of pure decoding ----------------------------------------------------------

    def _decode_stretch(self, until: float) -> bool:
        """Run the steps of a pure-decode stretch that start before ``until``; False when the
        replica is not in one."""
        if self.waiting or self.swapped or not self.running or self.role == "prefill":
            return False
        if self.lookahead or self.steps > 1:
            return False
        if self.config.scheduler == "static" and self.role == "both":
            return False
        running = self.running
        chunked = self.config.scheduler == "sarathi" or self.role == "decode"
        if chunked and len(running) > self.config.max_num_batched_tokens:
            return False
        for r in running:
            if r.pending != 1:
                return False
        d = len(running)
        steps = min(r.output - r.generated for r in running)
        bs = self.config.block_size
        # the steps whose new blocks the free blocks cover
        contexts = [r.computed for r in running]

        def blocks_needed(k: int) -> int:
            return sum(-(-(c + k) // bs) for c in contexts) - sum(r.blocks for r in running)

        if blocks_needed(steps) > self.free:
            low, high = 0, steps
            while low < high:
                mid = (low + high + 1) // 2
                if blocks_needed(mid) <= self.free:
                    low = mid
                else:
                    high = mid - 1
            steps = low
        if steps < 2:
            return False
        total = sum(contexts)
        pricer = self.pricer
        overhead = self.config.iteration_overhead_s
        # every context advances by one per step: the distinct positions stay as many
        positions = len(set(contexts)) if pricer.uses_positions else 0
        base = pricer.body_time(d, positions) + pricer.head_time(d) + overhead
        clock = self.clock
        values = self.trace.itl_values
        weights = self.trace.itl_weights
        done = 0
        first_gap: list[float] = []
        first_end = clock
        while done < steps and clock < until:
            mean = -(-(total + d * (done + 1)) // d)
            seconds = base + pricer.attention_time(d, 1, mean)
            clock += seconds
            if done == 0:
                first_end = clock
                first_gap = [clock - r.last_emit for r in running]
            else:
                values.append(seconds)
                weights.append(d)
            done += 1
        if done == 0:
            return False
        previous, self.late = self.late, []
        for gap in first_gap:
            if not math.isnan(gap):
                values.append(gap)
                weights.append(1)
        self.trace.area += (len(running)) * (clock - self.clock)
        self.trace.iterations += done
        finished = []
        for r in running:
            r.computed += done
            if r.generated == 0:  # the last token of a chunked prompt
                r.first_token = first_end
                if self.config.output_lag:
                    self.late.append((r, False))
            r.generated += done
            r.last_emit = clock
            self._grow(r, r.computed)
            if r.generated >= r.output:
                finished.append(r)
        for r in finished:
            self._finish(r, clock)
            running.remove(r)
            self._release(r)
        self.clock = clock
        self._deliver(previous, first_end)
        self._sample()
        return True

    def advance(self, until: float) -> None:
        """Run the iterations that start before ``until``."""
        while self.has_work() and self.clock < until:
            if not self._decode_stretch(until):
                self.step()
        if not self.has_work():
            self.late = []  # no next iteration: the outputs go out at once


@dataclass
class Simulation:
    """A finished simulation: the requests, the trace and the configuration."""

    requests: list[Request]
    trace: Trace
    config: EngineConfig
    end_s: float


def simulate(
    stream: Stream,
    pricer: IterationPricer,
    config: EngineConfig,
    progress: Callable[[str, int, int], None] | None = None,
    transfer_time: Callable[[int], float] | None = None,
    draft: IterationPricer | None = None,
) -> Simulation:
    """Serve ``stream`` (see the module docstring). With ``config.prefill_replicas``, a
    request is prefilled on a prefill replica, which returns its first token, and its KV
    cache of ``tokens`` tokens reaches a decode replica after ``transfer_time(tokens)``."""
    config.check()
    disaggregated = config.prefill_replicas > 0
    if config.speculative_tokens and draft is None:
        raise UserError("--speculative needs a draft model (--draft)")
    if disaggregated and transfer_time is None:
        raise UserError("disaggregated serving needs the KV transfer's time")
    if len(stream):
        longest = int((stream.prompt + stream.output).max())
        need = -(-(longest + config.speculative_tokens) // config.block_size)
        if need > config.blocks:
            raise UserError(
                f"a request of {longest} tokens (prompt and output) needs {need} KV blocks; a "
                f"replica has {config.blocks} (more --gpu-memory-utilization, a larger --tp or "
                "shorter requests)"
            )
    trace = Trace()
    front_role = "prefill" if disaggregated else "both"
    front_count = config.prefill_replicas if disaggregated else config.replicas
    draft = draft if config.speculative_tokens else None
    front = [Replica(i, config, pricer, trace, front_role, draft) for i in range(front_count)]
    back = (
        [
            Replica(front_count + i, config, pricer, trace, "decode", draft)
            for i in range(config.replicas)
        ]
        if disaggregated
        else []
    )
    requests = []
    rate = config.tokenize_rate
    for i, (t, p, o) in enumerate(
        zip(stream.arrival.tolist(), stream.prompt.tolist(), stream.output.tolist(), strict=True)
    ):
        tokenize = p / rate if math.isfinite(rate) else 0.0
        requests.append(Request(i, t, int(p), int(o), t + tokenize))
        trace.area += tokenize
    # events: (time, order, request, pool); pool 0 the front (all requests), 1 the decoders
    events: list[tuple[float, int, int, int]] = [(r.ready, r.id, r.id, 0) for r in requests]
    heapq.heapify(events)
    order = len(requests)
    routed = [0, 0]
    total = len(requests)

    def collect(until: float) -> None:
        """Bring the prefill replicas to ``until`` and queue the handoffs they made."""
        nonlocal order
        for replica in front:
            if replica.has_work():
                replica.advance(until)
            for end, r in replica.handoffs:
                assert transfer_time is not None
                seconds = transfer_time(r.computed)
                trace.area += seconds
                r.ready = end + seconds
                heapq.heappush(events, (r.ready, order, r.id, 1))
                order += 1
            replica.handoffs.clear()

    done = 0
    while events:
        if disaggregated:
            collect(events[0][0])
        t, _, rid, pool = heapq.heappop(events)
        r = requests[rid]
        replicas = front if pool == 0 else back
        n = routed[pool]
        routed[pool] += 1
        # round-robin needs no replica's state: only the target is brought to the arrival
        near = [replicas[n % len(replicas)]] if config.routing == "round-robin" else replicas
        for replica in near:
            if replica.has_work():
                replica.advance(t)
            else:
                replica.clock = max(replica.clock, t)
        target = _route(replicas, config.routing, n)
        if pool == 0:
            r.replica = target.index
        # it waits from its arrival to the end of the iteration in flight, if any
        trace.area += max(0.0, target.clock - t)
        target.clock = max(target.clock, t)
        target.waiting.append(r)
        if pool == 0:
            done += 1
            if progress is not None and done % 1024 == 0:
                progress("requests", done, total)
        if not events:
            for replica in front:
                replica.advance(math.inf)
            if disaggregated:
                collect(math.inf)
    for replica in back:
        replica.advance(math.inf)
    if progress is not None:
        progress("requests", total, total)
    end = max((r.finish for r in requests), default=0.0)
    return Simulation(requests, trace, config, end)


def _route(replicas: list[Replica], routing: str, n: int) -> Replica:
    if routing == "round-robin":
        return replicas[n % len(replicas)]
    if routing == "least-outstanding":
        return min(replicas, key=lambda r: (r.outstanding(), r.index))
    return min(replicas, key=lambda r: (r.kv_load(), r.index))


# ---------------------------------------------------------------------------------------------
# Results


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _weighted_percentiles(values: array, weights: array) -> dict[str, float]:
    if not values:
        return _percentiles(np.array([]))
    v = np.frombuffer(values, dtype=np.float64)
    w = np.frombuffer(weights, dtype=np.int64).astype(np.float64)
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    cumulative = np.cumsum(w)
    out = {"mean": float((v * w).sum() / cumulative[-1])}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        out[name] = float(v[np.searchsorted(cumulative, q * cumulative[-1])])
    return out


def request_table(sim: Simulation) -> dict[str, np.ndarray]:
    """One row per request: lengths, replica, times and latencies (seconds)."""
    rs = sim.requests
    arrival = np.array([r.arrival for r in rs])
    first = np.array([r.first_token for r in rs])
    finish = np.array([r.finish for r in rs])
    output = np.array([r.output for r in rs], dtype=np.int64)
    decode = finish - first
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(output > 1, decode / np.maximum(output - 1, 1), np.nan)
    return {
        "id": np.array([r.id for r in rs], dtype=np.int64),
        "replica": np.array([r.replica for r in rs], dtype=np.int64),
        "arrival_s": arrival,
        "prompt_tokens": np.array([r.prompt for r in rs], dtype=np.int64),
        "output_tokens": output,
        "cached_tokens": np.array([r.hit for r in rs], dtype=np.int64),
        "first_token_s": first,
        "finish_s": finish,
        "ttft_s": first - arrival,
        "tpot_s": tpot,
        "e2e_s": finish - arrival,
        "preemptions": np.array([r.preemptions for r in rs], dtype=np.int64),
    }


def summary(
    sim: Simulation, *, slo_ttft: float | None = None, slo_tpot: float | None = None
) -> dict[str, Any]:
    """Latency percentiles, throughput, goodput under the SLOs, KV occupancy, preemptions and
    Little's law (the time-average requests in the system from the replicas' queues against
    the arrival rate times the mean time in the system)."""
    table = request_table(sim)
    n = len(sim.requests)
    end = sim.end_s
    first_arrival = float(table["arrival_s"][0]) if n else 0.0
    span = end - first_arrival if end > first_arrival else math.nan
    e2e = table["e2e_s"]
    ok = np.ones(n, dtype=bool)
    if slo_ttft is not None:
        ok &= table["ttft_s"] <= slo_ttft
    if slo_tpot is not None:
        ok &= np.nan_to_num(table["tpot_s"], nan=0.0) <= slo_tpot
    samples = np.array(sim.trace.samples, dtype=np.float64).reshape(-1, 6)
    occupancy = samples[:, 2] / sim.config.blocks if len(samples) else np.zeros(0)
    mean_in_system = sim.trace.area / span if span == span else math.nan
    arrival_rate = n / span if span == span else math.nan
    return {
        "requests": n,
        "replicas": sim.config.replicas,
        "scheduler": sim.config.scheduler,
        "routing": sim.config.routing,
        "kv_blocks_per_replica": sim.config.blocks,
        "block_size": sim.config.block_size,
        "simulated_s": span,
        "iterations": sim.trace.iterations,
        "ttft_s": _percentiles(table["ttft_s"]),
        "tpot_s": _percentiles(table["tpot_s"][~np.isnan(table["tpot_s"])]),
        "itl_s": _weighted_percentiles(sim.trace.itl_values, sim.trace.itl_weights),
        "e2e_s": _percentiles(e2e),
        "throughput": {
            "requests_per_s": n / span if span == span else math.nan,
            "output_tokens_per_s": float(table["output_tokens"].sum()) / span,
            "prompt_tokens_per_s": float(table["prompt_tokens"].sum()) / span,
        },
        "goodput": {
            "slo_ttft_s": slo_ttft,
            "slo_tpot_s": slo_tpot,
            "fraction": float(ok.mean()) if n else math.nan,
            "requests_per_s": float(ok.sum()) / span,
        },
        "kv_occupancy": {
            "mean": float(occupancy.mean()) if len(occupancy) else 0.0,
            "max": float(occupancy.max()) if len(occupancy) else 0.0,
        },
        "preemptions": int(table["preemptions"].sum()),
        "preemption": sim.config.preemption,
        "swapped_blocks": sim.trace.swapped_blocks,
        "swap_s": sim.trace.swap_s,
        "speculative": {
            "draft_tokens": sim.config.speculative_tokens,
            "acceptance_rate": sim.config.acceptance_rate,
            "verifications": sim.trace.verified,
            "accepted_per_verification": (
                sim.trace.accepted / sim.trace.verified if sim.trace.verified else None
            ),
        },
        "littles_law": {
            "mean_in_system": mean_in_system,
            "arrival_rate_per_s": arrival_rate,
            "mean_time_in_system_s": float(e2e.mean()) if n else math.nan,
            "rate_times_time": arrival_rate * float(e2e.mean()) if n else math.nan,
        },
    }


def timeline(sim: Simulation) -> dict[str, np.ndarray]:
    """KV occupancy, queues and preemptions sampled over time, per replica."""
    samples = np.array(sim.trace.samples, dtype=np.float64).reshape(-1, 6)
    return {
        "time_s": samples[:, 0],
        "replica": samples[:, 1].astype(np.int64),
        "kv_blocks_used": samples[:, 2].astype(np.int64),
        "kv_occupancy": samples[:, 2] / sim.config.blocks,
        "running": samples[:, 3].astype(np.int64),
        "waiting": samples[:, 4].astype(np.int64),
        "preemptions": samples[:, 5].astype(np.int64),
    }


__all__ = [
    "ROUTINGS",
    "SCHEDULERS",
    "EngineConfig",
    "Request",
    "Simulation",
    "request_table",
    "simulate",
    "summary",
    "timeline",
]
