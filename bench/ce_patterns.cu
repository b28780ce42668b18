// Copy-engine issue patterns over NVLink, both GPUs pushing to each other at once (what an all-gather
// at W = 2 does): which way of issuing a list of per-parameter pieces reaches the link's bandwidth.
//
// One process, GPUs 0 and 1 with peer access. For every piece list (the own pieces of one rank in a
// param-major all-gather slot) and every pattern, both GPUs copy their pieces into the other GPU's
// buffer at the same offsets; the time is the slower GPU's (CUDA events), median of the repetitions.
// Patterns:
//   loop      one cudaMemcpyAsync per piece, one stream
//   batch     one cudaMemcpyBatchAsync of all pieces, one stream
//   loopS     pieces dealt to S streams by bytes, one cudaMemcpyAsync each
//   batchS    pieces dealt to S streams, one cudaMemcpyBatchAsync per stream
//   2d        runs of pieces at a constant stride as one cudaMemcpy2DAsync each, one stream
//   2dS       those runs dealt to S streams
//   single    one copy of the whole span (the ceiling; writes more bytes than the pieces hold)
//   pull_batch, pull_single   the same moves issued by the receiving GPU: its copy engine reads the
//             other GPU's pieces over NVLink into its own buffer (an all-gather whose outputs need not
//             be mapped by peers, so they could live in the caching allocator)
// Also: the round trip of a 4-byte flag copy answered by a stream-memop wait on the other GPU, and
// host microseconds to issue each pattern. Prints CSV rows on stdout (bench/results/ce_patterns.csv).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));          \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)
#define CU(x)                                                                                      \
  do {                                                                                             \
    CUresult r_ = (x);                                                                             \
    if (r_ != CUDA_SUCCESS) {                                                                      \
      fprintf(stderr, "%s:%d %s: CUresult %d\n", __FILE__, __LINE__, #x, (int)r_);                \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

struct Piece {
  size_t off, bytes;
};
struct Run {  // `height` pieces of `width` bytes, `pitch` apart, from `off`
  size_t off, width, pitch, height;
};

static size_t align16(size_t x) { return (x + 15) / 16 * 16; }

// The own pieces (rank `rank` of `world`) of a param-major slot holding params of `out_bytes` each.
static std::vector<Piece> slot_pieces(const std::vector<size_t>& out_bytes, int rank, int world, size_t* span) {
  std::vector<Piece> ps;
  size_t off = 0;
  for (size_t b : out_bytes) {
    const size_t shard = b / world;
    ps.push_back({off + rank * shard, shard});
    off = align16(off + b);
  }
  *span = off;
  return ps;
}

static std::vector<Run> runs_of(const std::vector<Piece>& ps) {
  std::vector<Run> rs;
  for (size_t i = 0; i < ps.size();) {
    size_t j = i + 1;
    const size_t pitch = j < ps.size() ? ps[j].off - ps[i].off : 0;
    while (j < ps.size() && ps[j].bytes == ps[i].bytes && ps[j].off - ps[j - 1].off == pitch) ++j;
    rs.push_back({ps[i].off, ps[i].bytes, j - i > 1 ? pitch : ps[i].bytes, j - i});
    i = j;
  }
  return rs;
}

struct Gpu {
  int dev;
  char* buf;      // local slot
  char* peer;     // the other GPU's slot (peer pointer)
  std::vector<cudaStream_t> streams;
  cudaEvent_t start, stop;
  std::vector<cudaEvent_t> joins;
};

// Deals items (by bytes) to S streams, greedy least-loaded, keeping list order within a stream.
static std::vector<std::vector<size_t>> deal(const std::vector<size_t>& bytes, int S) {
  std::vector<std::vector<size_t>> out(S);
  std::vector<size_t> load(S, 0);
  for (size_t i = 0; i < bytes.size(); ++i) {
    const int s = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    out[s].push_back(i);
    load[s] += bytes[i];
  }
  return out;
}

static void issue_batch(cudaStream_t st, const std::vector<void*>& d, const std::vector<const void*>& s,
                        const std::vector<size_t>& n) {
  if (d.empty()) return;
  if (d.size() == 1) {
    CK(cudaMemcpyAsync(d[0], s[0], n[0], cudaMemcpyDefault, st));
    return;
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t idx = 0;
  CK(cudaMemcpyBatchAsync(const_cast<void**>(d.data()), const_cast<const void**>(s.data()), const_cast<size_t*>(n.data()),
                          d.size(), &attr, &idx, 1, st));
}

// Issues one pattern on one GPU (streams[0] is the one that starts and ends).
static void issue(Gpu& g, const std::string& pat, int S, const std::vector<Piece>& ps, const std::vector<Run>& rs,
                  size_t span) {
  cudaStream_t s0 = g.streams[0];
  if (pat == "pull_single") {  // ps, span: the other GPU's pieces; read them from there into buf
    CK(cudaMemcpyAsync(g.buf, g.peer, span, cudaMemcpyDefault, s0));
    return;
  }
  if (pat == "pull_batch") {
    std::vector<void*> d;
    std::vector<const void*> s;
    std::vector<size_t> n;
    for (auto& p : ps) {
      d.push_back(g.buf + p.off);
      s.push_back(g.peer + p.off);
      n.push_back(p.bytes);
    }
    issue_batch(s0, d, s, n);
    return;
  }
  if (S > 1) {
    CK(cudaEventRecord(g.joins[0], s0));
    for (int k = 1; k < S; ++k) CK(cudaStreamWaitEvent(g.streams[k], g.joins[0], 0));
  }
  if (pat == "single") {
    CK(cudaMemcpyAsync(g.peer, g.buf, span, cudaMemcpyDefault, s0));
  } else if (pat == "loop" || pat == "batch") {
    std::vector<size_t> bytes;
    for (auto& p : ps) bytes.push_back(p.bytes);
    auto dealt = deal(bytes, S);
    for (int k = 0; k < S; ++k) {
      std::vector<void*> d;
      std::vector<const void*> s;
      std::vector<size_t> n;
      for (size_t i : dealt[k]) {
        if (pat == "loop") {
          CK(cudaMemcpyAsync(g.peer + ps[i].off, g.buf + ps[i].off, ps[i].bytes, cudaMemcpyDefault, g.streams[k]));
        } else {
          d.push_back(g.peer + ps[i].off);
          s.push_back(g.buf + ps[i].off);
          n.push_back(ps[i].bytes);
        }
      }
      issue_batch(g.streams[k], d, s, n);
    }
  } else {  // 2d
    std::vector<size_t> bytes;
    for (auto& r : rs) bytes.push_back(r.width * r.height);
    auto dealt = deal(bytes, S);
    for (int k = 0; k < S; ++k)
      for (size_t i : dealt[k]) {
        const Run& r = rs[i];
        if (r.height == 1) {
          CK(cudaMemcpyAsync(g.peer + r.off, g.buf + r.off, r.width, cudaMemcpyDefault, g.streams[k]));
        } else {
          CK(cudaMemcpy2DAsync(g.peer + r.off, r.pitch, g.buf + r.off, r.pitch, r.width, r.height, cudaMemcpyDefault,
                               g.streams[k]));
        }
      }
  }
  if (S > 1) {
    for (int k = 1; k < S; ++k) {
      CK(cudaEventRecord(g.joins[k], g.streams[k]));
      CK(cudaStreamWaitEvent(s0, g.joins[k], 0));
    }
  }
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 15;
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    fprintf(stderr, "ce_patterns: needs 2 GPUs, found %d\n", n);
    return 2;
  }
  CU(cuInit(0));
  // Piece lists: the 8B block (9 params, natural order and equal sizes grouped) and the collectives
  // bench's 8-param group at 1, 16, 256 MiB and 1 GiB.
  struct Case {
    std::string name;
    std::vector<size_t> out_bytes;
  };
  std::vector<Case> cases;
  const size_t d = 4096, f = 14336;
  cases.push_back({"llama8b_block", {d * 2, d * d * 2, d * d * 2, d * d * 2, d * d * 2, d * 2, f * d * 2, f * d * 2, f * d * 2}});
  cases.push_back({"llama8b_block_grouped", {d * d * 2, d * d * 2, d * d * 2, d * d * 2, f * d * 2, f * d * 2, f * d * 2, d * 2, d * 2}});
  for (size_t mib : {1, 16, 256, 1024}) {
    const size_t rows = std::max<size_t>(8, (mib << 20) / 2 / 1024);
    std::vector<size_t> ob;
    size_t acc = 0;
    for (int w = 1; w <= 8; ++w) {
      size_t r = rows * w / 36;
      if (w == 8) r = rows - acc;
      acc += r;
      r = std::max<size_t>(1, r + (w - 1) % 3 - 1);
      r = (r + 1) / 2 * 2;  // even rows: 2 equal shards
      ob.push_back(r * 1024 * 2);
    }
    cases.push_back({"bench8_" + std::to_string(mib) + "MiB", ob});
  }
  size_t max_span = 0;
  for (auto& c : cases) {
    size_t span;
    slot_pieces(c.out_bytes, 0, 2, &span);
    max_span = std::max(max_span, span);
  }
  Gpu g[2];
  const int maxS = 4;
  for (int i = 0; i < 2; ++i) {
    g[i].dev = i;
    CK(cudaSetDevice(i));
    CK(cudaDeviceEnablePeerAccess(1 - i, 0));
    CK(cudaMalloc(&g[i].buf, max_span));
    CK(cudaMemset(g[i].buf, i + 1, max_span));
    g[i].streams.resize(maxS);
    g[i].joins.resize(maxS);
    for (int k = 0; k < maxS; ++k) {
      CK(cudaStreamCreateWithFlags(&g[i].streams[k], cudaStreamNonBlocking));
      CK(cudaEventCreateWithFlags(&g[i].joins[k], cudaEventDisableTiming));
    }
    CK(cudaEventCreate(&g[i].start));
    CK(cudaEventCreate(&g[i].stop));
  }
  g[0].peer = g[1].buf;
  g[1].peer = g[0].buf;
  printf("case,pattern,streams,copies,piece_bytes,ms,gbps_per_direction,host_us\n");
  struct Pat {
    std::string name;
    int S;
  };
  const std::vector<Pat> pats = {{"single", 1}, {"loop", 1}, {"batch", 1}, {"loop", 2}, {"loop", 4},
                                 {"batch", 2},  {"batch", 4}, {"2d", 1},   {"2d", 2},   {"2d", 4},
                                 {"pull_single", 1}, {"pull_batch", 1}};
  for (auto& c : cases) {
    for (auto& p : pats) {
      std::vector<Piece> ps[2];
      std::vector<Run> rs[2];
      size_t span = 0, piece_bytes = 0;
      for (int i = 0; i < 2; ++i) {
        ps[i] = slot_pieces(c.out_bytes, i, 2, &span);
        rs[i] = runs_of(ps[i]);
      }
      for (auto& q : ps[0]) piece_bytes += q.bytes;
      const bool pull = p.name.rfind("pull_", 0) == 0;
      const bool single = p.name == "single" || p.name == "pull_single";
      const size_t copies = single ? 1 : p.name == "2d" ? rs[0].size() : ps[0].size();
      std::vector<double> ms, host;
      for (int it = 0; it < reps + 3; ++it) {
        for (int i = 0; i < 2; ++i) {
          CK(cudaSetDevice(i));
          CK(cudaDeviceSynchronize());
        }
        double h = 0;
        for (int i = 0; i < 2; ++i) {
          CK(cudaSetDevice(i));
          CK(cudaEventRecord(g[i].start, g[i].streams[0]));
          const auto t0 = std::chrono::steady_clock::now();
          issue(g[i], p.name, p.S, pull ? ps[1 - i] : ps[i], rs[i], span);
          h = std::max(h, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
          CK(cudaEventRecord(g[i].stop, g[i].streams[0]));
        }
        float t = 0;
        for (int i = 0; i < 2; ++i) {
          CK(cudaSetDevice(i));
          CK(cudaEventSynchronize(g[i].stop));
          float ti = 0;
          CK(cudaEventElapsedTime(&ti, g[i].start, g[i].stop));
          t = std::max(t, ti);
        }
        if (it >= 3) {
          ms.push_back(t);
          host.push_back(h);
        }
      }
      const double m = median(ms);
      const size_t moved = single ? span : piece_bytes;
      printf("%s,%s,%d,%zu,%zu,%.4f,%.1f,%.1f\n", c.name.c_str(), p.name.c_str(), p.S, copies, moved, m,
             moved / (m * 1e-3) / 1e9, median(host));
      fflush(stdout);
    }
  }
  // Flag round trip: GPU 0 copies a 4-byte value into GPU 1's flag; GPU 1's stream waits for it
  // (cuStreamWaitValue32) and copies it back into GPU 0's flag, which GPU 0's stream waits for.
  {
    uint32_t *flag[2], *src[2];
    for (int i = 0; i < 2; ++i) {
      CK(cudaSetDevice(i));
      CK(cudaMalloc(&flag[i], 4));
      CK(cudaMalloc(&src[i], 4));
      CK(cudaMemset(flag[i], 0, 4));
    }
    const int iters = 200;
    for (int i = 0; i < 2; ++i) {
      CK(cudaSetDevice(i));
      CK(cudaDeviceSynchronize());
    }
    CK(cudaSetDevice(0));
    CK(cudaEventRecord(g[0].start, g[0].streams[0]));
    for (uint32_t v = 1; v <= iters; ++v) {
      CK(cudaSetDevice(0));
      CU(cuStreamWriteValue32((CUstream)g[0].streams[0], (CUdeviceptr)src[0], v, 0));
      CK(cudaMemcpyAsync(flag[1], src[0], 4, cudaMemcpyDefault, g[0].streams[0]));
      CU(cuStreamWaitValue32((CUstream)g[0].streams[0], (CUdeviceptr)flag[0], v, CU_STREAM_WAIT_VALUE_GEQ));
      CK(cudaSetDevice(1));
      CU(cuStreamWaitValue32((CUstream)g[1].streams[0], (CUdeviceptr)flag[1], v, CU_STREAM_WAIT_VALUE_GEQ));
      CU(cuStreamWriteValue32((CUstream)g[1].streams[0], (CUdeviceptr)src[1], v, 0));
      CK(cudaMemcpyAsync(flag[0], src[1], 4, cudaMemcpyDefault, g[1].streams[0]));
    }
    CK(cudaSetDevice(0));
    CK(cudaEventRecord(g[0].stop, g[0].streams[0]));
    CK(cudaEventSynchronize(g[0].stop));
    float t = 0;
    CK(cudaEventElapsedTime(&t, g[0].start, g[0].stop));
    printf("flag_round_trip,copy4+wait,1,%d,4,%.4f,0,0\n", 2 * iters, t / iters);
    // The same with the flag written straight into the peer's memory by a stream memop.
    for (int i = 0; i < 2; ++i) {
      CK(cudaSetDevice(i));
      CK(cudaMemset(flag[i], 0, 4));
      CK(cudaDeviceSynchronize());
    }
    CK(cudaSetDevice(0));
    CK(cudaEventRecord(g[0].start, g[0].streams[0]));
    bool ok = true;
    for (uint32_t v = 1; v <= iters && ok; ++v) {
      CK(cudaSetDevice(0));
      ok = cuStreamWriteValue32((CUstream)g[0].streams[0], (CUdeviceptr)flag[1], v, 0) == CUDA_SUCCESS;
      CU(cuStreamWaitValue32((CUstream)g[0].streams[0], (CUdeviceptr)flag[0], v, CU_STREAM_WAIT_VALUE_GEQ));
      CK(cudaSetDevice(1));
      CU(cuStreamWaitValue32((CUstream)g[1].streams[0], (CUdeviceptr)flag[1], v, CU_STREAM_WAIT_VALUE_GEQ));
      ok = ok && cuStreamWriteValue32((CUstream)g[1].streams[0], (CUdeviceptr)flag[0], v, 0) == CUDA_SUCCESS;
    }
    if (ok) {
      CK(cudaSetDevice(0));
      CK(cudaEventRecord(g[0].stop, g[0].streams[0]));
      CK(cudaEventSynchronize(g[0].stop));
      CK(cudaEventElapsedTime(&t, g[0].start, g[0].stop));
      printf("flag_round_trip,memop_write_peer+wait,1,%d,4,%.4f,0,0\n", 2 * iters, t / iters);
    } else {
      printf("flag_round_trip,memop_write_peer+wait,1,0,4,nan,0,0\n");
    }
  }
  return 0;
}
