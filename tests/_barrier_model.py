"""A model checker of the Gluon kernels' mbarrier protocols: every interleaving of the
partitions' operations, for the tests of the Gluon forward and backward."""

from __future__ import annotations


def explore(programs: list[list[tuple]], counts: dict[str, int]) -> list[str]:
    """Every interleaving of the partitions (and of the copy engine's completions): the
    states where a partition waits forever, and waits that pass on a barrier that ran a
    lap past the phase they meant (a parity wait cannot tell the two apart). ``programs``:
    each partition's operations, ("arrive" | "tma" | "wait", (barrier, slot), phase the
    wait means), "tma" an arrival that lands later (the copy engine's completion of an
    expect); ``counts``: the arrivals each barrier (by name) takes per phase."""
    barriers = sorted({op[1] for ops in programs for op in ops})
    slot = {b: i for i, b in enumerate(barriers)}

    def arrive(state, barrier):
        phases = list(state)
        phase, pending = phases[slot[barrier]]
        phases[slot[barrier]] = (phase + 1, counts[barrier[0]]) if pending == 1 else (phase, pending - 1)
        return tuple(phases)

    start = (tuple(0 for _ in programs), tuple((0, counts[b[0]]) for b in barriers), ())
    seen, todo, problems = {start}, [start], []
    while todo and not problems:
        pcs, state, landing = todo.pop()
        moves = [(pcs, arrive(state, b), landing[:i] + landing[i + 1:]) for i, b in enumerate(landing)]
        for t, ops in enumerate(programs):
            if pcs[t] == len(ops):
                continue
            kind, barrier, meant = ops[pcs[t]]
            after = pcs[:t] + (pcs[t] + 1,) + pcs[t + 1:]
            if kind == "arrive":
                moves.append((after, arrive(state, barrier), landing))
            elif kind == "tma":
                moves.append((after, state, tuple(sorted(landing + (barrier,)))))
            else:
                phase = state[slot[barrier]][0]
                if phase % 2 != meant % 2:  # the parity wait passes
                    if phase != meant + 1:
                        problems.append(f"partition {t} passed a wait for phase {meant} of {barrier} at phase {phase}")
                    moves.append((after, state, landing))
        if not moves and any(pc < len(ops) for pc, ops in zip(pcs, programs)):
            problems.append(f"partitions wait forever at {pcs} (of {[len(ops) for ops in programs]} operations)")
        for move in moves:
            if move not in seen:
                seen.add(move)
                todo.append(move)
    return problems
