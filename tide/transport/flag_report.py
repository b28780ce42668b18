"""Which peers are behind: a stalled rank's flag words set against what it has issued.

The watchdog (tide/transport/watchdog.py) reads a host copy of an arena's int32 flag words when a TIDE
op has not completed in time. Peers write those words (csrc/transport/flags.h), so they say how far
each peer has come; the arena's ``progress()`` says what this rank has issued, i.e. the values its
waits expect:

- all-gather lane i (slot i, or the last: the direct lane), this rank's use u (``ag_uses[i]``): peer p is
  behind when ``ag_free[i][p]`` (p's lane may receive my pieces) or ``ag_ready[i][p]`` (p's pieces
  landed in my lane) is below u;
  ``ag_src[i]`` below u means this rank's own pieces of use u are not posted yet (they wait for the
  peers' "free");
- reduce-scatter: peer q is behind by ``rs_rounds[me] - max_s rs_ready[s][q]`` rounds of its
  contributions to me, and by ``rs_rounds[q] - max_s rs_free[q][s]`` rounds of permits for mine (q
  permits a round when it has issued the op that holds it and summed the round R before).

Ops captured into a CUDA graph use words of their own, set to 1 by the peer that posts them and reset by
this rank once it has waited for them (flags.h): :func:`captured` lists those that are set, i.e. posted
and not yet consumed; a replay that stalls waits for one that is not.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from tide.agreement import peer_words


def lane_name(lane: int, lanes: int) -> str:
    """``slot i``, or ``direct lane`` for the last lane (csrc/transport/flags.h)."""
    return "direct lane" if lane == lanes - 1 else f"slot {lane}"


def behind(words: Sequence[int], index: Mapping[str, list], progress: Mapping[str, list],
           rank: int) -> dict[int, list[str]]:
    """For every peer whose words are below what this rank's issued work waits for: what lags, by how much."""
    value = [w & 0xFFFFFFFF for w in words]
    ag_uses, rs_rounds = progress["ag_uses"], progress["rs_rounds"]
    world = len(rs_rounds)
    out: dict[int, list[str]] = {}
    for p in range(world):
        if p == rank:
            continue
        lags = []
        for i, uses in enumerate(ag_uses):
            free, ready = value[index["ag_free"][i][p]], value[index["ag_ready"][i][p]]
            if min(free, ready) < uses:
                lags.append(f"all-gather {lane_name(i, len(ag_uses))}: free at use {free}, pieces at use {ready}, "
                            f"this rank at use {uses} ({uses - min(free, ready)} behind)")
        delivered = max(value[index["rs_ready"][s][p]] for s in range(len(index["rs_ready"])))
        if delivered < rs_rounds[rank]:
            lags.append(f"reduce-scatter: contributions to this rank through round {delivered} of {rs_rounds[rank]} "
                        f"({rs_rounds[rank] - delivered} behind)")
        permitted = max(value[w] for w in index["rs_free"][p])
        if permitted < rs_rounds[p]:
            lags.append(f"reduce-scatter: permits this rank's contributions through round {permitted} "
                        f"of {rs_rounds[p]} ({rs_rounds[p] - permitted} behind)")
        if lags:
            out[p] = lags
    return out


def describe(words: Sequence[int], index: Mapping[str, list], progress: Mapping[str, list], rank: int,
             ranks: Sequence[int]) -> str:
    """A few lines for the watchdog's report: the peers behind (by global rank), and this rank's pieces not
    yet posted (:func:`issued` gives what it issued)."""
    value = [w & 0xFFFFFFFF for w in words]
    lines = []
    late = behind(words, index, progress, rank)
    for p, lags in late.items():
        lines.append(f"  {peer_words(p, ranks[p])} is behind: " + "; ".join(lags))
    if not late:
        lines.append("  no peer's flags are behind this rank's issued work (the stall is on this GPU's own queue)")
    lanes = len(progress["ag_uses"])
    unposted = [lane_name(i, lanes) for i, uses in enumerate(progress["ag_uses"]) if value[index["ag_src"][i]] < uses]
    if unposted:
        lines.append(f"  this rank's pieces for {', '.join(unposted)} are not posted yet "
                     "(waiting for peers' free flags)")
    return "\n".join(lines)


def captured(words: Sequence[int], index: Mapping[str, list], rank: int) -> str:
    """The captured protocol's words that are set on this rank (posted by a peer, not yet consumed)."""
    value = [w & 0xFFFFFFFF for w in words]
    posted, lanes = [], len(index["g_ag_free"])
    for i, row in enumerate(index["g_ag_free"]):
        if peers := [p for p, w in enumerate(row) if p != rank and value[w]]:
            posted.append(f"all-gather {lane_name(i, lanes)} free at peer(s) {peers}")
    for i, row in enumerate(index["g_ag_ready"]):
        if peers := [p for p, w in enumerate(row) if p != rank and value[w]]:
            posted.append(f"all-gather {lane_name(i, lanes)} pieces from peer(s) {peers}")
    for s, row in enumerate(index["g_rs_ready"]):
        if peers := [q for q, w in enumerate(row) if q != rank and value[w]]:
            posted.append(f"reduce-scatter ring slot {s} contributions from peer(s) {peers}")
    for d, row in enumerate(index["g_rs_free"]):
        if d != rank and (slots := [s for s, w in enumerate(row) if value[w]]):
            posted.append(f"reduce-scatter permits from peer {d} for ring slot(s) {slots}")
    return ("  captured ops' words posted to this rank and not yet consumed: " + "; ".join(posted) if posted
            else "  captured ops' words: none posted to this rank (a replay waits for a peer that has not reached it)")


def issued(progress: Mapping[str, list]) -> str:
    """What this rank has issued, i.e. the flag values its waits expect (known without reading any flag)."""
    return (f"this rank issued all-gather uses {list(progress['ag_uses'])} per lane and reduce-scatter rounds "
            f"{list(progress['rs_rounds'])} per destination")
