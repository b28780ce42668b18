"""Every piece of state TIDE keeps for the life of a process, in one module: what each layer has made,
counted or agreed, and the one module that owns each entry (which reads and writes it; no other does).

State keyed on a process group holds the group by weak reference (a ``WeakKeyDictionary``, or a
``weakref.ref`` beside a value keyed by the group's name, where the name numbers store keys), so that
a destroyed group is never kept alive here. State keyed on ranks or names holds no group at all.
This module imports nothing of TIDE, so every layer can reach it.
"""
from __future__ import annotations

import weakref
from collections import Counter

# ---- tide.counters: calls per path (tide.stats()) and the reasons already logged
fsdp_calls: dict[str, Counter] = {"all_gather": Counter(), "reduce_scatter": Counter()}
wiring_calls: Counter = Counter()
op_calls: Counter = Counter()
multinode_calls: Counter = Counter()
logged_reasons: set = set()
op_call_sources: list = []  # (calls, reset) of op calls counted outside Python (tide/ops/cuda.py: the C++ kernels)

# ---- tide.extension
extension_load_hooks: list = []  # called with the CUDA extension when it loads (tide.ops.cuda.hand_over)

# ---- tide.topology
# ProcessGroup -> {local world size: Topology | None}
topologies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# ---- tide.routes: each group's route, resolved once
routes: dict = {}  # process-group name -> (weakref(group), (generation, ranks per node), Route)
route_generation: list = [0]  # bumped when an arena is enabled or dropped: routes are resolved again

# ---- tide.transport.serving (arenas by ranks) and tide.transport.node_leg
arenas: dict = {}  # global ranks, in group-rank order -> Arena
arena_generations: Counter = Counter()  # global ranks -> arenas created for them (names their store keys)
node_groups: dict = {}  # a node's global ranks -> their gloo process group (made once)
node_arenas: dict = {}  # a multi-node group's global ranks -> this rank's node arena

# ---- tide.multinode
multinode_settings: dict = {}  # process-group name -> (weakref(group), the settings its ranks agreed)
settings_agreements: Counter = Counter()  # process-group name -> agreements so far (numbers the store keys)
direct_rails: dict = {}  # process-group name -> (weakref(group), its DirectRails)
rails_openings: Counter = Counter()  # process-group name -> direct rails opened so far (numbers the store keys)

# ---- tide.ops.call_groups: the reference backend's agreed calls
call_servers: dict = {}  # a store server's (host, port) -> this process's connections to it
call_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ProcessGroup -> its GroupState
call_group_instances: Counter = Counter()  # group name -> group objects of that name seen (numbers store keys)
notices_left: list = [0]  # notices of refused calls this process has left (numbers them)
used_notices: dict[int, int] = {}  # global rank -> the seq of its last notice a wait of this process took
process_published: list = [lambda: None]  # weakref of the default group whose store has this process's pid

# ---- tide.fsdp
enabled_groups: dict[tuple, list] = {}  # ranks -> weak references to the TideAllGather states of the groups on them
created_arenas: dict[tuple, str] = {}  # ranks whose arena the seam created -> a group name over them
forward_hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FSDP module -> its hook's handle
released_in_backward: list = [None]  # the backward (graph task) whose end already releases the leases
stock_functions: dict[str, object] = {}  # FSDP2 function name -> what was bound before the seam
call_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FSDPParamGroup -> {(op, phase): calls}
groups_of_params: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FSDPParam -> weakref(its enabled group)
compat_warned: set = set()  # torch versions warned about once
joined_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FSDPParamGroup -> (its join's reason,)
join_instances: Counter = Counter()  # (process-group name, module FQN) -> param groups joined (numbers store keys)
groups_missing_peers: set = set()  # process-group names on which a join found a peer not on TIDE
comm_debug_rules: list = []  # tide.fsdp.comm_debug: each op's CountedAs, once its CommDebugMode rule is registered


def group_entry(table: dict, group):
    """The value ``table`` holds for ``group`` (by name, entered as ``(weakref(group), value)``), or None
    when there is none or it was entered for another group object of that name."""
    entry = table.get(group.group_name)
    return entry[1] if entry is not None and entry[0]() is group else None
