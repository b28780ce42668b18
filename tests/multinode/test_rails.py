"""The point-to-point legs of the multi-node schedule (tide/multinode/rails.py): which implementation a
group and device call for, a round moving fresh data both ways, and the reason put/signal cannot run."""
import torch

from tide.launch import run_ranks
from tide.multinode import rails


def _round(rank, world_size, seed):
    import torch.distributed as dist

    import tide

    group = dist.group.WORLD
    assert rails.implementation(group, torch.device("cpu")) == "p2p"
    assert rails.implementation(group, torch.device("cuda")) == "p2p_host_staged"  # gloo moves host memory
    tide.reset_stats()
    peer = 1 - rank
    gen = lambda r: torch.Generator().manual_seed(seed + r)  # noqa: E731
    mine = [torch.randn(5, generator=gen(rank)), torch.randn(3, 2, generator=gen(rank + 10))]
    theirs = [torch.randn(5, generator=gen(peer)), torch.randn(3, 2, generator=gen(peer + 10))]
    got = [torch.full_like(x, float("nan")) for x in theirs]
    # a whole tensor, and a span (elements 1-4 of the 3 x 2 tensor into elements 2-5 of the receiver's)
    rails.exchange(group, [(peer, rails.whole(mine[0])), (peer, (mine[1], 1, 4))],
                   [(peer, rails.whole(got[0])), (peer, (got[1], 2, 4))], "rail")
    rails.exchange(group, [], [], "intra")  # nothing to move: not a round
    assert torch.equal(got[0], theirs[0]), (got[0], theirs[0])
    assert torch.equal(got[1].view(-1)[2:], theirs[1].view(-1)[1:5]), (got[1], theirs[1])
    assert got[1].view(-1)[:2].isnan().all(), got[1]  # outside the span: untouched
    return tide.stats()["multinode"]


def test_a_round_moves_fresh_data_both_ways_and_is_counted():
    for counts in run_ranks(_round, 2, 321, timeout=120):
        assert counts == {"rail:p2p": 1}, counts


def _many_pieces(rank, world_size, seed):
    """Every rank sends each peer a different number of pieces (up to 7), in batches of at most 2 per
    peer: the batches pair up on both ends and every piece lands where it should."""
    import torch.distributed as dist

    rails.MAX_OPS_PER_PEER = 2
    count = lambda src, dst: 1 + (3 * src + 5 * dst) % 7  # noqa: E731 (pieces from src to dst)
    piece = lambda src, dst, i: torch.randn(i + 1, generator=torch.Generator().manual_seed(  # noqa: E731
        seed + 100 * src + 10 * dst + i))
    peers = [p for p in range(world_size) if p != rank]
    sends = [(p, rails.whole(piece(rank, p, i))) for p in peers for i in range(count(rank, p))]
    got = [(p, torch.full((i + 1,), float("nan"))) for p in peers for i in range(count(p, rank))]
    rails.exchange(dist.group.WORLD, sends, [(p, rails.whole(t)) for p, t in got], "intra")
    want = [piece(p, rank, i) for p in peers for i in range(count(p, rank))]
    return all(torch.equal(g, w) for (_, g), w in zip(got, want))


def test_batches_bounded_per_peer_pair_up():
    assert run_ranks(_many_pieces, 3, 55, timeout=120) == [True] * 3


def _packed(rank, world_size, seed):
    """Pieces of several dtypes and sizes (empty ones too) go to each peer as one packed message and land
    in place, in the order both ends post them; a rank with nothing for a peer sends it nothing."""
    import torch.distributed as dist

    dtypes = (torch.bfloat16, torch.float32, torch.float16)
    count = lambda src, dst: (2 * src + 3 * dst) % 5  # noqa: E731 (0 to 4 pieces from src to dst)

    def piece(src, dst, i):
        g = torch.Generator().manual_seed(seed + 100 * src + 10 * dst + i)
        return torch.randn(3 * i, generator=g).to(dtypes[(src + i) % 3])

    peers = [p for p in range(world_size) if p != rank]
    sends = [(p, piece(rank, p, i)) for p in peers for i in range(count(rank, p))]
    want = [(p, piece(p, rank, i)) for p in peers for i in range(count(p, rank))]
    got = [(p, torch.full_like(w, float("nan"))) for p, w in want]
    rails.exchange_packed(dist.group.WORLD, sends, got)
    return all(torch.equal(g, w) for (_, g), (_, w) in zip(got, want))


def test_packed_messages_land_every_piece_in_place():
    assert run_ranks(_packed, 3, 77, timeout=120) == [True] * 3


def test_put_signal_says_why_it_cannot_run_here():
    reason = rails.put_signal_unavailable()
    assert reason is not None and ("nccl4py" in reason or "NCCL" in reason), reason
