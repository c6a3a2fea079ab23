// The threads the attention kernels run on.
//
// Where the process has already loaded an OpenMP runtime with the GNU ABI
// (torch's libgomp, or an Intel / LLVM runtime that exports it), jobs run on
// that runtime's threads (GOMP_parallel, found with dlopen(RTLD_NOLOAD): no
// build-time or load-time dependency). Between layers the framework's own ops
// (matmuls, norms) run on those same threads, which spin for a while after
// each parallel region; a second pool of spinning threads on the same cores
// would take turns with them at the scheduler's time slice (milliseconds) on
// a machine with as many threads as cores. The team size is the runtime's
// (torch.set_num_threads), or VATTN_CPU_ATTN_THREADS.
//
// Otherwise (no runtime loaded, VATTN_CPU_ATTN_POOL=own, or a forked child,
// where a parent's OpenMP team does not exist) a pool of its own: sized once
// to the CPUs this process may run on (sched_getaffinity), or to
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
#include <string>
#include <thread>
#include <vector>

namespace vattn {
namespace cpu_attn {

class ThreadPool {
 public:
  // task(ctx, index, next, scratch) for index in [0, count); next is the index the same thread runs
  // after this one (already claimed, so a task may ask for its data ahead), or -1
  using Task = void (*)(void* ctx, int64_t index, int64_t next, float* scratch);

  struct Omp;  // an OpenMP runtime's entry points

  explicit ThreadPool(int threads);         // a pool of its own
  ThreadPool(const Omp* omp, int threads);  // jobs on the runtime's threads; threads 0: its team size
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The process-wide pool, created on first use (and again in a forked child,
  // which inherits no threads).
  static ThreadPool& instance();

  // Threads a job runs on now (the OpenMP team size can change between jobs).
  int threads() const;
  // "openmp (libgomp.so.1)" or "own"
  std::string kind() const;

  // Runs every task once across the pool and the calling thread (at most
  // max_threads of them; 1: the calling thread alone); returns when all have
  // finished. Each thread's scratch holds at least scratch_floats floats. One
  // job at a time: a concurrent caller waits. A thread claims its next task
  // before it runs the current one, except among the last `threads` tasks,
  // which are claimed as threads come free so that the tail stays balanced.
  void run(int64_t count, Task task, void* ctx, int64_t scratch_floats, int max_threads);

 private:
  void worker_main(int index);
  void work(uint64_t generation, float* scratch);
  int64_t claim(uint64_t generation, bool ahead);
  float* scratch_for(int thread);
  void ensure_scratch(int threads, int64_t floats);
  static void omp_body(void* job);

  const Omp* omp_ = nullptr;  // set when jobs run on an OpenMP runtime's threads
  int omp_threads_ = 0;       // VATTN_CPU_ATTN_THREADS, or 0: the runtime's team size

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time

  // The current job; written by run() before it publishes the generation.
  Task task_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> ahead_below_{0};  // tasks below this index may be claimed ahead
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
