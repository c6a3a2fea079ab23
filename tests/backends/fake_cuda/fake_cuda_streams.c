/* The fake CUDA driver's streams, events, graph capture and device accesses.
 *
 * Streams: created streams (blocking, or CU_STREAM_NON_BLOCKING), the legacy
 * default stream (handles 0 and CU_STREAM_LEGACY = 1: one per context, and
 * synchronizing it also completes the blocking streams' work) and the
 * per-thread default stream (CU_STREAM_PER_THREAD = 2: a different stream on
 * every thread, which synchronizes with nothing else).
 *
 * Kernels: tests queue device accesses on a stream (fake_cuda_device_access:
 * a kernel that reads or writes a range, fake_cuda_launch: one that touches
 * nothing; cuMemcpyDtoD: a copy on the legacy stream). An access runs when
 * it is launched (the data moves then) and stays queued until a wait sees it
 * complete (cuStreamSynchronize, cuEventSynchronize of a later event,
 * cuCtxSynchronize). Touching an address that is not mapped with access, or
 * unmapping one that a queued access uses (fake_cuda_memory.c), faults: the
 * context is poisoned, as a GPU's MMU fault poisons it.
 *
 * Capture (cuStreamBeginCapture_v2 .. cuStreamEndCapture): work launched on
 * the capturing stream is recorded, not run, into a graph that
 * cuGraphInstantiateWithFlags + cuGraphLaunch replay (an access may take its
 * row index from host memory read at replay time, as a kernel reads a length
 * from device memory). The rules, each failing the call and invalidating the
 * capture (cuStreamEndCapture then returns CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
 * and no graph):
 *   - synchronizing the capturing stream, or the context while any of its
 *     streams captures: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
 *   - "potentially unsafe" calls (memory management, synchronous copies,
 *     cuCtxSynchronize) from the capturing thread unless the capture is
 *     relaxed, or from any thread in global mode while another thread holds a
 *     global-mode capture (cuThreadExchangeStreamCaptureMode sets a thread's
 *     mode): CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED. Which VMM calls the real
 *     driver counts as unsafe is not documented; the fake counts them all;
 *   - the legacy stream used while a blocking stream of its context captures:
 *     CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
 *   - an event recorded on the capturing stream joins the graph; waiting for
 *     it: CUDA_ERROR_CAPTURED_EVENT.
 * Besides, every release (cuMemRelease, cuMemAddressFree, cuEventDestroy)
 * made while any capture is in progress is counted, in whatever mode or
 * thread (fake_cuda_releases_during_capture): a check stricter than the
 * rules above, for code that must issue none then.
 * An event recorded on another stream, outside the capture, is legal.
 */
#include "fake_cuda.h"

#include <string.h>

enum { STREAM_CREATED, STREAM_LEGACY, STREAM_PER_THREAD };

#define MAX_NODES 256
/* One captured kernel: it touches `bytes` at base + (*index) * stride
 * (index NULL: base), reading into or writing from buf. */
typedef struct { uintptr_t base; const long long* index; size_t stride, bytes; int write; void* buf; } Node;

struct Capture {
  int alive, mode, invalidated;
  struct CUstream_st* origin;
  pthread_t thread;
  CUcontext ctx;
  int n;
  Node nodes[MAX_NODES];
};

/* launched: kernels queued; completed: how many of them some wait has seen
 * finish. ctx NULL: the legacy stream, of whichever context is current. */
struct CUstream_st {
  CUcontext ctx;
  int alive, kind;
  unsigned int flags;
  long syncs, records, launched, completed;
  struct Capture* capture;
};
#define MAX_STREAMS 1024
static struct CUstream_st streams[MAX_STREAMS];
static int num_streams = 0;
static struct CUstream_st legacy_stream = {NULL, 1, STREAM_LEGACY, 0, 0, 0, 0, 0, NULL};
static __thread struct CUstream_st* per_thread_stream = NULL;

struct CUevent_st { CUcontext ctx; int alive; struct CUstream_st* recorded_on; long covers; struct Capture* captured_in; };
#define MAX_EVENTS 65536 /* handles are never reused: a destroyed event stays recognisable */
static struct CUevent_st events[MAX_EVENTS];
static int num_events = 0;
static long live_events = 0;

#define MAX_CAPTURES 64
static struct Capture captures[MAX_CAPTURES];
static __thread int thread_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

struct CUgraph_st { int alive, n; Node nodes[MAX_NODES]; };
#define MAX_GRAPHS 256
static struct CUgraph_st graphs[MAX_GRAPHS];
static int num_graphs = 0;

/* Accesses launched and not yet seen complete: what an unmap must not touch. */
typedef struct { struct CUstream_st* stream; long seq; uintptr_t lo, hi; CUcontext ctx; } Pending;
#define MAX_PENDING 8192
static Pending pending[MAX_PENDING];
static int num_pending = 0;

/* ---- streams ---- */

static int blocking(const struct CUstream_st* s) { return s->kind != STREAM_LEGACY && !(s->flags & CU_STREAM_NON_BLOCKING); }

/* The stream behind a handle, or NULL when it is not a live stream. The
 * per-thread stream is made on the thread's first use. Caller holds fc_mu. */
static struct CUstream_st* stream_of_locked(CUstream h) {
  if (h == NULL || h == CU_STREAM_LEGACY) return &legacy_stream;
  if (h == CU_STREAM_PER_THREAD) {
    if (!per_thread_stream && num_streams < MAX_STREAMS) {
      struct CUstream_st* s = &streams[num_streams++];
      memset(s, 0, sizeof(*s));
      s->ctx = fc_current();
      s->alive = 1;
      s->kind = STREAM_PER_THREAD;
      per_thread_stream = s;
    }
    return per_thread_stream;
  }
  for (int i = 0; i < num_streams; ++i)
    if (h == &streams[i]) return streams[i].alive && streams[i].kind == STREAM_CREATED ? h : NULL;
  return NULL;
}
static struct CUstream_st* stream_of(CUstream h) {
  pthread_mutex_lock(&fc_mu);
  struct CUstream_st* s = stream_of_locked(h);
  pthread_mutex_unlock(&fc_mu);
  return s;
}
/* Created streams belong to their context; the default streams to the current one. */
static CUcontext stream_context(const struct CUstream_st* s) { return s->kind == STREAM_CREATED ? s->ctx : fc_current(); }

/* Kernels of s up to `upto` are done; retired accesses drop out. Caller holds fc_mu. */
static void complete_locked(struct CUstream_st* s, long upto) {
  if (s->completed < upto) s->completed = upto;
}
static void complete_context_locked(CUcontext ctx, int blocking_only) {
  for (int i = 0; i < num_streams; ++i)
    if (streams[i].ctx == ctx && (!blocking_only || blocking(&streams[i])))
      complete_locked(&streams[i], streams[i].launched);
}

int fc_pending_access_locked(uintptr_t lo, uintptr_t hi, CUcontext* ctx) {
  for (int i = 0; i < num_pending; ++i) {
    const Pending* p = &pending[i];
    if (p->stream->completed < p->seq && p->lo < hi && lo < p->hi) {
      *ctx = p->ctx;
      return 1;
    }
  }
  return 0;
}

/* Caller holds fc_mu. */
static CUresult add_pending_locked(struct CUstream_st* s, uintptr_t lo, size_t bytes, CUcontext ctx) {
  if (num_pending == MAX_PENDING) {  /* drop what has completed */
    int kept = 0;
    for (int i = 0; i < num_pending; ++i)
      if (pending[i].stream->completed < pending[i].seq) pending[kept++] = pending[i];
    num_pending = kept;
  }
  if (num_pending == MAX_PENDING) {  /* a full launch queue: the launch waits until the queued work is done */
    for (int i = 0; i < num_pending; ++i) complete_locked(pending[i].stream, pending[i].seq);
    num_pending = 0;
  }
  pending[num_pending++] = (Pending){s, s->launched, lo, lo + bytes, ctx};
  return CUDA_SUCCESS;
}

/* One kernel of node `n` on s, now: faults unless every byte it touches is
 * mapped with the access it needs. Caller holds fc_mu. */
static CUresult run_access_locked(CUcontext ctx, struct CUstream_st* s, const Node* n) {
  uintptr_t addr = n->base + (n->index ? (uintptr_t)(*n->index * (long long)n->stride) : 0);
  int need = n->write ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
  if (n->bytes && !fc_accessible_locked(addr, n->bytes, need)) {
    fc_poison_locked(ctx, addr);
    return CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  if (n->bytes && n->write) memcpy((void*)addr, n->buf, n->bytes);
  if (n->bytes && !n->write) memcpy(n->buf, (const void*)addr, n->bytes);
  s->launched++;
  return n->bytes ? add_pending_locked(s, addr, n->bytes, ctx) : CUDA_SUCCESS;
}

/* ---- capture rules ---- */

CUresult fc_capture_forbids_unsafe_call(void) {
  if (thread_capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
  CUresult rc = CUDA_SUCCESS;
  pthread_t self = pthread_self();
  pthread_mutex_lock(&fc_mu);
  for (int i = 0; i < MAX_CAPTURES; ++i) {
    struct Capture* c = &captures[i];
    if (!c->alive) continue;
    int mine = pthread_equal(c->thread, self);
    if ((mine && c->mode != CU_STREAM_CAPTURE_MODE_RELAXED) ||
        (!mine && thread_capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL && c->mode == CU_STREAM_CAPTURE_MODE_GLOBAL)) {
      c->invalidated = 1;
      rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}

/* Caller holds fc_mu. */
static CUresult legacy_use_locked(CUcontext ctx) {
  CUresult rc = CUDA_SUCCESS;
  for (int i = 0; i < MAX_CAPTURES; ++i) {
    struct Capture* c = &captures[i];
    if (c->alive && c->ctx == ctx && blocking(c->origin)) {
      c->invalidated = 1;
      rc = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
  }
  return rc;
}
CUresult fc_capture_forbids_legacy_use(CUcontext ctx) {
  pthread_mutex_lock(&fc_mu);
  CUresult rc = legacy_use_locked(ctx);
  pthread_mutex_unlock(&fc_mu);
  return rc;
}

CUresult fc_legacy_copy(uintptr_t dst, uintptr_t src, size_t bytes) {
  CUcontext ctx = fc_current();
  pthread_mutex_lock(&fc_mu);
  CUresult rc = legacy_use_locked(ctx);
  if (rc == CUDA_SUCCESS && !fc_accessible_locked(src, bytes, CU_MEM_ACCESS_FLAGS_PROT_READ)) {
    fc_poison_locked(ctx, src);
    rc = CUDA_ERROR_ILLEGAL_ADDRESS;
  } else if (rc == CUDA_SUCCESS && !fc_accessible_locked(dst, bytes, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)) {
    fc_poison_locked(ctx, dst);
    rc = CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  if (rc == CUDA_SUCCESS) {
    memmove((void*)dst, (const void*)src, bytes);
    legacy_stream.launched++;
    rc = add_pending_locked(&legacy_stream, src, bytes, ctx);
    if (rc == CUDA_SUCCESS) rc = add_pending_locked(&legacy_stream, dst, bytes, ctx);
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}

/* ---- control API for tests ---- */

/* A kernel on stream h that reads (write = 0: into buf) or writes (from buf)
 * `bytes` at base + (*index) * stride (index NULL: at base). On the legacy
 * stream it runs in the current context, or in device 0's primary context
 * where none is current (tests reading the cache without a framework).
 * Returns CUDA_ERROR_ILLEGAL_ADDRESS, the context poisoned, where it faults;
 * while h captures, it is recorded into the graph instead (*index is read
 * at each replay). */
CUresult fake_cuda_device_access(CUstream h, unsigned long long base, const long long* index,
                                 unsigned long long stride, unsigned long long bytes, int write, void* buf) {
  if (!fc_initialized) return CUDA_ERROR_NOT_INITIALIZED;
  pthread_mutex_lock(&fc_mu);
  struct CUstream_st* s = stream_of_locked(h);
  CUcontext ctx = s ? stream_context(s) : NULL;
  if (s && !ctx && s->kind == STREAM_LEGACY) ctx = fc_primary(0);
  CUresult rc = !s ? CUDA_ERROR_INVALID_HANDLE
                : !ctx ? CUDA_ERROR_INVALID_CONTEXT
                : !ctx->alive ? CUDA_ERROR_CONTEXT_IS_DESTROYED
                : ctx->poisoned ? CUDA_ERROR_ILLEGAL_ADDRESS
                                : CUDA_SUCCESS;
  Node n = {(uintptr_t)base, index, (size_t)stride, (size_t)bytes, write != 0, buf};
  if (rc == CUDA_SUCCESS && s->capture) {
    struct Capture* c = s->capture;
    rc = c->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
         : c->n == MAX_NODES ? CUDA_ERROR_OUT_OF_MEMORY
                             : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) c->nodes[c->n++] = n;
  } else if (rc == CUDA_SUCCESS) {
    if (s->kind == STREAM_LEGACY) rc = legacy_use_locked(ctx);
    if (rc == CUDA_SUCCESS) rc = run_access_locked(ctx, s, &n);
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
/* Queues one kernel that touches nothing; returns how many the stream holds. */
long fake_cuda_launch(CUstream h) {
  pthread_mutex_lock(&fc_mu);
  struct CUstream_st* s = stream_of_locked(h);
  long n = s ? ++s->launched : -1;
  pthread_mutex_unlock(&fc_mu);
  return n;
}
/* The stream's kernels so far finish, as on a GPU that got there while the
 * host did other work: no wait is counted. */
void fake_cuda_finish(CUstream h) {
  pthread_mutex_lock(&fc_mu);
  struct CUstream_st* s = stream_of_locked(h);
  if (s) complete_locked(s, s->launched);
  pthread_mutex_unlock(&fc_mu);
}
/* The stream's first n kernels finish (a GPU part-way through its queue). */
void fake_cuda_finish_upto(CUstream h, long n) {
  pthread_mutex_lock(&fc_mu);
  struct CUstream_st* s = stream_of_locked(h);
  if (s) complete_locked(s, n < s->launched ? n : s->launched);
  pthread_mutex_unlock(&fc_mu);
}
static long releases_during_capture = 0;
void fc_note_release(void) {
  pthread_mutex_lock(&fc_mu);
  for (int i = 0; i < MAX_CAPTURES; ++i)
    if (captures[i].alive) {
      releases_during_capture++;
      break;
    }
  pthread_mutex_unlock(&fc_mu);
}
/* Releases made while some capture was in progress (fc_note_release). */
long fake_cuda_releases_during_capture(void) { return releases_during_capture; }
/* Kernels of the stream that some wait has seen complete. */
long fake_cuda_stream_completed(CUstream h) {
  struct CUstream_st* s = stream_of(h);
  return s ? s->completed : -1;
}
/* Times the stream was waited on, by cuStreamSynchronize or
 * cuEventSynchronize of an event recorded on it. */
long fake_cuda_stream_syncs(CUstream h) {
  struct CUstream_st* s = stream_of(h);
  return s ? s->syncs : -1;
}
long fake_cuda_stream_records(CUstream h) {
  struct CUstream_st* s = stream_of(h);
  return s ? s->records : -1;
}
long fake_cuda_live_events(void) { return live_events; }

/* ---- driver API: streams ---- */

CUresult cuStreamCreate(CUstream* out, unsigned int flags) {
  NEED_CONTEXT();
  if (!out || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
  CUresult rc = CUDA_SUCCESS;
  pthread_mutex_lock(&fc_mu);
  if (num_streams == MAX_STREAMS) {
    rc = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    struct CUstream_st* s = &streams[num_streams++];
    memset(s, 0, sizeof(*s));
    s->ctx = fc_current();
    s->alive = 1;
    s->kind = STREAM_CREATED;
    s->flags = flags;
    *out = s;
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
CUresult cuStreamDestroy_v2(CUstream h) {
  NEED_CONTEXT();
  struct CUstream_st* s = stream_of(h);
  if (!s || s->kind != STREAM_CREATED) return CUDA_ERROR_INVALID_HANDLE;
  s->alive = 0;
  return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(CUstream h) {
  NEED_CONTEXT();
  INJECT("cuStreamSynchronize");
  pthread_mutex_lock(&fc_mu);
  struct CUstream_st* s = stream_of_locked(h);
  CUresult rc = s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
  if (s && s->capture) {  /* its work is not scheduled: nothing to wait for */
    s->capture->invalidated = 1;
    rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  } else if (s && s->kind == STREAM_LEGACY) {
    rc = legacy_use_locked(fc_current());
  }
  if (rc == CUDA_SUCCESS) {
    s->syncs++;
    complete_locked(s, s->launched);
    if (s->kind == STREAM_LEGACY) complete_context_locked(fc_current(), 1);  /* it waits for blocking streams */
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
CUresult cuCtxSynchronize(void) {
  NEED_CONTEXT();
  INJECT("cuCtxSynchronize");
  CUcontext ctx = fc_current();
  CUresult rc = CUDA_SUCCESS;
  pthread_mutex_lock(&fc_mu);
  for (int i = 0; i < MAX_CAPTURES; ++i)  /* a broader handle than a capturing stream */
    if (captures[i].alive && captures[i].ctx == ctx) {
      captures[i].invalidated = 1;
      rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
  pthread_mutex_unlock(&fc_mu);
  if (rc == CUDA_SUCCESS) rc = fc_capture_forbids_unsafe_call();
  if (rc != CUDA_SUCCESS) return rc;
  __sync_fetch_and_add(&fc_sync_calls, 1);
  pthread_mutex_lock(&fc_mu);  /* the whole context: every stream's kernels */
  complete_context_locked(ctx, 0);
  complete_locked(&legacy_stream, legacy_stream.launched);
  pthread_mutex_unlock(&fc_mu);
  return CUDA_SUCCESS;
}

/* ---- driver API: events ---- */

CUresult cuEventCreate(CUevent* out, unsigned int flags) {
  (void)flags;
  NEED_CONTEXT();
  INJECT("cuEventCreate");
  CUresult rc = CUDA_SUCCESS;
  pthread_mutex_lock(&fc_mu);
  if (num_events == MAX_EVENTS) {
    rc = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    struct CUevent_st* e = &events[num_events++];
    memset(e, 0, sizeof(*e));
    e->ctx = fc_current();
    e->alive = 1;
    live_events++;
    *out = e;
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
CUresult cuEventRecord(CUevent e, CUstream h) {
  NEED_CONTEXT();
  INJECT("cuEventRecord");
  pthread_mutex_lock(&fc_mu);
  struct CUstream_st* s = stream_of_locked(h);
  CUresult rc = CUDA_SUCCESS;
  if (!e || !e->alive || !s || stream_context(s) != e->ctx) {
    rc = CUDA_ERROR_INVALID_HANDLE;  /* not the same context */
  } else if (s->capture) {  /* joins the graph: a captured event */
    rc = s->capture->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) {
      e->captured_in = s->capture;
      e->recorded_on = NULL;
      s->records++;
    }
  } else {
    if (s->kind == STREAM_LEGACY) rc = legacy_use_locked(fc_current());
    if (rc == CUDA_SUCCESS) {
      e->captured_in = NULL;
      e->recorded_on = s;
      e->covers = s->launched;
      s->records++;
    }
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
CUresult cuEventSynchronize(CUevent e) {
  NEED_CONTEXT();
  INJECT("cuEventSynchronize");
  CUresult rc = CUDA_SUCCESS;
  pthread_mutex_lock(&fc_mu);
  if (!e || !e->alive) {
    rc = CUDA_ERROR_INVALID_HANDLE;
  } else if (e->captured_in && e->captured_in->alive) {
    e->captured_in->invalidated = 1;
    rc = CUDA_ERROR_CAPTURED_EVENT;
  } else if (e->recorded_on) {
    e->recorded_on->syncs++;
    complete_locked(e->recorded_on, e->covers);
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
/* Whether the work an event covers has finished: what some wait saw, or what
 * fake_cuda_finish let finish (a GPU that got there on its own). */
CUresult cuEventQuery(CUevent e) {
  NEED_CONTEXT();
  INJECT("cuEventQuery");
  CUresult rc = CUDA_SUCCESS;
  pthread_mutex_lock(&fc_mu);
  if (!e || !e->alive) {
    rc = CUDA_ERROR_INVALID_HANDLE;
  } else if (e->captured_in && e->captured_in->alive) {
    rc = CUDA_ERROR_CAPTURED_EVENT;
  } else if (e->recorded_on && e->recorded_on->completed < e->covers) {
    rc = CUDA_ERROR_NOT_READY;
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
CUresult cuEventDestroy_v2(CUevent e) {
  NEED_CONTEXT();
  fc_note_release();
  if (!e || !e->alive) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&fc_mu);
  e->alive = 0;
  live_events--;
  pthread_mutex_unlock(&fc_mu);
  return CUDA_SUCCESS;
}

/* ---- driver API: capture and graphs ---- */

CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  if (!mode || *mode < CU_STREAM_CAPTURE_MODE_GLOBAL || *mode > CU_STREAM_CAPTURE_MODE_RELAXED)
    return CUDA_ERROR_INVALID_VALUE;
  int old = thread_capture_mode;
  thread_capture_mode = *mode;
  *mode = old;
  return CUDA_SUCCESS;
}
CUresult cuStreamBeginCapture_v2(CUstream h, int mode) {
  NEED_CONTEXT();
  if (mode < CU_STREAM_CAPTURE_MODE_GLOBAL || mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&fc_mu);
  struct CUstream_st* s = stream_of_locked(h);
  CUresult rc = !s ? CUDA_ERROR_INVALID_HANDLE
                : s->kind == STREAM_LEGACY ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
                : s->capture ? CUDA_ERROR_ILLEGAL_STATE
                             : CUDA_ERROR_OUT_OF_MEMORY;
  for (int i = 0; rc == CUDA_ERROR_OUT_OF_MEMORY && i < MAX_CAPTURES; ++i) {
    struct Capture* c = &captures[i];
    if (c->alive) continue;
    memset(c, 0, sizeof(*c));
    c->alive = 1;
    c->mode = mode;
    c->origin = s;
    c->thread = pthread_self();
    c->ctx = s->ctx;
    s->capture = c;
    rc = CUDA_SUCCESS;
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
CUresult cuStreamEndCapture(CUstream h, CUgraph* graph) {
  NEED_CONTEXT();
  if (!graph) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&fc_mu);
  struct CUstream_st* s = stream_of_locked(h);
  struct Capture* c = s ? s->capture : NULL;
  CUresult rc = !s ? CUDA_ERROR_INVALID_HANDLE
                : !c || c->origin != s ? CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
                : c->mode != CU_STREAM_CAPTURE_MODE_RELAXED && !pthread_equal(c->thread, pthread_self())
                    ? CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
                    : CUDA_SUCCESS;
  if (rc == CUDA_SUCCESS) {
    s->capture = NULL;
    c->alive = 0;
    for (int i = 0; i < num_events; ++i)  /* its events leave the graph empty-handed */
      if (events[i].captured_in == c) events[i].captured_in = NULL;
    *graph = NULL;
    if (c->invalidated) {
      rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    } else if (num_graphs == MAX_GRAPHS) {
      rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      struct CUgraph_st* g = &graphs[num_graphs++];
      g->alive = 1;
      g->n = c->n;
      memcpy(g->nodes, c->nodes, sizeof(Node) * (size_t)c->n);
      *graph = g;
    }
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
CUresult cuStreamIsCapturing(CUstream h, int* status) {
  NEED_CONTEXT();
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&fc_mu);
  struct CUstream_st* s = stream_of_locked(h);
  CUresult rc = s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
  if (s && s->kind == STREAM_LEGACY) {  /* an error that invalidates nothing */
    for (int i = 0; i < MAX_CAPTURES; ++i)
      if (captures[i].alive && captures[i].ctx == fc_current() && blocking(captures[i].origin))
        rc = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  }
  if (rc == CUDA_SUCCESS)
    *status = !s->capture ? CU_STREAM_CAPTURE_STATUS_NONE
              : s->capture->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                        : CU_STREAM_CAPTURE_STATUS_ACTIVE;
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
static struct CUgraph_st* graph_of_locked(CUgraph g) {
  return g >= graphs && g < graphs + num_graphs && g->alive ? g : NULL;
}
CUresult cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph g, unsigned long long flags) {
  NEED_CONTEXT();
  pthread_mutex_lock(&fc_mu);
  struct CUgraph_st* src = graph_of_locked(g);
  CUresult rc = !exec || !src || flags ? CUDA_ERROR_INVALID_VALUE
                : num_graphs == MAX_GRAPHS ? CUDA_ERROR_OUT_OF_MEMORY
                                           : CUDA_SUCCESS;
  if (rc == CUDA_SUCCESS) {
    struct CUgraph_st* e = &graphs[num_graphs++];
    *e = *src;
    *exec = e;
  }
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
CUresult cuGraphLaunch(CUgraphExec exec, CUstream h) {
  NEED_CONTEXT();
  pthread_mutex_lock(&fc_mu);
  struct CUgraph_st* g = graph_of_locked(exec);
  struct CUstream_st* s = stream_of_locked(h);
  CUcontext ctx = s ? stream_context(s) : NULL;
  CUresult rc = !g || !s ? CUDA_ERROR_INVALID_HANDLE
                : s->capture ? CUDA_ERROR_NOT_SUPPORTED  /* a graph inside a capture: not modelled */
                : s->kind == STREAM_LEGACY ? legacy_use_locked(ctx)
                                           : CUDA_SUCCESS;
  for (int i = 0; rc == CUDA_SUCCESS && i < g->n; ++i) rc = run_access_locked(ctx, s, &g->nodes[i]);
  pthread_mutex_unlock(&fc_mu);
  return rc;
}
CUresult cuGraphExecDestroy(CUgraphExec exec) {
  pthread_mutex_lock(&fc_mu);
  struct CUgraph_st* g = graph_of_locked(exec);
  if (g) g->alive = 0;
  pthread_mutex_unlock(&fc_mu);
  return g ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuGraphDestroy(CUgraph graph) { return cuGraphExecDestroy(graph); }
