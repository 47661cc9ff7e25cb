// horolite's asynchronous wait op for TensorFlow graphs (built on first use by
// native_ops.py against the installed TensorFlow). The enqueue op, a Python
// op, hands a tensor to the runtime; when the runtime finishes it, Python calls
// horolit_complete() with the results or an error code. The wait op holds no
// TensorFlow thread meanwhile (an AsyncOpKernel), and fails with the error
// class the code names, which a Python op cannot choose.
#include <cstring>
#include "absl/strings/str_cat.h"
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

using namespace tensorflow;

namespace {

// A finished collective's results, borrowed (from Python, during the call) or owned.
struct Results {
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
};

std::mutex mu;
std::unordered_map<int64_t, Results> finished;  // done before their wait op ran
std::unordered_map<int64_t, Waiter> waiting;    // wait ops whose collective is not done

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
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->UnknownShape());
      return absl::OkStatus();
    });

class HorolitAsyncWaitOp : public AsyncOpKernel {
 public:
  explicit HorolitAsyncWaitOp(OpKernelConstruction* c) : AsyncOpKernel(c) {}
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    int64_t hid = ctx->input(0).scalar<int64_t>()();
    Results r;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = finished.find(hid);
      if (it == finished.end()) {
        waiting[hid] = Waiter{ctx, std::move(done)};
        return;
      }
      r = std::move(it->second);
      finished.erase(it);
    }
    Deliver(ctx, r);
    done();
  }
};

REGISTER_KERNEL_BUILDER(Name("HorolitAsyncWait").Device(DEVICE_CPU), HorolitAsyncWaitOp);

extern "C" {
// Called (through ctypes) when handle `hid` finishes: code 0 with n results
// (TensorFlow dtype enums, bytes, shapes), or a TensorFlow error code and message.
// The bytes are copied into the wait op's outputs if it already runs, else kept.
void horolit_complete(int64_t hid, int code, const char* message, int n, const int* dtypes,
                      const char** data, const int64_t* nbytes, const int64_t* const* shapes,
                      const int* ndims) {
  Results r;
  r.code = code;
  if (message) r.message = message;
  for (int i = 0; i < n; ++i) {
    r.dtypes.push_back(dtypes[i]);
    r.data.push_back(data[i]);
    r.nbytes.push_back(nbytes[i]);
    r.shapes.emplace_back(shapes[i], shapes[i] + ndims[i]);
  }
  Waiter w;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = waiting.find(hid);
    if (it == waiting.end()) {
      r.Own();
      finished[hid] = std::move(r);
      return;
    }
    w = std::move(it->second);
    waiting.erase(it);
  }
  Deliver(w.ctx, r);
  w.done();
}
}
