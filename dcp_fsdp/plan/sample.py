"""Large worlds from a subset of the decoder layers, which are identical but for their index's
digits: built in full for the first BASE_LAYERS, then with one more layer of each digit count;
every other layer adds what its like added (docs/plan.md, "Large worlds", has the formula), and
times and memory scale by items. With model.tp or model.replicas above 1 DCP's deduplication
decides which rank writes a shared chunk from every item before it, so each rank's objects and
reads are laid out item by item over every layer instead (build.laid_out).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter
from typing import Any, Callable

from dcp_fsdp.plan.build import DataObject, GlobalPlan, build_global_plan, laid_out
from dcp_fsdp.plan.state import StateTemplate

BASE_LAYERS = 2
_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def layer_of(fqn: str) -> int | None:
    found = _LAYER.search(fqn)
    return int(found.group(1)) if found else None


def layers_of(template: StateTemplate) -> list[int]:
    return sorted({i for i in (layer_of(e.fqn) for e in template.entries) if i is not None})


def subset(template: StateTemplate, keep: set[int]) -> StateTemplate:
    """The template with only the decoder layers in `keep` (everything else whole)."""
    entries = tuple(e for e in template.entries if layer_of(e.fqn) in keep or layer_of(e.fqn) is None)
    names = {e.fqn for e in entries}
    return StateTemplate(entries, {k: v for k, v in template.mappings.items() if k in names})


def can_sample(template: StateTemplate) -> bool:
    return len(layers_of(template)) > BASE_LAYERS + 2


def _spread(objects: tuple[DataObject, ...], added: list[int]) -> tuple[DataObject, ...]:
    """Each rank's added bytes over its objects (rank order), in proportion to their size."""
    out = []
    for rank, group in itertools.groupby(objects, key=lambda obj: obj.rank):
        mine = list(group)
        total = sum(o.size_bytes for o in mine) or 1
        given = 0
        for number, obj in enumerate(mine):
            share = (added[rank] - given if number == len(mine) - 1
                     else added[rank] * obj.size_bytes // total)
            given += share
            out.append(dataclasses.replace(obj, size_bytes=obj.size_bytes + share))
    return tuple(out)


def sampled_global_plan(template: StateTemplate, world_size: int, replicas: int,
                        thread_count: int, rank_prefix: Callable[[int], str],
                        checkpoint_id: Any, tp: int = 1) -> GlobalPlan:
    layers = layers_of(template)
    base = set(layers[:BASE_LAYERS])
    rest = [i for i in layers if i not in base]
    counts = Counter(len(str(i)) for i in rest)

    def build(keep: set[int]) -> GlobalPlan:
        return build_global_plan(subset(template, keep), world_size, replicas, thread_count,
                                 rank_prefix, checkpoint_id, tp)

    largest = first = build(base)
    metadata, items = first.metadata_bytes, first.items
    added = [0] * world_size  # each rank's bytes of the layers outside the base
    for digits, count in sorted(counts.items()):
        one = next(i for i in rest if len(str(i)) == digits)
        largest = plus = build(base | {one})
        metadata += count * (plus.metadata_bytes - first.metadata_bytes)
        items += count * (plus.items - first.items)
        added = [a + count * (p - f) for a, p, f in zip(added, plus.rank_bytes(), first.rank_bytes())]
    scale = items / largest.items
    reads = None
    if tp > 1 or replicas > 1:  # deduplication decides who writes what: lay out every item
        laid, reads = laid_out(template, world_size, replicas, thread_count, rank_prefix, tp)
        objects = tuple(laid)
    else:
        objects = _spread(first.objects, added)
    return GlobalPlan(
        world_size, objects, items,
        round(largest.local_plan_bytes_max * scale), round(largest.local_plan_bytes_total * scale),
        largest.planning_s * scale, metadata, largest.metadata_pickle_s * scale,
        largest.metadata_unpickle_s * scale, round(largest.metadata_memory_bytes * scale),
        sampled=f"{BASE_LAYERS} + 1 of {len(layers)} layers built in full, the rest added per "
                "layer" + ("; each rank's objects laid out over every layer (TP or replicas: "
                           "DCP's deduplication decides who writes what)" if reads else "")
                + " (docs/plan.md)", load_reads=reads)
