"""Collectives of groups that span nodes (``tide.topology``), on every backend: the schedule
(``schedule``: rail rounds, intra-node legs, the sums in node order), its per-rank plans (``plans``), the
settings a group's ranks agree on (``settings``) and the point-to-point legs (``rails``, and the direct
NCCL rails ``nccl_rails``). The reference backend's kernels hand such groups here; on CUDA a node arena
(``tide.transport.node_leg``), where FSDP made one, carries the intra-node legs on the copy engines.
"""
