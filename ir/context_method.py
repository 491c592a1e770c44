"""How attention runs across a context-parallel group: the method's names, its all-to-all × ring split, its ranks.

A cp group of cp ranks runs each attention as an all-to-all over heads inside groups of ``a2a`` ranks and a
ring over the cp / a2a such groups (USP: Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach for
Long Context Generative AI"; the two pure methods are its corners). One name per split:

    "ring"        a2a = 1    key/value blocks passed around all cp ranks (Liu et al. 2023)
    "all_to_all"  a2a = cp   sequence swapped for heads over all cp ranks (DeepSpeed-Ulysses)
    "usp:A"       a2a = A    1 < A < cp, A divides cp: all-to-all over A ranks, then a ring over cp / A

The all-to-all needs A to divide the query heads (per tp rank); the ring takes any head count, and its bytes
per rank do not shrink with its degree, the all-to-all's do: USP trades one against the other where the
heads are too few for a whole all-to-all.

Ranks. Inside a cp group (members in cp order) the all-to-all groups are runs of A consecutive members and
the ring groups every A-th member: member g·A + j is rank j of all-to-all group g and rank g of ring group
j. The all-to-all, which moves the most bytes and waits on them, takes the closer ranks (the innermost after
tp), as USP puts Ulysses inside a node and the ring across nodes (yunchang's ``set_seq_parallel_pg`` with
its default ``use_ulysses_low``). With the load-balanced layout (2·cp chunks, rank r holding r and
2·cp−1−r) all-to-all group g then holds, after its exchange, chunks gA..gA+A−1 and their mirror: the
layout at degree cp / A with chunks A times longer, which is what the ring over the groups takes.

A plan records its method as one collective choice on axis cp: at node ``context:attention`` with kind
"send" (ring) or "all_to_all" (all-to-all), and a USP split at node ``context:attention:usp:A`` (kind
"all_to_all"), so plans keep their schema.
"""
from __future__ import annotations

from xirang.ir.errors import InvalidValue
from xirang.ir.plan_parts import CollectiveChoice

METHOD_NODE = "context:attention"  # the plan's collective choice naming the cp attention's method
RING, ALL_TO_ALL, USP = "ring", "all_to_all", "usp"
_KINDS = {RING: ("send", "direct"), ALL_TO_ALL: ("all_to_all", "pairwise")}
SPELLINGS = "'ring', 'all_to_all' or 'usp:A' (all-to-all over A ranks x ring over cp / A)"


def usp_method(a2a: int) -> str:
    """The name of USP with all-to-all degree ``a2a``."""
    return f"{USP}:{a2a}"


def usp_a2a(method: str) -> int:
    """The all-to-all degree a ``usp:A`` name gives; 0 for "ring" and "all_to_all" (their degree is cp's);
    refuses anything else, naming the spellings."""
    if method in _KINDS:
        return 0
    name, _, degree = str(method).partition(":")
    if name != USP or not degree.isdigit() or int(degree) < 2:
        raise InvalidValue(f"{method!r} is not a context-parallel attention method", where="context_method",
                           hint=f"use {SPELLINGS}, with A >= 2")
    return int(degree)


def a2a_degree(method: str, cp: int) -> int:
    """The all-to-all degree of ``method`` at ``cp`` (module docstring): 1 ring, cp all-to-all, A for usp:A,
    which must divide cp and lie strictly between 1 and cp."""
    if method == RING:
        return 1
    if method == ALL_TO_ALL:
        return cp
    a2a = usp_a2a(method)
    if cp % a2a or a2a >= cp:
        raise InvalidValue(f"{method}: an all-to-all degree of {a2a} does not split cp = {cp} into all-to-all "
                           f"groups and a ring of two or more", where="context_method",
                           hint=f"use usp:A with A a divisor of {cp} between 2 and {cp // 2}, 'ring' or 'all_to_all'")
    return a2a


def methods_at(cp: int) -> list[str]:
    """Every method a cp group of ``cp`` ranks can run, ring first: ring, all-to-all, and usp:A for each A
    dividing cp with 1 < A < cp."""
    if cp == 1:
        return [RING]
    return [RING, ALL_TO_ALL] + [usp_method(a) for a in range(2, cp) if cp % a == 0]


def method_choice(method: str) -> CollectiveChoice:
    """The collective choice that records ``method`` in a plan (module docstring)."""
    if usp_a2a(method):
        return CollectiveChoice(f"{METHOD_NODE}:{method}", "cp", "all_to_all", "pairwise", 0)
    kind, algorithm = _KINDS[method]
    return CollectiveChoice(METHOD_NODE, "cp", kind, algorithm, 0)


def is_method_choice(choice: CollectiveChoice) -> bool:
    return choice.node == METHOD_NODE or choice.node.startswith(METHOD_NODE + ":")


def recorded_method(collectives) -> str:
    """The method a plan's ``collectives`` record (the last method choice; "ring" where none)."""
    chosen = [c for c in collectives if is_method_choice(c)]
    if not chosen:
        return RING
    last = chosen[-1]
    if last.node != METHOD_NODE:
        return last.node[len(METHOD_NODE) + 1:]
    return ALL_TO_ALL if last.kind == "all_to_all" else RING


def context_subgroups(members: tuple[int, ...], a2a: int) -> tuple[tuple[tuple[int, ...], ...],
                                                                   tuple[tuple[int, ...], ...]]:
    """(all-to-all groups, ring groups) of one cp group's ``members`` (in cp order) at all-to-all degree
    ``a2a`` (module docstring): runs of ``a2a`` consecutive members, and every ``a2a``-th member."""
    if len(members) % a2a:
        raise InvalidValue(f"an all-to-all degree of {a2a} does not divide a cp group of {len(members)}",
                           where="context_subgroups", hint="pass a divisor of cp")
    a2a_groups = tuple(tuple(members[g:g + a2a]) for g in range(0, len(members), a2a))
    ring_groups = tuple(tuple(members[j::a2a]) for j in range(a2a))
    return a2a_groups, ring_groups
