"""Which engine generates which samples: pure functions, no Ray.

A group is every sample of one prompt (identical prompt token ids, wherever they sit in the call):
it goes to one engine, whose prefix cache then computes the prompt's KV once for all of them.
Groups are dealt to engines by token count (prompt plus max tokens, times samples), the longest
first onto the least-loaded engine, so no engine gets the long prompts while another idles.
"""

from __future__ import annotations

from typing import Sequence

from rlplacement.balance import largest_first


def groups_of(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Sample indices grouped by identical prompt, in order of first appearance."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for j, p in enumerate(prompts):
        by_prompt.setdefault(tuple(int(t) for t in p), []).append(j)
    return list(by_prompt.values())


def assign_groups(group_tokens: Sequence[int], num_engines: int) -> list[int]:
    """The engine of each group: longest group first onto the engine with the fewest tokens so far
    (ties: the lower engine index), so the most loaded engine carries at most the average plus one
    group (:func:`rlplacement.balance.largest_first`)."""
    return largest_first(group_tokens, num_engines)


def samples_by_engine(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], num_engines: int) -> list[list[int]]:
    """Sample indices each engine generates (in call order within an engine); every group whole on one."""
    groups = groups_of(prompts)
    tokens = [sum(len(prompts[j]) + max_tokens[j] for j in g) for g in groups]
    by_engine: list[list[int]] = [[] for _ in range(num_engines)]
    for g, e in zip(groups, assign_groups(tokens, num_engines)):
        by_engine[e].extend(g)
    return [sorted(s) for s in by_engine]
