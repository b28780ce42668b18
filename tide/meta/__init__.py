"""Device-free planning: the group layout (where every shard lands, which gradient bytes go where), the
multi-node schedule, and the argument checks every kernel of the ``tide`` ops shares."""
from tide.meta.layout import GroupLayout, ParamLayout
from tide.meta.multinode import MultiNodePlan, Topology, latin_square_placement

__all__ = ["GroupLayout", "ParamLayout", "MultiNodePlan", "Topology", "latin_square_placement"]
