"""Device-free planning: the group layout, argument checks and the ops' fake kernels."""
from tide.meta.layout import GroupLayout, ParamLayout, latin_square_placement

__all__ = ["GroupLayout", "ParamLayout", "latin_square_placement"]
