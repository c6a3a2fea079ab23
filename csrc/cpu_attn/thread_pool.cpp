#include "thread_pool.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

namespace vattn {
namespace cpu_attn {

namespace {

// How long a worker spins for the next job before it sleeps, and how long the
// caller spins for the workers' last tasks before it yields its core. Long
// enough to bridge the gap between two layers' calls; after kSpinPause the
// waiting threads yield between checks, so that on a loaded machine (more
// runnable threads than cores) they hand the core to whoever runs the
// remaining work instead of spinning on it.
constexpr auto kSpin = std::chrono::microseconds(40);
constexpr auto kSpinPause = std::chrono::microseconds(10);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

ThreadPool* g_pool = nullptr;
std::mutex g_pool_mutex;
bool g_forked_child = false;

// A forked child has only the thread that forked; the parent's pool object
// (and its mutexes) are unusable there, so the child leaks it and builds its
// own. Nor does the parent's OpenMP team exist there: the child's pool is its own.
void forget_pool_in_child() {
  g_pool = nullptr;
  g_forked_child = true;
  new (&g_pool_mutex) std::mutex();
}

// VATTN_CPU_ATTN_THREADS as a thread count, or 0 when unset or invalid.
int threads_from_env() {
  if (const char* env = std::getenv("VATTN_CPU_ATTN_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1 && n <= 4096) return static_cast<int>(n);
  }
  return 0;
}

}  // namespace

struct ThreadPool::Omp {
  const char* library;
  void (*parallel)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);  // GOMP_parallel
  int (*thread_num)();   // omp_get_thread_num
  int (*max_threads)();  // omp_get_max_threads
};

namespace {

// The OpenMP runtime this process has loaded already, or null. Never loads one.
const ThreadPool::Omp* loaded_omp() {
  static ThreadPool::Omp omp;
  for (const char* library : {"libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.so.5"}) {
    void* handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
    if (!handle) continue;
    omp.library = library;
    omp.parallel = reinterpret_cast<decltype(omp.parallel)>(dlsym(handle, "GOMP_parallel"));
    omp.thread_num = reinterpret_cast<decltype(omp.thread_num)>(dlsym(handle, "omp_get_thread_num"));
    omp.max_threads = reinterpret_cast<decltype(omp.max_threads)>(dlsym(handle, "omp_get_max_threads"));
    if (omp.parallel && omp.thread_num && omp.max_threads) return &omp;  // the handle stays open
    dlclose(handle);
  }
  return nullptr;
}

struct OmpJob {
  ThreadPool::Task task;
  void* ctx;
  int64_t count;
  int64_t ahead_below;  // tasks below this index may be claimed ahead
  std::atomic<int64_t> next{0};
  std::vector<std::unique_ptr<float[]>>* scratch;
  int (*thread_num)();
};

}  // namespace

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

ThreadPool& ThreadPool::instance() {
  static const bool registered = [] { return pthread_atfork(nullptr, nullptr, forget_pool_in_child) == 0; }();
  (void)registered;
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) {  // lives until exit: workers never join at shutdown
    const char* pool = std::getenv("VATTN_CPU_ATTN_POOL");
    const bool own = g_forked_child || (pool && std::string(pool) == "own");
    const Omp* omp = own ? nullptr : loaded_omp();
    const int wanted = threads_from_env();
    g_pool = omp ? new ThreadPool(omp, wanted) : new ThreadPool(wanted > 0 ? wanted : affinity_cpus());
  }
  return *g_pool;
}

ThreadPool::ThreadPool(int threads) : scratch_(threads > 0 ? threads : 1), scratch_size_(scratch_.size(), 0) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_main(i); });
}

ThreadPool::ThreadPool(const Omp* omp, int threads) : omp_(omp), omp_threads_(threads) {}

int ThreadPool::threads() const {
  if (!omp_) return static_cast<int>(workers_.size()) + 1;
  const int n = omp_threads_ > 0 ? omp_threads_ : omp_->max_threads();
  return n > 0 ? n : 1;
}

std::string ThreadPool::kind() const { return omp_ ? std::string("openmp (") + omp_->library + ")" : "own"; }

void ThreadPool::ensure_scratch(int threads, int64_t floats) {
  if (static_cast<int>(scratch_.size()) < threads) {
    scratch_.resize(threads);
    scratch_size_.resize(threads, 0);
  }
  for (size_t i = 0; i < scratch_.size(); ++i) {
    if (scratch_size_[i] < floats) {
      scratch_[i].reset(new float[floats]);
      scratch_size_[i] = floats;
    }
  }
}

void ThreadPool::omp_body(void* data) {
  OmpJob& job = *static_cast<OmpJob*>(data);
  float* scratch = (*job.scratch)[job.thread_num()].get();
  auto claim_ahead = [&job] {
    int64_t v = job.next.load(std::memory_order_relaxed);
    while (v < job.ahead_below)
      if (job.next.compare_exchange_weak(v, v + 1, std::memory_order_relaxed)) return v;
    return int64_t{-1};
  };
  for (int64_t i = job.next.fetch_add(1, std::memory_order_relaxed); i < job.count;) {
    const int64_t after = claim_ahead();
    job.task(job.ctx, i, after, scratch);
    i = after >= 0 ? after : job.next.fetch_add(1, std::memory_order_relaxed);
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

float* ThreadPool::scratch_for(int thread) { return scratch_[thread].get(); }

void ThreadPool::run(int64_t count, Task task, void* ctx, int64_t scratch_floats, int max_threads) {
  if (count <= 0) return;
  std::lock_guard<std::mutex> job(run_mutex_);
  if (max_threads <= 1 || count == 1) {  // the calling thread alone: no team to start or wait for
    ensure_scratch(1, scratch_floats);
    for (int64_t i = 0; i < count; ++i) task(ctx, i, i + 1 < count ? i + 1 : -1, scratch_for(0));
    return;
  }
  if (omp_) {
    const int n = std::min(threads(), max_threads);
    ensure_scratch(n, scratch_floats);
    // the team has at most n threads (fewer when the runtime has fewer to give)
    const int64_t team = std::min<int64_t>(n, count);
    OmpJob omp_job{task, ctx, count, count - team, {0}, &scratch_, omp_->thread_num};
    omp_->parallel(&ThreadPool::omp_body, &omp_job, static_cast<unsigned>(team), 0);
    return;
  }
  ensure_scratch(static_cast<int>(scratch_.size()), scratch_floats);
  task_ = task;
  ctx_ = ctx;
  count_.store(count, std::memory_order_relaxed);
  ahead_below_.store(count - std::min<int64_t>(threads(), count), std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  const uint64_t gen = generation_.load(std::memory_order_relaxed) + 1;
  next_.store(gen << 32, std::memory_order_release);
  generation_.store(gen, std::memory_order_seq_cst);
  if (!workers_.empty() && count > 1 && sleeping_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(sleep_mutex_);  // a sleeper is either waiting or will see gen
    wake_.notify_all();
  }
  work(gen, scratch_for(0));
  // Wait for tasks other threads claimed; sleeping workers claimed none.
  const auto yield_after = std::chrono::steady_clock::now() + kSpinPause;
  for (int spins = 0; done_.load(std::memory_order_acquire) < count; ++spins) {
    if ((spins & 63) == 63 && std::chrono::steady_clock::now() > yield_after)
      std::this_thread::yield();
    else
      cpu_relax();
  }
}

// The next unclaimed task of this generation's job (below ahead_below_ where `ahead`), or -1.
int64_t ThreadPool::claim(uint64_t generation, bool ahead) {
  for (;;) {
    uint64_t v = next_.load(std::memory_order_acquire);
    // next_ holds the generation's low 32 bits only (the high ones shift out past 2^32 jobs)
    if ((v >> 32) != (generation & 0xffffffffu)) return -1;  // a newer job replaced this one
    const int64_t index = static_cast<int64_t>(v & 0xffffffffu);
    // count_ is this job's: the job cannot finish while index < count_ is unclaimed (and the
    // compare-exchange fails where a newer job has replaced it since the load)
    if (index >= (ahead ? ahead_below_ : count_).load(std::memory_order_relaxed)) return -1;
    if (next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) return index;
  }
}

void ThreadPool::work(uint64_t generation, float* scratch) {
  for (int64_t index = claim(generation, false); index >= 0;) {
    const int64_t after = claim(generation, true);  // runs on this thread next: the job waits for it
    task_(ctx_, index, after, scratch);
    done_.fetch_add(1, std::memory_order_acq_rel);
    index = after >= 0 ? after : claim(generation, false);
  }
}

void ThreadPool::worker_main(int index) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t gen = generation_.load(std::memory_order_acquire);
    if (gen == seen) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; gen == seen; ++spins) {
        gen = generation_.load(std::memory_order_acquire);
        if ((spins & 63) != 63) {
          cpu_relax();
          continue;
        }
        const auto waited = std::chrono::steady_clock::now() - start;
        if (waited > kSpin) break;
        if (waited > kSpinPause) std::this_thread::yield();
      }
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleeping_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
      sleeping_.fetch_sub(1, std::memory_order_relaxed);
      gen = generation_.load(std::memory_order_acquire);
    }
    if (stop_.load()) return;
    seen = gen;
    work(gen, scratch_for(index));
  }
}

}  // namespace cpu_attn
}  // namespace vattn
