"""Which peers the watchdog names as behind, from flag words and issued progress (pure logic; the CUDA
transport supplies the real word indices from csrc/transport/flags.h)."""
import itertools

from tide.transport import flag_report


def _index(K, R, W):
    """Any assignment of distinct words works: the report only looks words up by name."""
    n = itertools.count()
    return {
        "ag_free": [[next(n) for _ in range(W)] for _ in range(K)],
        "ag_ready": [[next(n) for _ in range(W)] for _ in range(K)],
        "rs_ready": [[next(n) for _ in range(W)] for _ in range(R)],
        "rs_free": [[next(n) for _ in range(R)] for _ in range(W)],
        "ag_src": [next(n) for _ in range(K)],
        "rs_push_src": [[next(n) for _ in range(R)] for _ in range(W)],
        "g_ag_free": [[next(n) for _ in range(W)] for _ in range(K)],
        "g_ag_ready": [[next(n) for _ in range(W)] for _ in range(K)],
        "g_rs_ready": [[next(n) for _ in range(W)] for _ in range(R)],
        "g_rs_free": [[next(n) for _ in range(R)] for _ in range(W)],
    }, next(n)


def _caught_up(index, words, ag_uses, rs_rounds, rank, R):
    """The words of a rank whose issued work has completed."""
    W = len(rs_rounds)
    for i, uses in enumerate(ag_uses):
        for p in range(W):
            words[index["ag_free"][i][p]] = words[index["ag_ready"][i][p]] = uses
        words[index["ag_src"][i]] = uses
    for g in range(1, rs_rounds[rank] + 1):  # round g of mine sits in ring slot (g - 1) % R
        for q in range(W):
            words[index["rs_ready"][(g - 1) % R][q]] = g
    for d in range(W):
        for g in range(1, rs_rounds[d] + 1):
            words[index["rs_free"][d][(g - 1) % R]] = g
    return words


def test_nothing_behind_when_every_wait_is_met():
    K, R, W, rank = 2, 4, 3, 1
    index, n = _index(K, R, W)
    progress = {"ag_uses": [5, 4], "rs_rounds": [7, 9, 6]}
    words = _caught_up(index, [0] * n, progress["ag_uses"], progress["rs_rounds"], rank, R)
    assert flag_report.behind(words, index, progress, rank) == {}
    text = flag_report.describe(words, index, progress, rank, ranks=[10, 11, 12])
    assert "no peer's flags are behind" in text and "not posted" not in text


def test_a_peer_behind_in_each_protocol_is_named_with_its_lag():
    L, R, W, rank = 3, 4, 3, 0  # lanes: slots 0 and 1, then the direct lane
    index, n = _index(L, R, W)
    progress = {"ag_uses": [5, 4, 3], "rs_rounds": [9, 6, 6]}
    words = _caught_up(index, [0] * n, progress["ag_uses"], progress["rs_rounds"], rank, R)
    words[index["ag_ready"][1][2]] = 2  # peer 2's pieces for slot 1 stopped at use 2 of 4
    for g in range(1, 8):  # peer 1's contributions to me stopped at round 7 of 9
        words[index["rs_ready"][(g - 1) % R][1]] = g
    words[index["ag_free"][2][2]] = 2  # peer 2 freed its direct lane for use 2 of 3
    words[index["ag_src"][0]] = 4  # my own pieces of slot 0's use 5 wait for peers' free flags
    late = flag_report.behind(words, index, progress, rank)
    assert set(late) == {1, 2}
    assert late[2] == ["all-gather slot 1: free at use 4, pieces at use 2, this rank at use 4 (2 behind)",
                       "all-gather direct lane: free at use 2, pieces at use 3, this rank at use 3 (1 behind)"]
    assert late[1] == ["reduce-scatter: contributions to this rank through round 7 of 9 (2 behind)"]
    text = flag_report.describe(words, index, progress, rank, ranks=[4, 5, 6])
    assert "peer 2 (global rank 6) is behind" in text and "peer 1 (global rank 5) is behind" in text
    assert "this rank's pieces for slot 0 are not posted yet" in text
    assert flag_report.issued(progress) == ("this rank issued all-gather uses [5, 4, 3] per lane and reduce-scatter "
                                            "rounds [9, 6, 6] per destination")


def test_a_peer_that_stopped_summing_my_contributions():
    K, R, W, rank = 1, 2, 2, 1
    index, n = _index(K, R, W)
    progress = {"ag_uses": [3], "rs_rounds": [5, 5]}
    words = _caught_up(index, [0] * n, progress["ag_uses"], progress["rs_rounds"], rank, R)
    for s in range(R):
        words[index["rs_free"][0][s]] = min(words[index["rs_free"][0][s]], 3)
    assert flag_report.behind(words, index, progress, rank) == {
        0: ["reduce-scatter: permits this rank's contributions through round 3 of 5 (2 behind)"]}


def test_words_are_read_as_unsigned():
    index, n = _index(1, 1, 2)
    words = [0] * n
    words[index["ag_free"][0][1]] = words[index["ag_ready"][0][1]] = -1  # 2**32 - 1 as int32
    assert flag_report.behind(words, index, {"ag_uses": [2**32 - 1], "rs_rounds": [0, 0]}, 0) == {}


def test_the_captured_words_posted_and_not_yet_consumed_are_listed():
    (index, n), rank = _index(3, 2, 3), 0  # lanes: slots 0 and 1, then the direct lane
    words = [0] * n
    assert "none posted to this rank" in flag_report.captured(words, index, rank)
    words[index["g_ag_free"][1][2]] = 1  # peer 2's slot 1 is free for my pieces
    words[index["g_rs_ready"][0][1]] = 1  # peer 1's contribution to my ring slot 0 landed
    words[index["g_rs_free"][2][1]] = 1  # peer 2 permits my push into its ring slot 1
    words[index["g_ag_ready"][2][1]] = 1  # peer 1's pieces landed in my direct-lane outputs
    words[index["g_ag_ready"][0][0]] = 1  # my own word: never listed
    line = flag_report.captured(words, index, rank)
    assert line == ("  captured ops' words posted to this rank and not yet consumed: all-gather slot 1 free at peer(s) "
                    "[2]; all-gather direct lane pieces from peer(s) [1]; reduce-scatter ring slot 0 contributions "
                    "from peer(s) [1]; reduce-scatter permits from peer 2 "
                    "for ring slot(s) [1]"), line
