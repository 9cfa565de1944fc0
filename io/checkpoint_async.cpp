// AsyncCheckpointer and checkpoint_copy_bytes (io/checkpoint.h): a save whose tensors are first
// copied to host memory on the calling thread (copy_to_host), then written, read back and
// committed by a writer thread (run_save, io/checkpoint_save.h) on a communicator of its own,
// while training goes on.
#include <omp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "io/checkpoint_save.h"
#include "kernels/check.h"

namespace fp8moe {
using namespace ckpt;
namespace {

// The bytes of the rows this rank writes of the tensors in backend memory.
int64_t device_bytes(const SavePlan& sp) {
  int64_t n = 0;
  for (const SavedTensor& x : sp.tensors)
    if (x.device) n += x.mine.n * x.width() * int64_t(dt_size(x.dt));
  return n;
}

// An asynchronous save's copy: each device tensor's rows this rank writes, downloaded into `host`
// one after another (tensor order; one synchronisation at the end), the tensor pointed at them.
// The fault point halfway through the tensors (io/checkpoint_faults.h) kills mid-copy.
void copy_to_host(SavePlan& sp, Backend& be, unsigned char* host, FaultPoint& fault) {
  size_t off = 0, n = 0, copied = 0;
  for (const SavedTensor& x : sp.tensors) n += x.device && x.mine.n > 0;
  for (SavedTensor& x : sp.tensors) {
    if (!x.device) continue;
    const size_t bytes = size_t(x.mine.n * x.width()) * dt_size(x.dt);
    if (bytes > 0) {
      be.download(host + off, x.at(x.mine.r0), bytes);
      if (++copied == (n + 1) / 2) fault.hit();
    }
    x.data = host + off, x.row0 = x.mine.r0, x.device = false;
    off += bytes;
  }
  be.sync();
}

// plan_tensors for this rank of comm.
SavePlan plan_on(MPI_Comm comm, const TrainerState& s) {
  SaveTarget t;
  MPI_CHECK(MPI_Comm_rank(comm, &t.rank));
  MPI_CHECK(MPI_Comm_size(comm, &t.size));
  return plan_tensors(s, t);
}

}  // namespace

int64_t checkpoint_copy_bytes(MPI_Comm comm, const TrainerState& s) { return device_bytes(plan_on(comm, s)); }

struct AsyncCheckpointer::Impl {
  MPI_Comm comm = MPI_COMM_NULL;  // the writer's own
  Backend* be = nullptr;
  HostBuffer<unsigned char> copy;
  std::unique_ptr<SaveJob> job;
  std::unique_ptr<FaultPoint> fault;
  // The model's and optimizer's tensors (plan_tensors), the same for every save of theirs.
  std::unique_ptr<SavePlan> tensors;
  const Transformer* model = nullptr;
  const AdamW* opt = nullptr;
  std::thread writer;
  std::atomic<bool> done{false};
  std::string dir, error;
  int kind = 0;  // 1: CheckpointError, 2: CheckpointMismatch, 3: CheckpointUnreadable (on_every_rank's)
};

AsyncCheckpointer::AsyncCheckpointer(MPI_Comm comm, Backend& be) : impl_(std::make_unique<Impl>()) {
  FP8MOE_ASSERT(threads_multiple(), "an asynchronous checkpoint writer needs MPI_THREAD_MULTIPLE");
  MPI_CHECK(MPI_Comm_dup(comm, &impl_->comm));
  impl_->be = &be;
}

AsyncCheckpointer::~AsyncCheckpointer() {
  if (impl_->writer.joinable()) impl_->writer.join();
  if (impl_->comm != MPI_COMM_NULL) MPI_Comm_free(&impl_->comm);
}

bool AsyncCheckpointer::in_flight() const { return impl_->writer.joinable(); }
bool AsyncCheckpointer::finished() const { return !in_flight() || impl_->done.load(std::memory_order_acquire); }
int64_t AsyncCheckpointer::host_bytes() const { return impl_->copy.size(); }

int64_t AsyncCheckpointer::start(MPI_Comm comm, const TrainerState& s) {
  Impl& m = *impl_;
  FP8MOE_ASSERT(!in_flight(), "AsyncCheckpointer::start with a save in flight: wait() first");
  const WatchScope watch("checkpoint copy");
  if (!m.tensors || m.model != s.model || m.opt != s.opt) {
    m.tensors = std::make_unique<SavePlan>(plan_on(comm, s));
    m.model = s.model, m.opt = s.opt;
  }
  m.job = prepare_save(comm, s, m.tensors.get());
  m.fault = std::make_unique<FaultPoint>(m.job->t.rank, m.job->t.dir);
  const int64_t copied = device_bytes(m.job->sp);
  if (copied > m.copy.size()) m.copy = HostBuffer<unsigned char>(*m.be, copied);  // grows only
  copy_to_host(m.job->sp, *m.be, m.copy.data(), *m.fault);
  m.done.store(false), m.dir.clear(), m.error.clear(), m.kind = 0;
  m.writer = std::thread([&m] {
    const WatchLane lane("checkpoint writer");
    // One CPU: a new thread's OpenMP team would be every CPU the process may run on (the main
    // thread's omp_set_num_threads is its own), spinning beside training's (the checksum loops).
    omp_set_num_threads(1);
    try {
      m.dir = run_save(m.comm, *m.job, nullptr, *m.fault);
    } catch (const CheckpointMismatch& e) {
      m.error = e.what(), m.kind = 2;
    } catch (const CheckpointUnreadable& e) {
      m.error = e.what(), m.kind = 3;
    } catch (const CheckpointError& e) {
      m.error = e.what(), m.kind = 1;
    } catch (const std::exception& e) {  // as on the main thread (app/train.cpp): the job ends, exit 1
      fatal_error(__FILE__, __LINE__, std::string("checkpoint writer: unexpected exception: ") + e.what());
    }
    m.done.store(true, std::memory_order_release);
  });
  return copied;
}

std::string AsyncCheckpointer::wait() {
  Impl& m = *impl_;
  if (!in_flight()) return "";
  m.writer.join();  // unmarked: the writer's lane watches each of its calls, however long the save
  m.job.reset();
  m.fault.reset();
  if (m.kind == 2) throw CheckpointMismatch(m.error);
  if (m.kind == 3) throw CheckpointUnreadable(m.error);
  if (m.kind == 1) throw CheckpointError(m.error);
  return m.dir;
}

}  // namespace fp8moe
