// The byte layout of a TIDE arena and its int32 flag words: the one definition (Python asks the
// extension for it before allocating, tide.transport.arena).
//
// Arena of one set of ranks, identical on every rank p, in two regions:
//
//   flags (symmetric memory, mapped for the arena's life; peers' copies at flag_bases[p]):
//     [0, flags_bytes)                      int32 flag words (FlagLayout)
//   data (leased from the caching allocator per phase, tide/transport/lease.py; peers' copies at
//   data_bases[p], which change only at a lease):
//     slots_off + i * slot_bytes            all-gather slot i < K: param-major, GroupLayout offsets
//     ring_off + (s * W + q) * entry_bytes  reduce-scatter staging entry of ring slot s < R that
//                                           contributor q fills for this rank
//
// Flag words are sequence numbers that only grow (nothing is ever reset); each carries the value of the
// use it announces. "ready" flags follow data: peers write them with 4-B copies from a local source
// word that a stream memop has just set (NCCL's CE protocol). "free" flags follow reads: peers write them
// with stream memops straight into the word.
// All-gather words come per lane i <= K: lane i < K is slot i; lane K, the direct lane, carries the
// all-gathers whose outputs lie outside the slots, in caching-allocator memory every rank leases and maps
// per call (tide/transport/all_gather.py); its addresses are the call's, not the data region's.
//   ag_free[i][p]   peer p's lane i may receive my pieces for its use v            (written by p)
//   ag_ready[i][p]  peer p's pieces of use v have landed in my lane i              (written by p)
//   rs_ready[s][q]  contributor q's entry for my ring slot s holds its round g    (written by q)
//   rs_free[d][s]   destination d lets me push its round g into its ring slot s      (written by d)
//                   d posts it once it has summed round g - R; after a new lease of its data region,
//                   at the start of its next reduce-scatter, for that op's first R rounds. The round
//                   counters skip R at a lease, so no permit into the old region reaches a round of
//                   the new one: no peer writes into a ring before its destination leased it and
//                   issued an op after the lease (tide/transport/lease.py).
//   ag_src[i], rs_push_src[d][s]: the local source words of the "ready" copies. One word per lane /
//   (destination, ring slot), so no copy can read a value meant for another.
//
// The captured protocol (an op issued into a CUDA graph) has words of its own, because a value baked
// into a graph node is the same at every replay: sequence numbers cannot grow there. Each of its words
// has one writer, which sets it to 1, and one reader, which waits for 1 and resets it to 0 right after
// (on the same stream). A writer sets a word again only after an answer the reader sends once it has
// reset it, and every captured op consumes every word it sets, so each op leaves them all 0: a replay
// finds them as the previous one left them, and eager ops never read them.
//   g_ag_free[i][p], g_ag_ready[i][p], g_rs_ready[s][q], g_rs_free[d][s]: as above, 1 for "posted".
//   one: a word that holds 1 for the arena's life, the source of the captured "ready" copies.
#pragma once

#include <cstdint>

namespace tide {

struct FlagLayout {
  int64_t K, R, W;
  // All-gather lanes: one per slot, and lane K, the direct lane (outputs outside the slots).
  int64_t L() const { return K + 1; }
  int64_t ag_free(int64_t lane, int64_t p) const { return lane * W + p; }
  int64_t ag_ready(int64_t lane, int64_t p) const { return (L() + lane) * W + p; }
  int64_t rs_ready(int64_t s, int64_t q) const { return 2 * L() * W + s * W + q; }
  int64_t rs_free(int64_t d, int64_t s) const { return 2 * L() * W + R * W + d * R + s; }
  int64_t ag_src(int64_t lane) const { return 2 * L() * W + 2 * R * W + lane; }
  int64_t rs_push_src(int64_t d, int64_t s) const { return 2 * L() * W + 2 * R * W + L() + d * R + s; }
  int64_t graph_base() const { return 2 * L() * W + 3 * R * W + L(); }
  int64_t g_ag_free(int64_t lane, int64_t p) const { return graph_base() + lane * W + p; }
  int64_t g_ag_ready(int64_t lane, int64_t p) const { return graph_base() + (L() + lane) * W + p; }
  int64_t g_rs_ready(int64_t s, int64_t q) const { return graph_base() + 2 * L() * W + s * W + q; }
  int64_t g_rs_free(int64_t d, int64_t s) const { return graph_base() + 2 * L() * W + R * W + d * R + s; }
  int64_t one() const { return graph_base() + 2 * L() * W + 2 * R * W; }
  int64_t words() const { return one() + 1; }
};

constexpr int64_t kPage = 4096;

inline int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// Byte sizes and offsets of one arena (all page-aligned): the flag region, and inside the data region.
struct ArenaLayout {
  FlagLayout flags;
  int64_t slot_bytes, entry_bytes;
  int64_t flags_bytes() const { return round_up(4 * flags.words(), kPage); }
  int64_t slots_off() const { return 0; }
  int64_t ring_off() const { return slots_off() + flags.K * slot_bytes; }
  int64_t data_bytes() const { return ring_off() + flags.R * flags.W * entry_bytes; }
};

}  // namespace tide
