// The attention kernel's thread pool, run on its own: every task runs once, and the `next` a task is
// given is the task its thread runs next (claimed before this one starts), never one of the last
// `threads` tasks, which threads claim as they come free. Run by tests/kernels/test_thread_pool.py with
// VATTN_CPU_ATTN_POOL and VATTN_CPU_ATTN_THREADS set; built with -fopenmp where the OpenMP path is wanted.
// Prints the pool's kind and "ok", or what broke (exit 1).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "thread_pool.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using vattn::cpu_attn::ThreadPool;

struct Run {
  int64_t index, next;
  std::thread::id thread;
};

struct Job {
  std::mutex mutex;
  std::vector<Run> runs;        // in the order tasks started
  std::vector<int> times_run;   // per index
};

void task(void* ctx, int64_t index, int64_t next, float*) {
  Job& job = *static_cast<Job*>(ctx);
  // a little work, so that several threads take part
  volatile double x = 0;
  for (int i = 0; i < 2000; ++i) x = x + i * 0.5;
  std::lock_guard<std::mutex> lock(job.mutex);
  job.runs.push_back(Run{index, next, std::this_thread::get_id()});
  ++job.times_run[index];
}

bool check(ThreadPool& pool, int64_t count, int max_threads, bool openmp) {
  Job job;
  job.times_run.assign(count, 0);
  pool.run(count, task, &job, 16, max_threads);
  for (int64_t i = 0; i < count; ++i)
    if (job.times_run[i] != 1) {
      std::printf("count %lld, max_threads %d: task %lld ran %d times\n", static_cast<long long>(count), max_threads,
                  static_cast<long long>(i), job.times_run[i]);
      return false;
    }
  const bool serial = max_threads <= 1 || count == 1;
  const int64_t team = openmp ? std::min<int64_t>(std::min(pool.threads(), max_threads), count)
                              : std::min<int64_t>(pool.threads(), count);
  const int64_t ahead_below = serial ? count : count - team;
  for (size_t r = 0; r < job.runs.size(); ++r) {
    const Run& run = job.runs[r];
    if (serial && run.next != (run.index + 1 < count ? run.index + 1 : -1)) {
      std::printf("count %lld, serial: task %lld was given next %lld\n", static_cast<long long>(count),
                  static_cast<long long>(run.index), static_cast<long long>(run.next));
      return false;
    }
    if (run.next < 0) continue;
    if (run.next >= ahead_below) {
      std::printf("count %lld, max_threads %d, team %lld: task %lld was given next %lld, one of the last %lld\n",
                  static_cast<long long>(count), max_threads, static_cast<long long>(team),
                  static_cast<long long>(run.index), static_cast<long long>(run.next),
                  static_cast<long long>(count - ahead_below));
      return false;
    }
    // the same thread's next run is that task
    size_t after = r + 1;
    while (after < job.runs.size() && job.runs[after].thread != run.thread) ++after;
    if (after == job.runs.size() || job.runs[after].index != run.next) {
      std::printf("count %lld, max_threads %d: task %lld was given next %lld, but its thread ran %lld next\n",
                  static_cast<long long>(count), max_threads, static_cast<long long>(run.index),
                  static_cast<long long>(run.next),
                  static_cast<long long>(after == job.runs.size() ? -1 : job.runs[after].index));
      return false;
    }
  }
  return true;
}

}  // namespace

int main() {
#ifdef _OPENMP
  // load the runtime's threads before the pool looks for a loaded runtime
#pragma omp parallel
  { (void)omp_get_thread_num(); }
#endif
  ThreadPool& pool = ThreadPool::instance();
  const bool openmp = pool.kind() != "own";
  std::printf("%s\n", pool.kind().c_str());
  for (int repeat = 0; repeat < 20; ++repeat)
    for (int64_t count : {1, 2, 3, 5, 8, 17, 64, 1000})
      for (int max_threads : {1, 2, pool.threads()})
        if (!check(pool, count, max_threads, openmp)) return 1;
  std::printf("ok\n");
  return 0;
}
