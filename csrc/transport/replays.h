// Replay marks: how the watchdog (tide/transport/watchdog.py) bounds a TIDE op that runs inside a
// CUDA-graph replay, where the completion words of driver.h cannot serve (a value baked into a
// graph node is the same at every replay, so a replayed op would read complete at once).
//
// Per device, kMarks pairs of uint32 words in pinned, mapped host memory; a captured op claims one pair
// at capture (its mark). At every replay the op's first stream operation writes active = 1 (a stream
// memop) and its last, a one-thread kernel, adds 1 to done and then writes active = 0. The watchdog
// reads the pairs with no CUDA call: an op whose active word stays 1 while its done word does not move
// has not completed that replay. An op is serialized with its own previous replay (graphs launched on
// one stream run in order), so each pair has one writer at a time.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "transport/driver.h"

namespace tide::replays {

constexpr int64_t kMarks = 1 << 15;

// The next mark of `device` (refused once kMarks ops were captured in this process).
int64_t claim(int64_t device);
// The memop that opens a replay of `mark`'s op (the caller issues it first on the op's stream).
driver::MemOp begin(int64_t device, int64_t mark);
// Closes a replay of `mark`'s op: its last stream operation.
void end(int64_t device, int64_t mark, cudaStream_t stream);
// (active, done) of marks [first, first + count).
std::vector<std::pair<uint32_t, uint32_t>> states(int64_t device, int64_t first, int64_t count);

}  // namespace tide::replays
