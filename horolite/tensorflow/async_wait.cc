// horolite's asynchronous wait op for TensorFlow graphs (built on first use by
// native_ops.py against the installed TensorFlow, with enqueue_op.cc). The
// enqueue op hands a tensor to the runtime; when the runtime finishes it, Python
// calls horolit_complete() with the results or an error code. The wait op holds no
// TensorFlow thread meanwhile (an AsyncOpKernel), and fails with the error
// class the code names, which a Python op cannot choose.
// Results 64-byte aligned and marked borrowed (a nonzero token) become the op's
// outputs without a copy: Python keeps their arrays alive until every tensor made
// from them is gone, which horolit_released() reports.
#include <cstdint>
#include <cstring>
#include "absl/strings/str_cat.h"
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

using namespace tensorflow;

namespace {

std::mutex released_mu;
std::vector<int64_t> released;  // tokens whose arrays Python may drop now

// Python's arrays behind borrowed results: gone (reported) with the last reference.
struct Keep {
  int64_t token;
  explicit Keep(int64_t t) : token(t) {}
  ~Keep() {
    std::lock_guard<std::mutex> lock(released_mu);
    released.push_back(token);
  }
};

// An output tensor on Python's memory. OwnsMemory() false: TensorFlow never forwards
// it to an op that writes its output in place.
class BorrowedBuffer : public TensorBuffer {
 public:
  BorrowedBuffer(void* data, size_t size, std::shared_ptr<Keep> keep)
      : TensorBuffer(data), size_(size), keep_(std::move(keep)) {}
  size_t size() const override { return size_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(size_));
    proto->set_allocator_name("horolite");
  }
  bool OwnsMemory() const override { return false; }

 private:
  size_t size_;
  std::shared_ptr<Keep> keep_;
};

constexpr uintptr_t kAlign = 64;  // TensorFlow's (Eigen's) alignment for CPU tensors

// A finished collective's results, borrowed (from Python, during the call, or until
// `keep` is released) or owned.
struct Results {
  std::shared_ptr<Keep> keep;  // set: the data stays valid until it is released
  int code = 0;
  std::string message;
  std::vector<int> dtypes;
  std::vector<const char*> data;
  std::vector<int64_t> nbytes;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<char>> owned;  // set when kept until the wait op runs

  void Own() {
    owned.resize(data.size());
    for (size_t i = 0; i < data.size(); ++i) {
      owned[i].assign(data[i], data[i] + nbytes[i]);
      data[i] = owned[i].data();
    }
  }
};

struct Waiter {
  OpKernelContext* ctx = nullptr;
  AsyncOpKernel::DoneCallback done;
  CancellationManager* cancellation = nullptr;  // the step's, with `token` registered
  CancellationToken token = 0;
};

std::mutex mu;
std::unordered_map<int64_t, Results> finished;  // done before their wait op ran
std::unordered_map<int64_t, Waiter> waiting;    // wait ops whose collective is not done
std::unordered_set<int64_t> cancelled;          // wait ops cancelled before their results came

// When a result can be handed over as it is (borrowed, aligned,
// of the expected size), it becomes the output without a copy; else it is copied.
bool Borrow(OpKernelContext* ctx, const Results& r, int i, const TensorShape& shape) {
  const DataType dtype = ctx->expected_output_dtype(i);
  if (!r.keep || r.nbytes[i] == 0 || reinterpret_cast<uintptr_t>(r.data[i]) % kAlign != 0 ||
      shape.num_elements() * static_cast<int64_t>(DataTypeSize(dtype)) != r.nbytes[i] ||
      DataTypeSize(dtype) == 0) {
    return false;
  }
  auto* buf = new BorrowedBuffer(const_cast<char*>(r.data[i]), r.nbytes[i], r.keep);
  Tensor out(dtype, shape, buf);
  buf->Unref();  // the tensor holds its own reference
  ctx->set_output(i, out);
  return true;
}

void Deliver(OpKernelContext* ctx, const Results& r) {
  if (r.code != 0) {
    ctx->SetStatus(absl::Status(static_cast<absl::StatusCode>(r.code), r.message));
    return;
  }
  // An allgather's results end with every rank's first dimension, which a wait op
  // that does not need them leaves out: the first num_outputs results are its own.
  if (static_cast<int>(r.data.size()) < ctx->num_outputs()) {
    ctx->SetStatus(absl::InternalError(absl::StrCat("horolite wait op: ", r.data.size(),
                                                    " results for ", ctx->num_outputs(), " outputs")));
    return;
  }
  for (int i = 0; i < ctx->num_outputs(); ++i) {
    if (r.dtypes[i] != static_cast<int>(ctx->expected_output_dtype(i))) {
      ctx->SetStatus(absl::InternalError(absl::StrCat("horolite wait op: result ", i, " has dtype enum ",
                                                      r.dtypes[i], ", the op expects ",
                                                      static_cast<int>(ctx->expected_output_dtype(i)))));
      return;
    }
    TensorShape shape;
    for (int64_t d : r.shapes[i]) shape.AddDim(d);
    if (Borrow(ctx, r, i, shape)) continue;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(i, shape, &out));
    auto bytes = out->tensor_data();
    if (static_cast<int64_t>(bytes.size()) != r.nbytes[i]) {
      ctx->SetStatus(absl::InternalError(absl::StrCat("horolite wait op: result ", i, " has ",
                                                      r.nbytes[i], " bytes, expected ", bytes.size())));
      return;
    }
    if (!bytes.empty()) std::memcpy(const_cast<char*>(bytes.data()), r.data[i], bytes.size());
  }
}


}  // namespace

REGISTER_OP("HorolitAsyncWait")
    .Input("handle: int64")
    .Output("outputs: T")
    .Attr("T: list(type) >= 1")
    // Not stateful: tf.function would otherwise run every stateful op in program order,
    // each enqueue after the previous collective's wait (one collective at a time). The
    // enqueue ops are stateful (they must run, in program order, and never block); a
    // wait runs when its enqueue has, and is never folded or merged (its input is an id
    // no other op has).
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->UnknownShape());
      return absl::OkStatus();
    });

class HorolitAsyncWaitOp : public AsyncOpKernel {
 public:
  explicit HorolitAsyncWaitOp(OpKernelConstruction* c) : AsyncOpKernel(c) {}
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    int64_t hid = ctx->input(0).scalar<int64_t>()();
    // A step that fails elsewhere cancels this wait: TensorFlow waits for every async op
    // to finish before it reports the failure, and this collective may never complete
    // (its group's other members were never enqueued: traced_groups.py).
    CancellationManager* cm = ctx->cancellation_manager();
    CancellationToken token = 0;
    if (cm != nullptr) {
      token = cm->get_cancellation_token();
      if (!cm->RegisterCallback(token, [hid]() { Cancel(hid); })) {
        ctx->SetStatus(absl::CancelledError("horolite: the step was cancelled"));
        done();
        return;
      }
    }
    Results r;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = finished.find(hid);
      if (it == finished.end()) {
        waiting[hid] = Waiter{ctx, std::move(done), cm, token};
        return;
      }
      r = std::move(it->second);
      finished.erase(it);
    }
    if (cm != nullptr) cm->TryDeregisterCallback(token);
    Deliver(ctx, r);
    done();
  }

 private:
  static void Cancel(int64_t hid) {
    Waiter w;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = waiting.find(hid);
      if (it == waiting.end()) return;  // delivered meanwhile
      w = std::move(it->second);
      waiting.erase(it);
      cancelled.insert(hid);  // its results, if they still come, are dropped
    }
    w.ctx->SetStatus(absl::CancelledError(
        "horolite: the step was cancelled (another op failed) before this collective completed"));
    w.done();
  }
};

REGISTER_KERNEL_BUILDER(Name("HorolitAsyncWait").Device(DEVICE_CPU), HorolitAsyncWaitOp);

extern "C" void horolit_drop_inputs(int64_t hid);  // enqueue_op.cc

extern "C" {
// Called (through cffi) when handle `hid` finishes: code 0 with n results
// (TensorFlow dtype enums, bytes, every result's dimensions one after the other), or a
// TensorFlow error code and message.
// token 0: the bytes are copied into the wait op's outputs if it already runs, else
// kept. Otherwise Python keeps the data valid until horolit_released() returns token,
// and aligned results become outputs without a copy.
void horolit_complete(int64_t hid, int code, const char* message, int n, const int* dtypes,
                      const char** data, const int64_t* nbytes, const int64_t* dims,
                      const int* ndims, int64_t token) {
  Results r;
  if (token != 0) r.keep = std::make_shared<Keep>(token);
  r.code = code;
  if (message) r.message = message;
  for (int i = 0; i < n; ++i) {
    r.dtypes.push_back(dtypes[i]);
    r.data.push_back(data[i]);
    r.nbytes.push_back(nbytes[i]);
    r.shapes.emplace_back(dims, dims + ndims[i]);
    dims += ndims[i];
  }
  Waiter w;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = waiting.find(hid);
    if (cancelled.erase(hid)) {
      w.ctx = nullptr;  // nobody waits any more
    } else if (it == waiting.end()) {
      if (!r.keep) r.Own();
      finished[hid] = std::move(r);
      w.ctx = nullptr;
    } else {
      w = std::move(it->second);
      waiting.erase(it);
    }
  }
  // The collective is done with its inputs (the native enqueue op's, if it had them).
  horolit_drop_inputs(hid);
  if (w.ctx == nullptr) return;
  if (w.cancellation != nullptr) w.cancellation->TryDeregisterCallback(w.token);
  Deliver(w.ctx, r);
  w.done();
}

// Moves up to `cap` released tokens into out; returns how many.
int horolit_released(int64_t* out, int cap) {
  std::lock_guard<std::mutex> lock(released_mu);
  int n = 0;
  while (n < cap && !released.empty()) {
    out[n++] = released.back();
    released.pop_back();
  }
  return n;
}
}
