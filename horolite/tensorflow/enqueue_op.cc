// horolite's native enqueue op for TensorFlow graphs (built with async_wait.cc
// into one library, on first use, by native_ops.py).
//
// HorolitEnqueue hands its input tensors to the runtime without running Python
// on TensorFlow's thread: it keeps each input Tensor by value (a reference to
// TensorFlow's buffer, no copy) in a table under the collective's handle id,
// appends one item to a queue under one mutex, rings the background thread's
// wake-up (a C function pointer), and returns the id at once. The background
// thread takes the queued items through horolit_take() (cffi), reads the inputs
// where they lie, and submits them; when the collective is done, horolit_complete()
// (async_wait.cc) hands the results to the wait op and calls horolit_drop_inputs()
// here, which releases TensorFlow's buffers. The op never blocks, so the split
// into an enqueue op and an asynchronous wait op keeps its meaning: no TensorFlow
// thread waits while another rank still needs one to enqueue.
#include <time.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

using namespace tensorflow;

extern "C" {
// One queued collective as Python reads it: pointers into the inputs' table entry,
// valid until horolit_drop_inputs(hid).
struct horolit_item {
  int64_t hid;
  int64_t spec;      // Python's description of the collective (name, kind, op, ...)
  int32_t n;         // input tensors
  const int32_t* dtypes;
  char* const* data;
  const int64_t* nbytes;
  const int32_t* ndims;
  const int64_t* dims;  // every input's dimensions, one after the other
  int64_t enqueued_ns;  // when the op ran (CLOCK_MONOTONIC, Python's time.monotonic_ns)
};
}

namespace {

struct Inputs {
  std::vector<Tensor> tensors;  // by value: TensorFlow's buffers stay alive with them
  std::vector<int32_t> dtypes;
  std::vector<char*> data;
  std::vector<int64_t> nbytes;
  std::vector<int32_t> ndims;
  std::vector<int64_t> dims;
};

std::mutex mu;
std::vector<horolit_item> queued;
std::atomic<int64_t> pending_items{0};  // queued.size(), readable without the lock
std::unordered_map<int64_t, Inputs*> inputs;  // hid -> inputs, until the collective is done
std::atomic<int64_t> next_hid{int64_t(1) << 40};  // above the Python ops' ids
void (*ring)(void*) = nullptr;
void* ring_arg = nullptr;
// Set when the runtime can take no more work: what enqueue ops fail with meanwhile.
absl::Status closed = absl::FailedPreconditionError(
    "NotInitializedError: horolite is not initialized: call horolite.init() first");

}  // namespace

REGISTER_OP("HorolitEnqueue")
    .Input("tensors: T")
    .Output("handle: int64")
    .Attr("T: list(type) >= 1")
    .Attr("spec: int")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    });

class HorolitEnqueueOp : public OpKernel {
 public:
  explicit HorolitEnqueueOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("spec", &spec_));
  }

  void Compute(OpKernelContext* ctx) override {
    auto* in = new Inputs;
    const int n = ctx->num_inputs();
    in->tensors.reserve(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& t = ctx->input(i);
      in->tensors.push_back(t);
      in->dtypes.push_back(static_cast<int32_t>(t.dtype()));
      in->data.push_back(const_cast<char*>(t.tensor_data().data()));
      in->nbytes.push_back(static_cast<int64_t>(t.TotalBytes()));
      in->ndims.push_back(t.dims());
      for (int d = 0; d < t.dims(); ++d) in->dims.push_back(t.dim_size(d));
    }
    const int64_t hid = next_hid.fetch_add(1);
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    horolit_item item{hid, spec_, n, in->dtypes.data(), in->data.data(), in->nbytes.data(),
                      in->ndims.data(), in->dims.data(),
                      int64_t(now.tv_sec) * 1000000000 + now.tv_nsec};
    void (*fn)(void*) = nullptr;
    void* arg = nullptr;
    absl::Status refused;
    {
      std::lock_guard<std::mutex> lock(mu);
      fn = ring;
      arg = ring_arg;
      if (fn != nullptr) {
        inputs[hid] = in;
        queued.push_back(item);
        pending_items.store(static_cast<int64_t>(queued.size()));
      } else {
        refused = closed;
      }
    }
    if (fn == nullptr) {  // no runtime takes work (before init, after shutdown or a failure)
      delete in;
      ctx->SetStatus(refused);
      return;
    }
    fn(arg);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = hid;
  }

  // Cheap: TensorFlow's executor then runs it inline the moment its inputs exist. As an
  // expensive op it went to the inter-op pool's queue behind the rest of backprop (the
  // owner thread takes the newest work first), so a step's buckets all left at its end.
  bool IsExpensive() override { return false; }

 private:
  int64_t spec_;
};

REGISTER_KERNEL_BUILDER(Name("HorolitEnqueue").Device(DEVICE_CPU), HorolitEnqueueOp);

extern "C" {
// The wake-up the op rings after queueing (the background thread's, see core/wake.py).
void horolit_set_ring(void (*fn)(void*), void* arg) {
  std::lock_guard<std::mutex> lock(mu);
  ring_arg = arg;
  ring = fn;
  closed = absl::FailedPreconditionError(
      "NotInitializedError: horolite is not initialized: call horolite.init() first");
}

// The runtime can take no more work: enqueue ops fail with this status until
// horolit_set_ring() is called again (the next init).
void horolit_close(int code, const char* message) {
  std::lock_guard<std::mutex> lock(mu);
  ring = nullptr;
  ring_arg = nullptr;
  closed = absl::Status(static_cast<absl::StatusCode>(code), message);
}

// Moves up to `cap` queued items into out; returns how many.
int horolit_take(horolit_item* out, int cap) {
  std::lock_guard<std::mutex> lock(mu);
  const int n = static_cast<int>(queued.size()) < cap ? static_cast<int>(queued.size()) : cap;
  for (int i = 0; i < n; ++i) out[i] = queued[i];
  queued.erase(queued.begin(), queued.begin() + n);
  pending_items.store(static_cast<int64_t>(queued.size()));
  return n;
}

// How many items are queued (a hint: read without the lock).
int horolit_pending(void) { return static_cast<int>(pending_items.load()); }

// Releases the inputs of collective hid (its results are out, or it failed).
void horolit_drop_inputs(int64_t hid) {
  Inputs* in = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = inputs.find(hid);
    if (it == inputs.end()) return;
    in = it->second;
    inputs.erase(it);
  }
  delete in;
}
}
