"""The tensor-split ILP on the real graph: per-unit costs of one micro-batch at one tp degree.

``SplitPricer(gm, world).price(tp, tp_group, micro_batch, seq)`` returns a ``TensorSplit`` (see
``unit_costs``): it solves one problem holding a representative of each distinct block kind (its
costs counted once per block of that kind) and every op outside blocks, then prices every unit of
the condensed block graph with the strategies chosen, stamping each representative's numbers and
placements onto the other blocks of its kind (``plan_splits_graph``). How to read the collectives
it lists is in ``plan_splits_result``.

The problem is Alpa's intra-operator ILP (Zheng et al. 2022, sec. 4.2), solved by ``solve_splits``:
candidate strategies per node from ``sharding_rules``; node cost = roofline of the local share
(``plan_splits_costs``); edge cost = the forward reshard of the producer's output into the consumer's
input plus the backward reshard of the gradient (``plan_splits_problem``), each collective priced on
the tp group by ``cost_collectives``. Tensors entering or leaving a block are Replicate on tp
(Megatron-LM without sequence parallelism, Shoeybi et al. 2019), so block solutions compose; with
sequence parallelism the residual stream crosses split along the sequence (``TpProblem.boundary``). The
loss must be Replicate; other outputs (the logits Hugging Face models return) are exempt: the
compiled step returns only the loss.

Exact ties go to the option listed first (replicate) and to fewer collectives: every non-first
option and every collective carries a penalty of 1e-6 of the largest cost, far below any real
difference, so CBC's choice, and the plan, are the same on every run.

Speed: candidate strategies and the problem's structure are built once per tp; sizes are sympy
expressions lambdified once (``ExprTable``); collective prices are memoised per size; solutions are
cached per (tp, tp_group, micro_batch, seq, memory limit). ``price`` may be called from several threads
(the degree search prices two splits at once): the pricer's shared tables are touched under one lock,
released while CBC solves in its child process, so one split is built while another solves.
"""
from __future__ import annotations

import threading

from xirang.ir.device import canonical_dtype, device_spec
from xirang.ir.meta_keys import PARAM_COUNT, ROLE
from xirang.ir.placement import PlanReplicate
from xirang.ir.world import World
from xirang.passes.planning.unit_costs import TensorSplit

from xirang.passes.planning.cost_collectives import group_topology
from xirang.passes.planning.cost_model import Efficiency
from xirang.passes.planning.plan_splits_costs import FLOAT_BYTES, NodeFacts, Pricing, node_facts
from xirang.passes.planning.plan_splits_graph import ExprTable, SplitGraph, tensor_info
from xirang.passes.planning.plan_splits_problem import TpProblem
from xirang.passes.planning.plan_splits_result import Assembly
from xirang.passes.planning.sharding_rules import ops_without_sharding_rule
from xirang.passes.planning.sharding_rules_views import remembering
from xirang.passes.planning.solve_splits import SplitEdge, SplitNode, SplitProblem, Strategy, solve_splits
from xirang.ir.errors import InvalidValue

TIE_BREAK = 1e-6  # penalty per non-first option and per collective, relative to the largest cost


class SplitPricer:
    """Prices units of an analysed graph at any (tp, tp group, micro-batch, seq); see the module doc.

    ``device``: a DeviceSpec or preset name; default: the device of the tp group's first rank.
    ``precision``: the dtype activations, gradients and parameters are held and computed in.
    ``efficiency``: default, the priced device's own (``DeviceSpec.efficiency``, per generation).
    ``run_dtypes``: the graph's dtypes at run time in ``precision`` (``saved_storages.RunDtypes``, the
    lowering's: passes/lowering/compute_dtypes.py): saved activations are priced at these (plan_splits_costs);
    without them every floating one at ``precision``.
    """

    def __init__(self, gm, world: World, *, device=None, efficiency: Efficiency | None = None,
                 precision: str = "bf16", run_dtypes=None):
        if not isinstance(world, World):
            raise InvalidValue(f"SplitPricer needs a World (xirang.ir.world), got {world!r}")
        self.precision = canonical_dtype(precision)
        if self.precision not in FLOAT_BYTES:
            raise InvalidValue(f"unknown precision {precision!r}; known: {', '.join(FLOAT_BYTES)}")
        self.world, self.efficiency = world, efficiency
        self.device = device_spec(device) if device is not None else None
        self.graph = SplitGraph(gm)
        self.table = ExprTable(self.graph.symbol_names)
        self.float_bytes = FLOAT_BYTES[self.precision]
        self.run_dtypes = run_dtypes
        self.flops = self.graph.unit_flops(self.table)
        # (node, element count, bytes per element, whole): a tensor read in another place is whole there
        self.crossing = [(node, *self._tensor(node), self.graph.leaves_place(node), first, last)
                         for node, first, last in self.graph.crossing]
        self.entering = {unit: [(node, *self._tensor(node), self.graph.leaves_place(node)) for node in nodes]
                         for unit, nodes in self.graph.entering.items()}
        missing = {name for names in ops_without_sharding_rule(gm).values() for name in names}
        self.fallbacks = tuple(n.name for n in self.graph.nodes if n.name in missing)
        self.notes = self._notes()
        # model buffers (rotary tables, masks), by the unit of their first reader
        self.buffer_sizes = [(self.graph.unit_of.get(n), self.table.index(tensor_info(n).nbytes))
                             for n in self.graph.nodes
                             if n.op in ("placeholder", "get_attr") and ROLE.get(n, None) in ("buffer", "constant")
                             and tensor_info(n) is not None]
        # parameters several groups read stay whole on every rank (a weight shared across blocks)
        self.shared_param_bytes = float(sum(
            PARAM_COUNT.get(n, 0) * self.float_bytes for n in self.graph.nodes
            if n.op == "placeholder" and self.graph.owner.get(n) is None and ROLE.get(n, None) == "parameter"))
        self._problems: dict[int, TpProblem] = {}
        self._rules_memo: dict = {}  # sharding_rules' walks and rows of this graph, shared by the problems
        self._facts: dict = {}
        self._solutions: dict[tuple, TensorSplit] = {}
        self._choices: dict[tuple, dict] = {}  # the same key -> option index per decision
        self._lock = threading.RLock()  # the tables above and ExprTable grow as problems are built

    def _tensor(self, node) -> tuple[int, float]:
        info = tensor_info(node)
        run = self.run_dtypes.of.get(node.name) if self.run_dtypes is not None and info.is_floating else None
        if run is not None:  # an fp32 island of a half-precision program (a rotary table) is sent and kept in fp32
            return self.table.index(info.numel), float(run.itemsize)
        return self.table.index(info.numel), float(self.float_bytes if info.is_floating else info.itemsize)

    def _notes(self) -> tuple[str, ...]:
        graph = self.graph
        if graph.loss is None:
            return ("no scalar loss among the outputs: every output is kept Replicate on tp",)
        if graph.exempt_outputs:
            names = ", ".join(v.name for v in graph.exempt_outputs)
            return (f"the compiled step returns only the loss ({graph.loss.name}); the other outputs "
                    f"({names}) are left in the layout the split chose, not gathered",)
        return ()

    def problem(self, tp: int, sequence_parallel: bool = False) -> TpProblem:
        """Candidate strategies and links of one tp, built once (strategies_for can be slow)."""
        with self._lock:
            return self._problem(tp, sequence_parallel)

    def _problem(self, tp: int, sequence_parallel: bool = False) -> TpProblem:
        key = (tp, sequence_parallel)
        if key not in self._problems:
            with remembering(self._rules_memo):  # each tp and layout asks the same rules of the same graph
                problem = TpProblem(self.graph, self.table, tp, self.float_bytes, sequence_parallel=sequence_parallel)
            seq_known = "seq" in self.graph.symbol_names
            for decision in problem.decisions:
                if decision.node is not None and decision.node not in self._facts:
                    self._facts[decision.node] = node_facts(decision.node, self.table, self.float_bytes, seq_known,
                                                          self.run_dtypes)
            self._problems[key] = problem
        return self._problems[key]

    def price(self, tp: int, tp_group: tuple[int, ...], micro_batch: int, seq: int,
              memory_limit_bytes: float | None = None, *, sequence_parallel: bool = False) -> TensorSplit:
        """Costs of every unit for one micro-batch of ``micro_batch`` sequences of ``seq`` tokens on a tp
        group of ``tp`` ranks (``tp_group``: their global ranks in the World).

        ``sequence_parallel``: the residual stream may also be split along the sequence
        (sharding_rules_sequence); the ILP then picks, op by op, whichever layout costs less.

        ``memory_limit_bytes`` bounds the parameter bytes (in ``precision``) one tp rank holds for the
        whole model; a ValueError gives the minimum when no choice of strategies fits it.
        """
        for name, value in (("tp", tp), ("micro_batch", micro_batch), ("seq", seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidValue(f"price: {name} must be a positive int, got {value!r}")
        tp_group = tuple(tp_group)
        if len(tp_group) != tp:
            raise InvalidValue(f"price: tp_group {tp_group} must list the {tp} global ranks of one tp group")
        group_topology(tp_group, self.world)  # checks the ranks exist and are distinct
        if memory_limit_bytes is not None and (isinstance(memory_limit_bytes, bool) or not isinstance(
                memory_limit_bytes, (int, float)) or not memory_limit_bytes >= 0):
            raise InvalidValue(f"price: memory_limit_bytes must be a number of bytes >= 0 or None, "
                             f"got {memory_limit_bytes!r}")
        if not isinstance(sequence_parallel, bool):
            raise InvalidValue(f"price: sequence_parallel must be True or False, got {sequence_parallel!r}")
        key = (tp, tp_group, micro_batch, seq, memory_limit_bytes, sequence_parallel)
        if key not in self._solutions:
            self._solutions[key] = self._price(tp, tp_group, micro_batch, seq, memory_limit_bytes, sequence_parallel)
        return self._solutions[key]

    def _price(self, tp, tp_group, micro_batch, seq, memory_limit, sequence_parallel=False) -> TensorSplit:
        with self._lock:
            problem = self.problem(tp, sequence_parallel)
            point = tuple({"batch": micro_batch, "seq": seq}[name] for name in self.graph.symbol_names)
            device = self.device or self.world.device_of(tp_group[0])
            pricing = Pricing(self.table.values(point), tp, tp_group, self.world, device, self.precision,
                              self.efficiency or device.efficiency, self.table)
            split_problem = self._split_problem(problem, pricing, memory_limit)
        solution = solve_splits(split_problem)  # unlocked: CBC runs in its own process
        with self._lock:
            self._choices[(tp, tp_group, micro_batch, seq, memory_limit, sequence_parallel)] = solution.choice
            for (rows, cols), link in problem.links.items():
                if link.terms[solution.choice[rows]][solution.choice[cols]] is None:
                    raise InvalidValue(f"tp={problem.tp}: the only strategies within memory_limit_bytes need a "
                                       f"reshard between {rows} and {cols} that is not supported (Partial of "
                                       f"another reduction); raise the limit or the tp degree")
            assembly = Assembly(self.graph, problem, solution.choice, pricing, self._facts)
            sums, collectives = assembly.sums()
            crossing, entering = self._crossing_layouts(problem)
            units = assembly.units(sums, crossing, entering, self.flops, self.buffer_sizes)
            return TensorSplit(tp, micro_batch, seq, units, assembly.placements(), tuple(collectives),
                               self.fallbacks, self.notes, assembly.crossing_tensors(crossing))

    def _crossing_layouts(self, problem: TpProblem) -> tuple[list, dict]:
        """``crossing`` and ``entering`` with "whole" cleared for tensors whose boundary is not Replicate:
        those are sent and kept in their producer's own layout, as the lowering runs them."""
        if not problem.sequence_parallel:
            return self.crossing, self.entering
        def whole(node, flag: bool) -> bool:
            return flag and problem.boundary(node) == PlanReplicate()
        crossing = [(node, count, size, whole(node, flag), first, last)
                    for node, count, size, flag, first, last in self.crossing]
        entering = {unit: [(node, count, size, whole(node, flag)) for node, count, size, flag in tensors]
                    for unit, tensors in self.entering.items()}
        return crossing, entering

    def tp_bytes_per_micro_batch(self, tp: int, tp_group: tuple[int, ...], micro_batch: int, seq: int, *,
                                 run_micro_batch: int, run_seq: int, sequence_parallel: bool = False) -> dict:
        """Kind -> bytes (one rank's full buffer, summed over every block) of the tp collectives one
        micro-batch's forward and backward run, with the layouts ``price`` chose at (micro_batch, seq)
        and the sizes of (run_micro_batch, run_seq): what a plan made at realistic sizes moves when
        it runs small. Call ``price`` with the same arguments first."""
        key = (tp, tuple(tp_group), micro_batch, seq, None, sequence_parallel)
        with self._lock:
            if key not in self._choices:
                raise InvalidValue(f"tp_bytes_per_micro_batch: no split priced at {key}; call price first")
            choice, problem = self._choices[key], self.problem(tp, sequence_parallel)
            point = tuple({"batch": run_micro_batch, "seq": run_seq}[name] for name in self.graph.symbol_names)
            device = self.device or self.world.device_of(tp_group[0])
            pricing = Pricing(self.table.values(point), tp, tuple(tp_group), self.world, device, self.precision,
                              self.efficiency or device.efficiency, self.table)
            found: dict[str, float] = {}
            for decision in problem.decisions:
                for kind, cost in pricing.op_collectives(decision.options[choice[decision.name]]):
                    found[kind] = found.get(kind, 0.0) + decision.group.weight * cost.nbytes
            for (rows, cols), link in problem.links.items():
                for term in link.terms[choice[rows]][choice[cols]]:
                    cost = pricing.term(term)
                    if cost.algorithm != "none":
                        found[term.kind] = found.get(term.kind, 0.0) + link.rows.group.weight * cost.nbytes
            return found

    def _split_problem(self, problem: TpProblem, pricing: Pricing, memory_limit) -> SplitProblem:
        """The ILP at these numbers (its solution: strategy index per decision)."""
        options = {}
        for decision in problem.decisions:
            facts: NodeFacts | None = self._facts.get(decision.node) if decision.node is not None else None
            weight = decision.group.weight
            options[decision.name] = [tuple(weight * x for x in pricing.option(decision, facts, i))
                                      for i in range(len(decision.options))]
        entries = {key: [[None if terms is None else (link.rows.group.weight * pricing.entry(terms), len(terms))
                          for terms in row] for row in link.terms] for key, link in problem.links.items()}
        finite = [c for row in entries.values() for cells in row for c in cells if c is not None]
        peak = max([s for opts in options.values() for s, _ in opts] + [s for s, _ in finite] + [0.0])
        epsilon = TIE_BREAK * peak or 1e-12
        # any assignment using an unsupported reshard costs more than every one that does not
        big = 1.0 + sum(max(s for s, _ in opts) for opts in options.values()) + \
            sum(max((c[0] for cells in row for c in cells if c is not None), default=0.0) for row in entries.values())
        if memory_limit is not None:
            need = self.shared_param_bytes + sum(min(m for _, m in opts) for opts in options.values())
            if need > memory_limit:
                raise InvalidValue(
                    f"tp={problem.tp}: the parameters need at least {need:.6g} bytes per tp rank in "
                    f"{self.precision} (each weight sharded as far as the sharding rules allow), more than "
                    f"memory_limit_bytes={memory_limit:.6g}. Raise the limit, use a larger tp, or more stages.")
        nodes = [SplitNode(name, tuple(Strategy(i, compute=s + (epsilon if i else 0.0), memory=m)
                                       for i, (s, m) in enumerate(opts))) for name, opts in options.items()]
        edges = [SplitEdge(rows, cols, tuple(tuple(big if c is None else c[0] + epsilon * c[1] for c in cells)
                                             for cells in row)) for (rows, cols), row in entries.items()]
        budget = None if memory_limit is None else memory_limit - self.shared_param_bytes
        return SplitProblem(tuple(nodes), tuple(edges), budget)


def price_units(gm, world: World, *, tp: int, tp_group: tuple[int, ...], micro_batch: int, seq: int,
                memory_limit_bytes: float | None = None, device=None, efficiency: Efficiency | None = None,
                precision: str = "bf16") -> TensorSplit:
    """One-off ``SplitPricer(gm, world, ...).price(...)``; keep a SplitPricer to price many points."""
    pricer = SplitPricer(gm, world, device=device, efficiency=efficiency, precision=precision)
    return pricer.price(tp, tp_group, micro_batch, seq, memory_limit_bytes)
