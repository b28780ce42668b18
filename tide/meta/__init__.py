"""Device-free planning: the group layout (where every shard lands, which gradient bytes go where) and the
argument checks every kernel of the ``tide`` ops shares."""
from tide.meta.layout import GroupLayout, ParamLayout, latin_square_placement

__all__ = ["GroupLayout", "ParamLayout", "latin_square_placement"]
