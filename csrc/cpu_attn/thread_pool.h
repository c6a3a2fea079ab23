// A persistent pool of worker threads for the attention kernels.
//
// Sized once to the CPUs this process may run on (sched_getaffinity), or to
// VATTN_CPU_ATTN_THREADS. The calling thread takes part in every job, so a
// pool of n threads starts n - 1 workers. Workers spin briefly after a job
// (back-to-back layer calls find them awake) and then sleep on a condition
// variable, so an idle pool costs no CPU.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace vattn {
namespace cpu_attn {

class ThreadPool {
 public:
  // task(ctx, index, scratch) for index in [0, count)
  using Task = void (*)(void* ctx, int64_t index, float* scratch);

  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The process-wide pool, created on first use (and again in a forked child,
  // which inherits no threads).
  static ThreadPool& instance();

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs every task once across the pool and the calling thread; returns when
  // all have finished. Each thread's scratch holds at least scratch_floats
  // floats. One job at a time: a concurrent caller waits.
  void run(int64_t count, Task task, void* ctx, int64_t scratch_floats);

 private:
  void worker_main(int index);
  void work(uint64_t generation, float* scratch);
  float* scratch_for(int thread);

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time

  // The current job; written by run() before it publishes the generation.
  Task task_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<int64_t> count_{0};
  // (generation << 32) | next task index: a worker claims an index with one
  // compare-exchange, which fails once a newer job has been published.
  std::atomic<uint64_t> next_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> done_{0};

  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};

  std::vector<std::unique_ptr<float[]>> scratch_;  // per thread; [0] is the caller's
  std::vector<int64_t> scratch_size_;
};

// CPUs in this process's affinity mask (at least 1).
int affinity_cpus();

}  // namespace cpu_attn
}  // namespace vattn
